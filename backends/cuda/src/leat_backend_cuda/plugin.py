"""Registers the CUDA backend. Imports nothing heavy: cuda-python loads only when the backend is probed."""

from leat import hookimpl


@hookimpl
def register_backends(register):
    register("cuda", "leat_backend_cuda.backend:CUDABackend", priority=100)
