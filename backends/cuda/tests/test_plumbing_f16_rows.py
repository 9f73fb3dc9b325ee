"""test_gpu_qwen35.F16Rows (the oracle with the CUDA backend's f16 rows, what the tiny qwen35 models' default path
is checked against) rounds exactly the products the backend sends to its tensor-core kernels: the tiny qwen35moe's
every product at token counts around each kernel's bounds, through test_plumbing's fake driver (no GPU), with and
without cuBLAS (a stub that computes nothing)."""

import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.testing import write_tiny_gguf


def _module(name, file):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(file))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plumbing, gpu_qwen35 = _module("cuda_test_plumbing", "test_plumbing.py"), _module("gpu_qwen35", "test_gpu_qwen35.py")
fake = plumbing.fake
TENSOR_CORE_PRODUCTS = ("_gemm_few", "_gemm_wg", "_gemm_rows", "_gemm", "_cublas_product")  # each reads f16 rows of x


@pytest.mark.parametrize("with_cublas", [False, True])
def test_f16_rows_round_the_products_the_tensor_cores_take(fake, tmp_path, monkeypatch, with_cublas):
    pytest.importorskip("leat_arch_qwen35")
    from leat_backend_cuda import backend as cuda_backend

    cuda = cuda_backend.CUDABackend()
    cuda.wg_tokens = (9, 16)  # gemm_wg as LEAT_CUDA_WGMMA=16 turns it on
    if with_cublas:
        cuda.cublas = types.SimpleNamespace(gemm_f16=lambda *args: None, version=0)
        cuda._f16_weights = cuda_backend.Memory(cuda_backend.CUBLAS_SCRATCH_BYTES)
    products, tensor_cores = set(), set()
    methods = {m: getattr(cuda_backend.CUDABackend, m) for m in ("matmul",) + TENSOR_CORE_PRODUCTS}

    def recorded(method):
        def call(self, x, weight, *args, **kwargs):
            n = x.size // weight.cols
            (tensor_cores if method in TENSOR_CORE_PRODUCTS else products).add((n, weight.rows, weight.cols))
            return methods[method](self, x, weight, *args, **kwargs)

        return call

    for method in methods:
        monkeypatch.setattr(cuda_backend.CUDABackend, method, recorded(method))
    model = gpu_qwen35.load(
        "qwen35moe", write_tiny_gguf(gpu_qwen35._architecture("qwen35moe"), tmp_path / "m.gguf"), cuda
    )
    kv = cuda.allocate_kv(model.kv_layouts(model.params), 1, 256)
    for n in (1, 8, 9, 16, 17, 32, 33, 48, 159, 160):
        cuda.to_host(model.forward(Batch([Row(0, 0, np.arange(n), all_logits=True)]), kv))
    reference = gpu_qwen35.F16Rows(cuda)
    assert tensor_cores and tensor_cores < products
    assert {p for p in products if reference.rounds(*p)} == tensor_cores
