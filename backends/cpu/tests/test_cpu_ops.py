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
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=TOL[backend.precision], atol=TOL[backend.precision])


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
            allowed = [j for j, kp in enumerate(key_positions) if kp <= positions[t] and (window is None or kp > positions[t] - window)]
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
    for step_rows, step_spans in ([rows, spans], [[Row(1, 4, np.zeros(1, int)), Row(0, 6, np.zeros(3, int))], [(1, 4, 1), (0, 6, 3)]]):
        batch = Batch(step_rows)
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step_spans]) for i in range(3))
        out = backend.attention(q.astype(dt), k.astype(dt), v.astype(dt), kv, 0, batch, 0.3)
        offset = 0
        for s, a, n in step_spans:
            sq, sk, sv = seqs[s]
            want = attention_reference(sq[a : a + n], sk[: a + n], sv[: a + n], range(a, a + n), range(a + n), 0.3, window)
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
        want = gguf.quants.dequantize(gguf.quants.quantize(k.astype(np.float32).reshape(5, 32), gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)
        scale = kv.k_scale[0].reshape(-1, 1, 1)[:5]
        got = stored.astype(np.float32) * scale.astype(np.float32)
        np.testing.assert_allclose(got.reshape(5, 32), want, atol=float(np.abs(want).max()) / 127 + 1e-6)
        assert np.mean(np.isclose(got.reshape(5, 32), want, rtol=1e-6, atol=1e-7)) > 0.99
