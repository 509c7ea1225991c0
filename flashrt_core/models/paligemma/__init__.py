"""The PaliGemma prefix that pi0.5 and pi0 share (SigLIP + projector + Gemma): `reference` (eager torch) and
`engine` (fused, static buffers, CUDA graphs; the action experts build on `engine.PaliGemmaEngine`)."""
