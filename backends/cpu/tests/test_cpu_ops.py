"""Every CPU op against a plain float64 reference written here, in both precisions."""

import math

import numpy as np
import pytest
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat_backend_cpu.backend import CPUBackend

TOL = {"f32": 2e-5, "f64": 1e-12}


@pytest.fixture(params=["f32", "f64"])
def backend(request):
    return CPUBackend(request.param)


def close(backend, got, want):
    np.testing.assert_allclose(
        np.asarray(got, np.float64), want, rtol=TOL[backend.precision], atol=TOL[backend.precision]
    )


def test_matmul_with_bias(backend):
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((5, 32)), rng.standard_normal((7, 32)), rng.standard_normal(7)
    want = np.array([[sum(x[i, k] * w[j, k] for k in range(32)) + b[j] for j in range(7)] for i in range(5)])
    dt = backend.dtype
    close(backend, backend.matmul(x.astype(dt), w.astype(dt), b.astype(dt)), want)


def test_rms_norm(backend):
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((4, 3, 16)), rng.standard_normal(16)
    want = np.empty_like(x)
    for idx in np.ndindex(4, 3):
        row = x[idx]
        want[idx] = row / math.sqrt(sum(v * v for v in row) / 16 + 1e-6) * w
    close(backend, backend.rms_norm(x.astype(backend.dtype), w.astype(backend.dtype), 1e-6), want)


def rope_reference(x, positions, dims, base, neox, scale=1.0, factors=None):
    out = x.copy()
    for t, pos in enumerate(positions):
        for i in range(dims // 2):
            freq = base ** (-2 * i / dims) / (factors[i] if factors is not None else 1.0)
            angle = pos * scale * freq
            a, b = (i, i + dims // 2) if neox else (2 * i, 2 * i + 1)
            for h in range(x.shape[1]):
                xa, xb = x[t, h, a], x[t, h, b]
                out[t, h, a] = xa * math.cos(angle) - xb * math.sin(angle)
                out[t, h, b] = xa * math.sin(angle) + xb * math.cos(angle)
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dims", [16, 8])
def test_rope(backend, neox, dims):
    rng = np.random.default_rng(3)
    x, positions = rng.standard_normal((5, 2, 16)), np.array([0, 1, 7, 100, 4000])
    factors = np.linspace(1, 4, dims // 2)
    spec = RopeSpec(dims, 10000.0, neox, 0.5, factors)
    want = rope_reference(x, positions, dims, 10000.0, neox, 0.5, factors)
    close(backend, backend.rope(x.astype(backend.dtype), positions, spec), want)


def attention_reference(q, keys, values, positions, key_positions, scale, window=None):
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((n, heads, values.shape[2]))
    for t in range(n):
        for h in range(heads):
            allowed = [
                j
                for j, kp in enumerate(key_positions)
                if kp <= positions[t] and (window is None or kp > positions[t] - window)
            ]
            scores = np.array([q[t, h] @ keys[j, h // group] * scale for j in allowed])
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[t, h] = sum(pj * values[j, h // group] for pj, j in zip(p, allowed))
    return out.reshape(n, -1)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_prefill_then_decode_two_sequences(backend, window):
    rng = np.random.default_rng(4)
    heads, kv_heads, dim, dt = 6, 2, 8, backend.dtype
    kv = backend.allocate_kv([KVLayout(kv_heads, dim, window=window)], slots=2, context=16)
    seqs = {s: [rng.standard_normal((9, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    # step 1: sequence 0 prefills 6 tokens, sequence 1 prefills 4
    rows = [Row(0, 0, np.zeros(6, int), all_logits=True), Row(1, 0, np.zeros(4, int), all_logits=True)]
    spans = [(0, 0, 6), (1, 0, 4)]
    for step_rows, step_spans in (
        [rows, spans],
        [[Row(1, 4, np.zeros(1, int)), Row(0, 6, np.zeros(3, int))], [(1, 4, 1), (0, 6, 3)]],
    ):
        batch = Batch(step_rows)
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step_spans]) for i in range(3))
        out = backend.attention(q.astype(dt), k.astype(dt), v.astype(dt), kv, 0, batch, 0.3)
        offset = 0
        for s, a, n in step_spans:
            sq, sk, sv = seqs[s]
            want = attention_reference(
                sq[a : a + n], sk[: a + n], sv[: a + n], range(a, a + n), range(a + n), 0.3, window
            )
            close(backend, out[offset : offset + n], want)
            offset += n


def test_silu_mul_and_add(backend):
    x, y = np.linspace(-100, 30, 41), np.linspace(2, -3, 41)
    want = np.array([a / (1 + math.exp(-a)) * b for a, b in zip(x, y)])
    close(backend, backend.silu_mul(x.astype(backend.dtype), y.astype(backend.dtype)), want)
    close(backend, backend.add(x.astype(backend.dtype), y.astype(backend.dtype)), x + y)


def test_embed_and_take_rows(backend):
    table = np.arange(20.0).reshape(5, 4).astype(backend.dtype)
    np.testing.assert_array_equal(backend.embed(table, np.array([4, 0, 4])), table[[4, 0, 4]])
    np.testing.assert_array_equal(backend.take_rows(table, np.array([1, 3])), table[[1, 3]])


def test_attention_reads_through_a_shuffled_page_table(backend):
    rng = np.random.default_rng(5)
    dt, layout = backend.dtype, KVLayout(2, 4)
    q, k, v = rng.standard_normal((11, 4, 4)), rng.standard_normal((11, 2, 4)), rng.standard_normal((11, 2, 4))
    contiguous = backend.allocate_kv([layout], slots=1, context=12, page_size=4)
    paged = backend.allocate_kv([layout], slots=2, context=12, pages=7, page_size=4)
    backend.set_pages(paged, 1, np.array([5, 0, 3]))
    assert paged.page_table[0].tolist() == [-1, -1, -1] and paged.context == 12
    args = (q.astype(dt), k.astype(dt), v.astype(dt))
    want = backend.attention(*args, contiguous, 0, Batch([Row(0, 0, np.zeros(11, int), all_logits=True)]), 0.5)
    got = backend.attention(*args, paged, 0, Batch([Row(1, 0, np.zeros(11, int), all_logits=True)]), 0.5)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(paged.k[0][3, :3], k[8:].astype(dt))
    backend.copy_page(paged, 3, 6)
    np.testing.assert_array_equal(paged.v[0][6], paged.v[0][3])


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_kv_storage_types_round_trip_as_gguf_does(backend, kv_dtype):
    import gguf

    rng = np.random.default_rng(6)
    q, k, v = rng.standard_normal((5, 2, 32)), rng.standard_normal((5, 1, 32)), rng.standard_normal((5, 1, 32))
    kv = backend.allocate_kv([KVLayout(1, 32)], slots=1, context=8, page_size=4, dtype=kv_dtype)
    dt = backend.dtype
    backend.attention(q.astype(dt), k.astype(dt), v.astype(dt), kv, 0, Batch([Row(0, 0, np.zeros(5, int))]), 0.1)
    stored = kv.k[0].reshape(-1, 1, 32)[:5]
    if kv_dtype == "f16":
        np.testing.assert_array_equal(stored, k.astype(dt).astype(np.float16))
    else:
        want = gguf.quants.dequantize(
            gguf.quants.quantize(k.astype(np.float32).reshape(5, 32), gguf.GGMLQuantizationType.Q8_0),
            gguf.GGMLQuantizationType.Q8_0,
        )
        scale = kv.k_scale[0].reshape(-1, 1, 1)[:5]
        got = stored.astype(np.float32) * scale.astype(np.float32)
        np.testing.assert_allclose(got.reshape(5, 32), want, atol=float(np.abs(want).max()) / 127 + 1e-6)
        assert np.mean(np.isclose(got.reshape(5, 32), want, rtol=1e-6, atol=1e-7)) > 0.99


def test_rope_attn_factor_scales_the_rotated_dims_only(backend):
    rng = np.random.default_rng(7)
    x, positions = rng.standard_normal((4, 2, 16)), np.array([0, 3, 50, 900])
    factors = np.linspace(1, 3, 4)
    spec = RopeSpec(8, 500.0, True, 1.0, factors, attn_factor=1.3)
    want = rope_reference(x, positions, 8, 500.0, True, 1.0, factors)
    want[..., :8] *= 1.3
    close(backend, backend.rope(x.astype(backend.dtype), positions, spec), want)


def sinks_reference(q, keys, values, positions, key_positions, scale, sinks, window=None):
    """attention_reference with each head's sink logit in the softmax denominator."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((n, heads, values.shape[2]))
    for t in range(n):
        for h in range(heads):
            allowed = [
                j
                for j, kp in enumerate(key_positions)
                if kp <= positions[t] and (window is None or kp > positions[t] - window)
            ]
            scores = [float(q[t, h] @ keys[j, h // group]) * scale for j in allowed]
            denominator = math.exp(sinks[h]) + sum(math.exp(s) for s in scores)
            out[t, h] = sum(math.exp(s) / denominator * values[j, h // group] for s, j in zip(scores, allowed))
    return out.reshape(n, -1)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_sinks_prefill_then_decode_two_sequences(backend, window):
    rng = np.random.default_rng(8)
    heads, kv_heads, dim, dt = 6, 2, 8, backend.dtype
    sinks = np.array([-2.0, 0.0, 1.5, 4.0, -30.0, 0.7])  # from negligible to dominant
    kv = backend.allocate_kv([KVLayout(kv_heads, dim, window=window)], slots=2, context=16, page_size=4)
    seqs = {s: [rng.standard_normal((9, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    steps = [
        (
            [Row(0, 0, np.zeros(6, int), all_logits=True), Row(1, 0, np.zeros(4, int), all_logits=True)],
            [(0, 0, 6), (1, 0, 4)],
        ),
        ([Row(1, 4, np.zeros(1, int)), Row(0, 6, np.zeros(3, int), all_logits=True)], [(1, 4, 1), (0, 6, 3)]),
    ]
    for rows, spans in steps:
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans]) for i in range(3))
        out = backend.attention(
            q.astype(dt), k.astype(dt), v.astype(dt), kv, 0, Batch(rows), 0.3, sinks=sinks.astype(dt)
        )
        offset = 0
        for s, a, n in spans:
            sq, sk, sv = seqs[s]
            want = sinks_reference(
                sq[a : a + n], sk[: a + n], sv[: a + n], range(a, a + n), range(a + n), 0.3, sinks, window
            )
            close(backend, out[offset : offset + n], want)
            offset += n


def moe_reference(x, router, router_bias, gate, up, down, biases, spec):
    """One token at a time, with math on Python floats: route, run the selected experts, sum."""
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = [float(router[e] @ row + router_bias[e]) for e in range(spec.experts)]
        if spec.gating == "softmax":
            total = sum(math.exp(v) for v in logits)
            scores = [math.exp(v) / total for v in logits]
        else:
            scores = logits
        chosen = sorted(range(spec.experts), key=lambda e: -scores[e])[: spec.experts_used]
        weights = [scores[e] for e in chosen]
        if spec.gating == "softmax_selected":
            total = sum(math.exp(w) for w in weights)
            weights = [math.exp(w) / total for w in weights]
        if spec.normalize:
            weights = [w / max(sum(weights), 6.103515625e-5) for w in weights]
        weights = [w * (spec.scale if spec.scale not in (0.0, 1.0) else 1.0) for w in weights]
        for e, w in zip(chosen, weights):
            g = gate[e] @ row + biases[0][e]
            u = up[e] @ row + biases[1][e]
            if spec.activation == "silu":
                h = np.array([a / (1 + math.exp(-a)) * b for a, b in zip(g, u)])
            else:
                a_ = [min(a, spec.limit) for a in g]
                b_ = [min(max(b, -spec.limit), spec.limit) for b in u]
                h = np.array([a / (1 + math.exp(-spec.alpha * a)) * (b + 1) for a, b in zip(a_, b_)])
            out[t] += w * (down[e] @ h + biases[2][e])
    return out


@pytest.mark.parametrize(
    "options, with_biases",
    [
        ({"gating": "softmax", "normalize": True}, False),  # Qwen3-MoE
        ({"gating": "softmax_selected", "activation": "swiglu_oai"}, True),  # gpt-oss
        ({"gating": "softmax", "scale": 2.5, "experts_used": 1}, True),
    ],
    ids=["qwen3moe", "gpt-oss", "scaled-top1"],
)
def test_moe(backend, options, with_biases):
    from leat.moe import MoESpec, MoEWeights

    rng = np.random.default_rng(9)
    experts, d, ffn, n = 6, 8, 5, 7
    spec = MoESpec(**{"experts": experts, "experts_used": 3, **options})
    x = rng.standard_normal((n, d))
    router, gate, up = (
        rng.standard_normal((experts, d)),
        3 * rng.standard_normal((experts, ffn, d)),
        3 * rng.standard_normal((experts, ffn, d)),
    )
    down = rng.standard_normal((experts, d, ffn))
    biases = [
        rng.standard_normal(s) if with_biases else np.zeros(s) for s in [(experts, ffn), (experts, ffn), (experts, d)]
    ]
    router_bias = rng.standard_normal(experts) if with_biases else np.zeros(experts)
    want = moe_reference(x, router, router_bias, gate, up, down, biases, spec)
    if spec.activation == "swiglu_oai":  # the clamps must be exercised on both sides
        g = np.einsum("efd,nd->nef", gate, x)
        assert (g > spec.limit).any() and (g < -spec.limit).any()
    dt = backend.dtype
    handles = MoEWeights(
        router.astype(dt),
        gate.astype(dt),
        up.astype(dt),
        down.astype(dt),
        *((router_bias.astype(dt), *(b.astype(dt) for b in biases)) if with_biases else ()),
    )
    got = backend.moe(x.astype(dt), handles, spec)
    assert got.dtype == dt
    close(backend, got, want)


def test_scale_gelu_mul_and_softcap(backend):
    x, y = np.linspace(-12, 12, 49), np.linspace(2, -3, 49)
    dt = backend.dtype
    gelu = [0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))) for a in x]
    close(backend, backend.gelu_mul(x.astype(dt), y.astype(dt)), np.array(gelu) * y)
    close(backend, backend.scale(x.astype(dt), 8.0**0.5), x * 8.0**0.5)
    close(backend, backend.softcap(x.astype(dt), 5.0), np.array([5.0 * math.tanh(a / 5.0) for a in x]))


def softcap_reference(q, keys, values, positions, key_positions, scale, cap, window=None):
    """attention_reference with each score soft-capped: cap * tanh(score / cap)."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((n, heads, values.shape[2]))
    for t in range(n):
        for h in range(heads):
            allowed = [
                j
                for j, kp in enumerate(key_positions)
                if kp <= positions[t] and (window is None or kp > positions[t] - window)
            ]
            scores = [cap * math.tanh(float(q[t, h] @ keys[j, h // group]) * scale / cap) for j in allowed]
            total = sum(math.exp(s) for s in scores)
            out[t, h] = sum(math.exp(s) / total * values[j, h // group] for s, j in zip(scores, allowed))
    return out.reshape(n, -1)


@pytest.mark.parametrize("window", [None, 3])
def test_attention_softcap_prefill_then_decode_two_sequences(backend, window):
    rng = np.random.default_rng(9)
    heads, kv_heads, dim, dt = 6, 2, 8, backend.dtype
    kv = backend.allocate_kv([KVLayout(kv_heads, dim, window=window)], slots=2, context=16, page_size=4)
    seqs = {s: [2 * rng.standard_normal((9, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    steps = [
        (
            [Row(0, 0, np.zeros(6, int), all_logits=True), Row(1, 0, np.zeros(4, int), all_logits=True)],
            [(0, 0, 6), (1, 0, 4)],
        ),
        ([Row(1, 4, np.zeros(1, int)), Row(0, 6, np.zeros(3, int), all_logits=True)], [(1, 4, 1), (0, 6, 3)]),
    ]
    for rows, spans in steps:
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans]) for i in range(3))
        out = backend.attention(q.astype(dt), k.astype(dt), v.astype(dt), kv, 0, Batch(rows), 0.3, softcap=1.5)
        offset = 0
        for s, a, n in spans:
            sq, sk, sv = seqs[s]
            want = softcap_reference(
                sq[a : a + n], sk[: a + n], sv[: a + n], range(a, a + n), range(a + n), 0.3, 1.5, window
            )
            close(backend, out[offset : offset + n], want)
            offset += n


def test_head_matmul(backend):
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((5, 3, 8)), rng.standard_normal((3, 6, 8))
    want = np.array(
        [[[sum(x[t, h, k] * w[h, m, k] for k in range(8)) for m in range(6)] for h in range(3)] for t in range(5)]
    )
    dt = backend.dtype
    close(backend, backend.head_matmul(x.astype(dt), w.astype(dt)), want)


def mla_reference(q_latent, q_rope, latents, k_ropes, positions, key_positions, scale, window=None):
    """Per query and head: softmax over allowed keys of scale * (q_latent . c_j + q_rope . kr_j), times c_j."""
    n, heads, rank = q_latent.shape
    out = np.zeros((n, heads, rank))
    for t in range(n):
        for h in range(heads):
            allowed = [
                j
                for j, kp in enumerate(key_positions)
                if kp <= positions[t] and (window is None or kp > positions[t] - window)
            ]
            scores = [scale * (float(q_latent[t, h] @ latents[j]) + float(q_rope[t, h] @ k_ropes[j])) for j in allowed]
            top = max(scores)
            total = sum(math.exp(s - top) for s in scores)
            out[t, h] = sum(math.exp(s - top) / total * latents[j] for s, j in zip(scores, allowed))
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_mla_attention_prefill_then_decode_two_sequences(backend, window):
    rng = np.random.default_rng(11)
    heads, rank, rope, dt = 3, 8, 4, backend.dtype
    kv = backend.allocate_kv(
        [KVLayout(1, rank + rope, rank, window=window, latent=True)], slots=2, context=16, page_size=4
    )
    assert kv.v[0].size == 0
    seqs = {
        s: [rng.standard_normal(shape) for shape in ((9, heads, rank), (9, heads, rope), (9, rank), (9, rope))]
        for s in (0, 1)
    }
    steps = [
        (
            [Row(0, 0, np.zeros(6, int), all_logits=True), Row(1, 0, np.zeros(4, int), all_logits=True)],
            [(0, 0, 6), (1, 0, 4)],
        ),
        ([Row(1, 4, np.zeros(1, int)), Row(0, 6, np.zeros(3, int), all_logits=True)], [(1, 4, 1), (0, 6, 3)]),
    ]
    for rows, spans in steps:
        args = [np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans]).astype(dt) for i in range(4)]
        out = backend.mla_attention(*args, kv, 0, Batch(rows), 0.4)
        offset = 0
        for s, a, n in spans:
            ql, qr, c, kr = seqs[s]
            want = mla_reference(
                ql[a : a + n], qr[a : a + n], c[: a + n], kr[: a + n], range(a, a + n), range(a + n), 0.4, window
            )
            close(backend, out[offset : offset + n], want)
            offset += n


def test_moe_routes_with_sigmoid_bias_and_groups(backend):
    from leat.moe import MoESpec, MoEWeights, selection_margin

    rng = np.random.default_rng(12)
    experts, width, ffn, dt = 8, 6, 5, backend.dtype
    spec = MoESpec(experts, 3, "sigmoid", normalize=True, scale=2.5, groups=4, groups_used=2)
    x, router, bias = (
        rng.standard_normal((7, width)),
        rng.standard_normal((experts, width)),
        rng.standard_normal(experts),
    )
    gate, up = rng.standard_normal((experts, ffn, width)), rng.standard_normal((experts, ffn, width))
    down = rng.standard_normal((experts, width, ffn))
    want = np.zeros_like(x)
    for t in range(len(x)):
        probs = [1 / (1 + math.exp(-float(router[e] @ x[t]))) for e in range(experts)]
        chosen = [p + b for p, b in zip(probs, bias)]
        group_score = [sum(sorted(chosen[g * 2 : g * 2 + 2], reverse=True)[:2]) for g in range(4)]
        groups = sorted(range(4), key=lambda g: -group_score[g])[:2]
        allowed = [e for e in range(experts) if e // 2 in groups]
        top = sorted(allowed, key=lambda e: -chosen[e])[:3]
        total = sum(probs[e] for e in top)
        for e in top:
            g, u = gate[e] @ x[t], up[e] @ x[t]
            want[t] += 2.5 * probs[e] / total * (down[e] @ (g / (1 + np.exp(-g)) * u))
    weights = MoEWeights(
        router.astype(dt), gate.astype(dt), up.astype(dt), down.astype(dt), selection_bias=bias.astype(dt)
    )
    close(backend, backend.moe(x.astype(dt), weights, spec), want)
    assert np.all(selection_margin(x @ router.T, spec, bias) > 1e-3)  # no near-tie decides this test
