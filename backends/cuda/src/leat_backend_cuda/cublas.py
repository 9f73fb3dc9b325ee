"""NVIDIA's cuBLAS, where it is installed, for the products of many tokens.

Prefill is a matrix product of many tokens by every weight matrix. The backend's own tensor-core
GEMM (``kernels/matmul.cu``) decodes quantized tiles into shared memory and multiplies them with
Ampere-style ``mma.sync``; cuBLAS's f16 GEMM uses Hopper's own instructions. On an H200 (the
llama3-8b bench file's shapes) cuBLAS runs 720-900 TFLOP/s at 512-2048 tokens where the own GEMM
runs ~155, so for those products the backend decodes the weight to f16 rows (``dequantize_f16``)
and calls cuBLAS; see :meth:`CUDABackend.matmul <leat_backend_cuda.backend.CUDABackend.matmul>`.

cuBLAS comes from the ``nvidia-cublas`` wheel (``pip install 'leat-backend-cuda[cublas]'``) or
a CUDA toolkit, found with ``cuda.pathfinder``; without it the backend uses its own GEMM.
Activations stay 16-bit or wider: f16 inputs, float32 accumulation (``CUBLAS_COMPUTE_32F``, never
the reduced-precision modes) and float32 outputs.
"""

from __future__ import annotations

import ctypes
from typing import Any

from leat_backend_cuda import driver

# cublas_api.h / library_types.h
_OP_N, _OP_T = 0, 1
_R_16F, _R_32F = 2, 0
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
#: cuBLAS's workspace: set explicitly so that products captured in a CUDA graph allocate nothing
WORKSPACE_BYTES = 32 << 20

_lib: Any = None
_missing: str | None = None


def library() -> Any:
    """The loaded libcublas (ctypes), or None when it cannot be found (:func:`missing` says why)."""
    global _lib, _missing
    if _lib is None and _missing is None:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            _lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
        except (ImportError, OSError, RuntimeError) as error:  # not installed or not loadable: the own GEMM
            _missing = f"{type(error).__name__}: {error}"
            return None
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p
        _lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, f, p, i, i, p, i, i, f, p, i, i, i, i]
        _lib.cublasGemmEx.restype = i
    return _lib


def missing() -> str | None:
    """Why cuBLAS is not used (None when it is loadable)."""
    library()
    return _missing


class CublasError(driver.CudaError):
    """A cuBLAS call returned an error status."""


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed: cuBLAS status {status}")


def open_handle(device: driver.Device) -> Cublas | None:
    """A :class:`Cublas` on ``device``, or None where cuBLAS is missing or does not start (:func:`missing` then
    says why): the backend's own GEMM runs instead."""
    global _missing
    if library() is None:
        return None
    try:
        return Cublas(device)
    except CublasError as error:
        _missing = str(error)
        return None


class Cublas:
    """One cuBLAS handle on the device's stream, with a fixed workspace."""

    def __init__(self, device: driver.Device):
        lib = library()
        if lib is None:
            raise CublasError(f"cuBLAS is not available ({_missing})")
        device.activate()
        self.lib = lib
        self.handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        _check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(int(device.stream))), "cublasSetStream")
        self.workspace = driver.Memory(WORKSPACE_BYTES)
        _check(
            lib.cublasSetWorkspace_v2(
                self.handle, ctypes.c_void_p(self.workspace.ptr), ctypes.c_size_t(WORKSPACE_BYTES)
            ),
            "cublasSetWorkspace",
        )
        version = ctypes.c_int()
        _check(lib.cublasGetVersion_v2(self.handle, ctypes.byref(version)), "cublasGetVersion")
        self.version = version.value
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def gemm_f16(self, w: int, x: int, y: int, m: int, n: int, k: int, ldy: int) -> None:
        """``y[t, j] = sum_c x[t, c] * w[j, c]`` for t < n, j < m: ``w`` [m, k] and ``x`` [n, k] f16 rows,
        ``y`` float32 rows ``ldy`` apart (the first m of each written). Row-major products as
        cuBLAS's column-major ``y^T = w x^T``."""
        status = self.lib.cublasGemmEx(
            self.handle, _OP_T, _OP_N, m, n, k, ctypes.byref(self._one), w, _R_16F, k, x, _R_16F, k,
            ctypes.byref(self._zero), y, _R_32F, ldy, _COMPUTE_32F, _GEMM_DEFAULT,
        )  # fmt: skip
        _check(status, "cublasGemmEx")

    def __del__(self):
        lib, handle = getattr(self, "lib", None), getattr(self, "handle", None)
        if lib is not None and handle:
            driver.release(lib.cublasDestroy_v2, handle)  # not during a capture: it frees its workspace
