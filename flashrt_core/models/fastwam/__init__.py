"""FastWAM (LeRobot 0.6.1 `policies/fastwam`): config, LeRobot weights, eager reference of the two DiTs.

    from flashrt_core.models.fastwam import FastWAMConfig, convert, reference
    config = FastWAMConfig.from_lerobot(config_json)
    weights = convert(config, state_dict)                    # LeRobot's model.safetensors keys
    cache = reference.prefill(weights, first_frame_latents, text_emb, state)
    actions = reference.denoise(weights, cache, noise)
    policy = load(DIR)                                        # a LeRobot folder + the frozen VAE / UMT5
    actions = policy.predict_chunk(frames, state, task)      # LeRobot's whole pipeline, robot units
The VAE and UMT5 encoder that make `first_frame_latents` and `text_emb` run through diffusers / transformers
(encoders.py).
"""
from flashrt_core.models.fastwam.config import DiTConfig, FastWAMConfig
from flashrt_core.models.fastwam.policy import FastWAMPolicy, load
from flashrt_core.models.fastwam.reference import VideoCache
from flashrt_core.models.fastwam.weights import DiTLayer, FastWAMWeights, check_keys, convert, expected_keys

__all__ = ["load", "FastWAMPolicy", "FastWAMConfig", "DiTConfig", "FastWAMWeights", "DiTLayer", "VideoCache",
           "convert", "check_keys", "expected_keys"]
