"""leat's CUDA backend: cuda-python driver API, NVRTC-compiled kernels over GGUF blocks, CUDA graphs."""
