"""MLA prefill through cuBLAS (mla.py's _mla_gemm; LEAT_CUDA_MLA_GEMM=0 switches it off) on the device against
the float64 oracle: rows of 16 tokens or more after earlier chunks of the same sequences, two sequences in a step,
one beside a decode row (the float32 kernel's), windows, every latent cache type, DeepSeek-V2-Lite's shape,
queries in pieces. Its kernels on the host: test_moe_mla_on_host.py."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.testing import relative_error
from leat_backend_cuda import mla

pytestmark = pytest.mark.gpu
_spec = importlib.util.spec_from_file_location("gpu_moe_mla", Path(__file__).parent / "test_gpu_moe_mla.py")
gpu_moe_mla = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_moe_mla)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("heads,rank,rope", [(4, 32, 32), (16, 512, 64)])
def test_mla_prefill_through_cublas(cuda, oracle, monkeypatch, kv_dtype, window, heads, rank, rope):
    if cuda.cublas is None:
        pytest.skip("no cuBLAS")
    monkeypatch.setenv("LEAT_CUDA_MLA_GEMM", "1")
    monkeypatch.setattr(mla, "MLA_GEMM_SCORES", 10 * heads * 64)  # every row's queries in pieces
    rng = np.random.default_rng(heads + len(kv_dtype))
    layouts = [KVLayout(1, rank + rope, rank, window=window, latent=True)]
    kvs, seqs = gpu_moe_mla.latent_caches(cuda, oracle, layouts, kv_dtype, 96, (heads, rank, rope), 90, rng)
    # the last step beside a decode row, which the float32 kernel takes
    for step in ([(0, 0, 37)], [(0, 37, 16), (1, 0, 50)], [(1, 50, 30), (0, 53, 1)]):
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        args = [np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(4)]
        want = oracle.mla_attention(*args, kvs[1], 0, batch, 0.2)
        got = cuda.to_host(cuda.mla_attention(*(cuda.from_host(a) for a in args), kvs[0], 0, batch, 0.2))
        assert np.isfinite(got).all()
        assert relative_error(got, want) < 3e-3, step
