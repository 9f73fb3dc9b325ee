"""The tensor-core grouped products (experts.cu's gemm_grouped) on the device against the float64 oracle: a MoE layer
of every type they take with uneven loads (an expert no token picks, one every token picks, chunks not a whole
number of tiles, row lengths past the last whole staged chunk), per-head products, and the float32 path that
LEAT_CUDA_MOE_GEMM=0 selects in their place. kernels/ emulated on the host: test_moe_mla_on_host.py."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.moe import MoESpec, MoEWeights, route, selection_margin
from leat.testing import relative_error
from leat_backend_cuda import moe, quants

pytestmark = pytest.mark.gpu
_spec = importlib.util.spec_from_file_location("gpu_moe_mla", Path(__file__).parent / "test_gpu_moe_mla.py")
gpu_moe_mla = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_moe_mla)
both = gpu_moe_mla.both


def sizes(qtype):
    """(model width, expert width): 256-value blocks in whole staged chunks, 32-value ones with a partial last one."""
    return (512, 256) if quants.LAYOUTS[qtype].block == 256 else (320, 160)


@pytest.mark.parametrize("qtype", moe.TENSOR_TYPES, ids=lambda q: q.name)
def test_moe_uneven_loads(cuda, oracle, qtype, monkeypatch):
    rng = np.random.default_rng(int(qtype))
    n, spec = 150, MoESpec(8, 2, "sigmoid", normalize=True)
    d, ffn = sizes(qtype)
    e = spec.experts
    selection = np.zeros(e)
    selection[3], selection[0] = 1e3, -1e3  # expert 3 in every token's pairs, expert 0 in none; weights unbiased
    pair = {
        "router": both(cuda, oracle, "router", gpu_moe_mla.Q.F32, rng.standard_normal((e, d)) / 40),
        "selection_bias": both(cuda, oracle, "exp_probs_b", gpu_moe_mla.Q.F32, selection),
        "gate": both(cuda, oracle, "gate", qtype, rng.standard_normal((e, ffn, d)) / 8, rng),
        "up": both(cuda, oracle, "up", qtype, rng.standard_normal((e, ffn, d)) / 8, rng),
        "down": both(cuda, oracle, "down", qtype, rng.standard_normal((e, d, ffn)) / 8, rng),
    }
    x = rng.standard_normal((n, d)) * 3
    want = oracle.moe(x, MoEWeights(**{k: v[1] for k, v in pair.items()}), spec)
    logits = oracle.matmul(x, pair["router"][1])
    ids, _ = route(logits, spec, selection)
    assert (ids == 3).any(axis=1).all() and not (ids == 0).any()
    decided = selection_margin(logits, spec, selection) > 1e-4
    assert decided.sum() >= n - 1
    # gemm_grouped in each instantiation (chunk size, stages of x), then gemv_grouped in float32
    for path, (tiles, stages), bound in [("1", v, 2e-3) for v in moe.GEMM_VARIANTS] + [("0", (8, 2), 1e-4)]:
        monkeypatch.setenv("LEAT_CUDA_MOE_GEMM", path)
        monkeypatch.setenv("LEAT_CUDA_MOE_TILES", str(tiles))
        monkeypatch.setenv("LEAT_CUDA_MOE_STAGES", str(stages))
        got = cuda.to_host(cuda.moe(cuda.from_host(x), MoEWeights(**{k: v[0] for k, v in pair.items()}), spec))
        assert np.isfinite(got).all()
        assert relative_error(got[decided], want[decided]) < bound, (path, tiles, stages)


@pytest.mark.parametrize("qtype", moe.TENSOR_TYPES, ids=lambda q: q.name)
def test_head_matmul_grouped(cuda, oracle, qtype):
    rng = np.random.default_rng(int(qtype) + 1)
    n, heads, m = 100, 3, 72
    k = sizes(qtype)[0]
    weight = both(cuda, oracle, "blk.0.attn_k_b.weight", qtype, rng.standard_normal((heads, m, k)) / 8, rng)
    x = rng.standard_normal((n, heads, k))
    got = cuda.to_host(cuda.head_matmul(cuda.from_host(x), weight[0]))
    assert np.isfinite(got).all()
    assert relative_error(got, oracle.head_matmul(x, weight[1])) < 2e-3
