"""The CUDA ops of MoE, MLA and gpt-oss models against the float64 oracle (the CPU backend in f64):
``moe`` (every gating, selection bias, group-limited routing, both activations, expert biases,
quantized experts), ``head_matmul``, ``mla_attention``, ``attention`` with sinks, and RoPE's magnitude.

As test_gpu_ops: the device backend runs with ``poison=True`` (every activation starts as NaN).
"""

import os

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.modelfile import Tensor
from leat.moe import MoESpec, MoEWeights, selection_margin
from leat.testing import relative_error
from leat_backend_cuda import moe, quants

pytestmark = pytest.mark.gpu
Q = gguf.GGMLQuantizationType


# byte offset of the f16 scale fields (d, and dmin where present) of K types gguf-py cannot quantize
K_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def both(cuda, oracle, name, qtype, values, rng=None):
    """One tensor uploaded to both backends, quantized to ``qtype`` where it is not F32 (K types: random
    blocks with small scales, as gguf-py cannot quantize them)."""
    values = np.asarray(values, np.float32)
    if qtype in K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (values.size // block, size), dtype=np.uint8)
        for offset in K_SCALES[qtype]:
            scale = rng.uniform(0.0005, 0.002, len(data)).astype(np.float16)
            data[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    else:
        data = values if qtype == Q.F32 else gguf.quants.quantize(values.reshape(-1, values.shape[-1]), qtype)
    tensor = Tensor(name, qtype, values.shape, data)
    return cuda.upload(tensor), oracle.upload(tensor)


def tensor_core_bound(cuda, qtype, n):
    """The error bound of a MoE or per-head product of n tokens: f16 products on tensor cores (gemm_grouped) as the
    dense GEMM's bound; a decode step's quantized products with int16 x (gemv_id_q) as the dense gemv_q's; float32
    otherwise."""
    grouped = n > moe.GROUPED_TOKENS and qtype in moe.TENSOR_TYPES and cuda.tensor_cores
    if grouped and os.environ.get("LEAT_CUDA_MOE_GEMM", "1") != "0":
        return 2e-3
    if n <= moe.GROUPED_TOKENS and quants.LAYOUTS[qtype].integer and cuda.integer_experts:
        return 2e-4
    return 1e-5


MOE_CASES = {
    # qwen3moe: softmax over all experts, the k weights renormalized
    "qwen3moe-q8_0": (MoESpec(8, 2, "softmax", normalize=True), Q.Q8_0, False, False),
    # gpt-oss: softmax over the selected logits, clamped SwiGLU, biases everywhere, MXFP4 experts
    "gpt-oss-mxfp4": (MoESpec(4, 2, "softmax_selected", activation="swiglu_oai"), Q.MXFP4, True, False),
    "gpt-oss-f32": (MoESpec(6, 3, "softmax_selected", activation="swiglu_oai"), Q.F32, True, False),
    # DeepSeek V3: sigmoid, selection bias, 2 of 4 groups, normalized and scaled
    "deepseek-v3-q4_0": (MoESpec(16, 4, "sigmoid", True, 2.5, groups=4, groups_used=2), Q.Q4_0, False, True),
    "deepseek-v2-f16": (MoESpec(8, 3, "softmax", scale=1.5), Q.F16, False, False),
    "qwen3moe-q4_k": (MoESpec(8, 2, "softmax", normalize=True), Q.Q4_K, False, False),
    "qwen3moe-q6_k": (MoESpec(8, 2, "softmax", normalize=True), Q.Q6_K, False, False),
}


@pytest.mark.parametrize("case", list(MOE_CASES))
@pytest.mark.parametrize("n", [1, 2, 5, 37])
def test_moe(cuda, oracle, case, n):
    spec, qtype, biases, selection_bias = MOE_CASES[case]
    rng = np.random.default_rng(n + 100 * list(MOE_CASES).index(case))
    d, ffn, e = 256, 256 if qtype in K_SCALES else 64, spec.experts
    pair = {
        "router": both(cuda, oracle, "router", Q.F32, rng.standard_normal((e, d)) / 4),
        "gate": both(cuda, oracle, "gate", qtype, rng.standard_normal((e, ffn, d)) / 8, rng),
        "up": both(cuda, oracle, "up", qtype, rng.standard_normal((e, ffn, d)) / 8, rng),
        "down": both(cuda, oracle, "down", qtype, rng.standard_normal((e, d, ffn)) / 8, rng),
    }
    if biases:
        pair["router_bias"] = both(cuda, oracle, "router_bias", Q.F32, rng.standard_normal(e))
        pair["gate_bias"] = both(cuda, oracle, "gate_bias", Q.F32, rng.standard_normal((e, ffn)))
        pair["up_bias"] = both(cuda, oracle, "up_bias", Q.F32, rng.standard_normal((e, ffn)))
        pair["down_bias"] = both(cuda, oracle, "down_bias", Q.F32, rng.standard_normal((e, d)))
    if selection_bias:
        pair["selection_bias"] = both(cuda, oracle, "exp_probs_b", Q.F32, rng.standard_normal(e) / 4)
    x = rng.standard_normal((n, d)) * 3
    want = oracle.moe(x, MoEWeights(**{k: v[1] for k, v in pair.items()}), spec)
    got = cuda.to_host(cuda.moe(cuda.from_host(x), MoEWeights(**{k: v[0] for k, v in pair.items()}), spec))
    # tokens whose expert choice is within rounding of a tie may pick another expert: leave them out
    logits = oracle.matmul(x, pair["router"][1], pair.get("router_bias", (None, None))[1])
    decided = selection_margin(logits, spec, pair.get("selection_bias", (None, None))[1]) > 1e-4
    assert np.isfinite(got).all()
    assert decided.sum() >= n - 1
    assert relative_error(got[decided], want[decided]) < tensor_core_bound(cuda, qtype, n)


@pytest.mark.parametrize("n", [1, 37])
def test_a_moe_layers_weighted_sum_goes_into_its_residual_add(cuda, oracle, n):
    """moe's weighted sum of the experts' outputs waits for the layer's residual add, which runs it (moe_combine with
    the residual): the same values as the sum, then add, bit for bit, and the oracle's."""
    from leat_backend_cuda.backend import Pending, _ready

    spec, qtype = MOE_CASES["qwen3moe-q4_k"][:2]
    rng = np.random.default_rng(70 + n)
    d, ffn, e = 256, 256, spec.experts
    pair = {
        "router": both(cuda, oracle, "router", Q.F32, rng.standard_normal((e, d)) / 4),
        "gate": both(cuda, oracle, "gate", qtype, rng.standard_normal((e, ffn, d)) / 8, rng),
        "up": both(cuda, oracle, "up", qtype, rng.standard_normal((e, ffn, d)) / 8, rng),
        "down": both(cuda, oracle, "down", qtype, rng.standard_normal((e, d, ffn)) / 8, rng),
    }
    x, residual = rng.standard_normal((n, d)) * 3, rng.standard_normal((n, d))
    weights = MoEWeights(**{k: v[0] for k, v in pair.items()})
    routed = cuda.moe(cuda.from_host(x), weights, spec)
    assert isinstance(routed, Pending)
    fused = cuda.to_host(cuda.add(cuda.from_host(residual), routed))
    assert routed.waiting("combine")  # the sum alone was never made
    again = cuda.moe(cuda.from_host(x), weights, spec)
    plain = cuda.to_host(cuda.add(cuda.from_host(residual), _ready(again)))
    np.testing.assert_array_equal(fused, plain)
    want = residual + oracle.moe(x, MoEWeights(**{k: v[1] for k, v in pair.items()}), spec)
    logits = oracle.matmul(x, pair["router"][1], None)
    decided = selection_margin(logits, spec, None) > 1e-4
    assert relative_error(fused[decided], want[decided]) < tensor_core_bound(cuda, qtype, n)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("n", [1, 3, 40])
def test_head_matmul(cuda, oracle, qtype, n):
    rng = np.random.default_rng(n)
    heads, m, k = 5, 48, 64
    weight = both(cuda, oracle, "blk.0.attn_k_b.weight", qtype, rng.standard_normal((heads, m, k)))
    x = rng.standard_normal((n, heads, k))
    want = oracle.head_matmul(x, weight[1])
    got = cuda.to_host(cuda.head_matmul(cuda.from_host(x), weight[0]))
    assert relative_error(got, want) < tensor_core_bound(cuda, qtype, n)


def test_head_matmul_rows_not_a_multiple_of_8(cuda, oracle):
    rng = np.random.default_rng(1)
    weight = both(cuda, oracle, "w", Q.F32, rng.standard_normal((3, 10, 12)))  # the plain float32 kernel
    x = rng.standard_normal((4, 3, 12))
    got = cuda.to_host(cuda.head_matmul(cuda.from_host(x), weight[0]))
    assert relative_error(got, oracle.head_matmul(x, weight[1])) < 1e-6


def latent_caches(cuda, oracle, layouts, kv_dtype, context, dims, tokens, rng):
    """Latent caches of three slots on both backends (slot 1's pages in reverse order), and two sequences' random
    MLA inputs (q_latent, q_rope, latent, k_rope) of ``tokens`` tokens for ``dims`` (heads, rank, rope)."""
    heads, rank, rope = dims
    kvs = [b.allocate_kv(layouts, slots=3, context=context, page_size=16, dtype=kv_dtype) for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    shapes = ((tokens, heads, rank), (tokens, heads, rope), (tokens, rank), (tokens, rope))
    return kvs, {s: [rng.standard_normal(shape) for shape in shapes] for s in (0, 1)}


@pytest.mark.parametrize("gemm", ["0", "1"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,rank,rope", [(4, 32, 8), (3, 64, 16), (16, 512, 64)])
def test_mla_attention_prefill_then_decode(cuda, oracle, monkeypatch, kv_dtype, window, heads, rank, rope, gemm):
    # gemm "1": the 23-token row takes cuBLAS's prefill (f16 rows, as any f16 product: the f16 bar) beside the
    # float32 kernel's 9-token row; "0": the float32 kernel for every row, held to float32's bar with an f32 cache
    monkeypatch.setenv("LEAT_CUDA_MLA_GEMM", gemm)
    bar = 1e-5 if kv_dtype == "f32" and gemm == "0" else 2e-3
    rng = np.random.default_rng(heads)
    layouts = [KVLayout(1, rank + rope, rank, window=window, latent=True)] * 2
    kvs, seqs = latent_caches(cuda, oracle, layouts, kv_dtype, 80, (heads, rank, rope), 40, rng)
    steps = [[(0, 0, 23), (1, 0, 9)], [(1, 9, 1), (0, 23, 3)], [(0, 26, 1), (1, 10, 1)]]
    for step in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        args = [np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(4)]
        for layer in (0, 1):
            want = oracle.mla_attention(*args, kvs[1], layer, batch, 0.2)
            got = cuda.mla_attention(*(cuda.from_host(a) for a in args), kvs[0], layer, batch, 0.2)
            assert relative_error(cuda.to_host(got), want) < bar


def latent_long_context(cuda, oracle, dims, scale, bar, seed, kv_dtype="f32"):
    """Latent attention of one sequence of 1,203 tokens of ``dims`` (heads, rank, rope) in a cache of 1,280: a
    700-token prefill, decode steps split over the sequence, a 497-token chunk and decode past 1,024 positions, each
    output within ``bar`` of the oracle's over the same cache."""
    rng = np.random.default_rng(seed)
    heads, rank, rope = dims
    layouts = [KVLayout(1, rank + rope, rank, latent=True)]
    kvs = [b.allocate_kv(layouts, slots=1, context=1280, dtype=kv_dtype) for b in (cuda, oracle)]
    args = [rng.standard_normal(s) for s in ((1203, heads, rank), (1203, heads, rope), (1203, rank), (1203, rope))]
    for start, n in ((0, 700), (700, 1), (701, 2), (703, 497), (1200, 1), (1201, 2)):
        batch = Batch([Row(0, start, np.zeros(n, int), all_logits=True)])
        part = [a[start : start + n] for a in args]
        want = oracle.mla_attention(*part, kvs[1], 0, batch, scale)
        got = cuda.mla_attention(*(cuda.from_host(a) for a in part), kvs[0], 0, batch, scale)
        assert relative_error(cuda.to_host(got), want) < bar


def test_mla_attention_long_context_splits(cuda, oracle, monkeypatch):
    monkeypatch.setenv("LEAT_CUDA_MLA_GEMM", "0")  # the float32 kernel's splits (not cuBLAS's prefill)
    latent_long_context(cuda, oracle, (8, 128, 32), 0.1, 1e-5, 12)


@pytest.mark.parametrize("kv_dtype,heads", [("f16", 16), ("q8_0", 40)])
def test_mla_attention_on_tensor_cores(cuda, oracle, monkeypatch, kv_dtype, heads):
    """mla_attention_tc (LEAT_CUDA_MLA_TC=1; DeepSeek's 512 + 64) for the decode steps (the prefill chunks take
    mla_attention) at depths up to 1,200: f16 queries and probabilities, the f16 bar."""
    monkeypatch.setenv("LEAT_CUDA_MLA_GEMM", "0")
    monkeypatch.setenv("LEAT_CUDA_MLA_TC", "1")
    latent_long_context(cuda, oracle, (heads, 512, 64), 0.05, 2e-3, 14, kv_dtype)


def test_latent_cache_has_no_value_storage_and_pages_copy(cuda, oracle):
    rng = np.random.default_rng(13)
    layouts = [KVLayout(1, 40, 32, latent=True)]
    kv = cuda.allocate_kv(layouts, slots=2, context=32, pages=6, page_size=16)
    assert kv.v[0].nbytes == 0 and kv.k[0].nbytes == 6 * 16 * 40 * 4
    ref = oracle.allocate_kv(layouts, slots=2, context=32, pages=6, page_size=16)
    for b, cache in ((cuda, kv), (oracle, ref)):
        b.set_pages(cache, 0, np.array([4, 1]))
    args = [rng.standard_normal(s) for s in ((20, 2, 32), (20, 2, 8), (20, 32), (20, 8))]
    prefill = Batch([Row(0, 0, np.zeros(20, int), all_logits=True)])
    oracle.mla_attention(*args, ref, 0, prefill, 0.3)
    cuda.mla_attention(*(cuda.from_host(a) for a in args), kv, 0, prefill, 0.3)
    for b, cache in ((cuda, kv), (oracle, ref)):
        b.copy_page(cache, 4, 2)
        b.set_pages(cache, 1, np.array([2, 5]))
    contents = cuda.read_pages(kv, [2, 5])
    cuda.write_pages(kv, [2, 5], contents)
    step = [rng.standard_normal(s) for s in ((1, 2, 32), (1, 2, 8), (1, 32), (1, 8))]
    batch = Batch([Row(1, 16, np.zeros(1, int))])
    want = oracle.mla_attention(*step, ref, 0, batch, 0.3)
    got = cuda.mla_attention(*(cuda.from_host(a) for a in step), kv, 0, batch, 0.3)
    assert relative_error(cuda.to_host(got), want) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (8, 1, 64), (6, 3, 32)])
def test_attention_sinks_prefill_then_decode(cuda, oracle, kv_dtype, window, heads, kv_heads, dim):
    rng = np.random.default_rng(dim + heads)
    layouts = [KVLayout(kv_heads, dim, window=window)]
    kvs = [b.allocate_kv(layouts, slots=2, context=80, dtype=kv_dtype) for b in (cuda, oracle)]
    # sinks from far below to far above the scores: the sink from negligible to taking most of the mass
    sinks = both(cuda, oracle, "blk.0.attn_sinks.weight", Q.F32, np.linspace(-20, 6, heads))
    seqs = {s: [rng.standard_normal((40, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    steps = [[(0, 0, 23), (1, 0, 9)], [(1, 9, 1), (0, 23, 3)], [(0, 26, 1), (1, 10, 1)]]
    for step in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(3))
        want = oracle.attention(q, k, v, kvs[1], 0, batch, 0.3, sinks=sinks[1])
        got = cuda.attention(*(cuda.from_host(t) for t in (q, k, v)), kvs[0], 0, batch, 0.3, sinks=sinks[0])
        assert relative_error(cuda.to_host(got), want) < (1e-5 if kv_dtype == "f32" else 2e-3)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_attention_sinks_long_context_splits(cuda, oracle, kv_dtype):
    """Prefill of 700 with a wide head (the flash kernel's size), decode split over the sequence (the
    combine kernel adds the sink)."""
    rng = np.random.default_rng(14)
    heads, kv_heads, dim = 8, 2, 64
    kvs = [b.allocate_kv([KVLayout(kv_heads, dim)], slots=1, context=1280, dtype=kv_dtype) for b in (cuda, oracle)]
    sinks = both(cuda, oracle, "sinks", Q.F32, rng.standard_normal(heads) * 2)
    q, k, v = (rng.standard_normal((1203, h, dim)) for h in (heads, kv_heads, kv_heads))
    for start, n in ((0, 700), (700, 1), (701, 2), (703, 497), (1200, 1), (1201, 2)):
        batch = Batch([Row(0, start, np.zeros(n, int), all_logits=True)])
        args = [t[start : start + n] for t in (q, k, v)]
        want = oracle.attention(*args, kvs[1], 0, batch, 0.125, sinks=sinks[1])
        got = cuda.attention(*(cuda.from_host(t) for t in args), kvs[0], 0, batch, 0.125, sinks=sinks[0])
        assert relative_error(cuda.to_host(got), want) < (1e-5 if kv_dtype == "f32" else 2e-3)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_magnitude(cuda, oracle, neox):
    """RopeSpec.attn_factor (YaRN's magnitude, gpt-oss and DeepSeek) multiplies cos and sin."""
    rng = np.random.default_rng(15)
    x, positions = rng.standard_normal((5, 3, 64)), np.array([0, 3, 70, 1000, 4095])
    spec = RopeSpec(64, 150000.0, neox, 1.0, np.linspace(1, 32, 32), attn_factor=1.3465735902799727)
    want = oracle.rope(x, positions, spec)
    assert relative_error(cuda.to_host(cuda.rope(cuda.from_host(x), positions, spec)), want) < 1e-6
