"""What every engine shares, independent of the model: CUDA graphs over static buffers (`graphs`), the staged
engine that runs a model's stages and whole decisions through them (`staged`), the launch-choice pickers for
GEMMs (`gemm`) and attention (`attention`), the cuBLASLt route (`blas`), the act-graph ranking (`rerank`),
the tuning cache (`tuning`) and the timing they measure with (`timing`)."""
