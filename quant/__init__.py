"""FP8 / NVFP4 quantization: the numerics contract, QuantLinear and model conversion."""
