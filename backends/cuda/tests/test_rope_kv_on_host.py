"""ops.cu's rope_kv_write (RoPE of q and k and the cache write in one launch) compiled for the host with g++ and run
with each CUDA thread a fiber (test_moe_mla_on_host.py's harness): bit for bit what rope (or rope_norm) on q, the same
on k, then kv_write give, for each cache type. No GPU needed; skipped where g++ is missing."""

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("moe_mla_on_host", Path(__file__).parent / "test_moe_mla_on_host.py")
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)
ptr, f32 = host.ptr, host.f32

HARNESS = r"""
#define ROPE_ARGS const int* pos, const double* inv_freq, int dims, int neox, float magnitude
template <typename KV>
void separate(const float* q, const float* k, const float* v, const float* qw, const float* kw, float eps, float* qy,
              float* ky, KV* kc, KV* vc, u16* ks, u16* vs, const int* table, const int* slots, const int* cache_pos,
              int n, int heads, int kv_heads, int head_dim, int per_slot, int page_size, ROPE_ARGS) {
    const int rows[2] = {heads, kv_heads};
    const float* in[2] = {q, k};
    const float* w[2] = {qw, kw};
    float* out[2] = {qy, ky};
    for (int i = 0; i < 2; ++i) {
        const int h = rows[i];
        if (qw) {  // the backend launches rope_norm with rms_norm's threads, rope with half a head's
            const unsigned threads = (unsigned)max(32, min(256, (head_dim + 31) / 32 * 32));
            launch({(unsigned)(n * h), 1, 1}, threads, [=] {
                rope_norm(in[i], w[i], eps, out[i], pos, inv_freq, h, head_dim, dims, neox, magnitude);
            });
        } else {
            const unsigned threads = (unsigned)max(32, min(256, (head_dim / 2 + 31) / 32 * 32));
            launch({(unsigned)(n * h), 1, 1}, threads,
                   [=] { rope(in[i], out[i], pos, inv_freq, h, head_dim, dims, neox, magnitude); });
        }
    }
    launch({(unsigned)n, 1, 1}, 128, [=] {
        kv_write<KV>(ky, v, kc, vc, ks, vs, table, slots, cache_pos, kv_heads, head_dim, head_dim, per_slot, page_size);
    });
}
template <typename KV>
void fused(const float* q, const float* k, const float* v, const float* qw, const float* kw, float eps, float* qy,
           KV* kc, KV* vc, u16* ks, u16* vs, const int* table, const int* slots, const int* cache_pos, int n,
           int heads, int kv_heads, int head_dim, int per_slot, int page_size, ROPE_ARGS) {
    const unsigned threads = (unsigned)max(32, min(256, (head_dim + 31) / 32 * 32));
    launch({(unsigned)(n * (heads + kv_heads)), 1, 1}, threads, [=] {
        if (qw)
            rope_kv_write<KV, true>(q, k, v, qw, kw, eps, eps, qy, kc, vc, ks, vs, table, slots, cache_pos, pos,
                                    inv_freq, heads, kv_heads, head_dim, head_dim, dims, neox, magnitude, per_slot,
                                    page_size);
        else
            rope_kv_write<KV, false>(q, k, v, qw, kw, eps, eps, qy, kc, vc, ks, vs, table, slots, cache_pos, pos,
                                     inv_freq, heads, kv_heads, head_dim, head_dim, dims, neox, magnitude, per_slot,
                                     page_size);
    });
}
#define BOTH(NAME, KV)                                                                                              \
    extern "C" void separate_##NAME(const float* q, const float* k, const float* v, const float* qw,              \
                                    const float* kw, float eps, float* qy, float* ky, KV* kc, KV* vc, u16* ks,    \
                                    u16* vs, const int* table, const int* slots, const int* cache_pos, int n,       \
                                    int heads, int kv_heads, int head_dim, int per_slot, int page_size, ROPE_ARGS) { \
        separate<KV>(q, k, v, qw, kw, eps, qy, ky, kc, vc, ks, vs, table, slots, cache_pos, n, heads, kv_heads,     \
                     head_dim, per_slot, page_size, pos, inv_freq, dims, neox, magnitude);                          \
    }                                                                                                               \
    extern "C" void fused_##NAME(const float* q, const float* k, const float* v, const float* qw, const float* kw, \
                                 float eps, float* qy, KV* kc, KV* vc, u16* ks, u16* vs, const int* table,          \
                                 const int* slots, const int* cache_pos, int n, int heads, int kv_heads,            \
                                 int head_dim, int per_slot, int page_size, ROPE_ARGS) {                            \
        fused<KV>(q, k, v, qw, kw, eps, qy, kc, vc, ks, vs, table, slots, cache_pos, n, heads, kv_heads, head_dim,  \
                  per_slot, page_size, pos, inv_freq, dims, neox, magnitude);                                       \
    }
BOTH(f32, float)
BOTH(f16, u16)
BOTH(q8_0, i8)
"""

CACHES = {"f32": np.float32, "f16": np.uint16, "q8_0": np.int8}


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host.host_library(tmp_path_factory, "rope-kv", host._kernel("ops.cu") + HARNESS)


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("neox", [0, 1])
def test_rope_kv_write_equals_rope_rope_then_kv_write(kernels, cache, norm, neox):
    """Two tokens of one slot (pages out of order, one token a padding row, slot -1, that writes nothing), partial
    rotary dims: the rotated q, every cache element and (q8_0) every scale equal the three kernels'."""
    rng = np.random.default_rng(7 + 2 * norm + neox)
    n, heads, kv_heads, head_dim, dims, page_size, pages = 3, 4, 2, 64, 48, 4, 3
    q = f32(rng.standard_normal((n, heads, head_dim)) * 3)
    k = f32(rng.standard_normal((n, kv_heads, head_dim)) * 3)
    v = f32(rng.standard_normal((n, kv_heads, head_dim)))
    qw, kw = (f32(rng.standard_normal(head_dim)) if norm else None for _ in range(2))
    half = dims // 2
    inv_freq = np.ascontiguousarray(10000.0 ** (-np.arange(half) * 2 / dims), np.float64)
    pos = np.array([5, 9, 6], np.int32)
    slots = np.array([0, 0, -1], np.int32)
    table = np.array([[2, 0, 1]], np.int32)
    size = pages * page_size * kv_heads * head_dim
    results = []
    for fused in (False, True):
        qy, ky = np.full(q.shape, np.nan, np.float32), np.full(k.shape, np.nan, np.float32)
        kc, vc = np.zeros(size, CACHES[cache]), np.zeros(size, CACHES[cache])
        ks, vs = np.zeros(size // 32, np.uint16), np.zeros(size // 32, np.uint16)
        common = (ptr(table), ptr(slots), ptr(pos), n, heads, kv_heads, head_dim, table.shape[1], page_size)
        rope_args = (ptr(pos), ptr(inv_freq), dims, neox, ctypes.c_float(0.9))
        front = (ptr(q), ptr(k), ptr(v), ptr(qw), ptr(kw), ctypes.c_float(1e-5), ptr(qy))
        caches = (ptr(kc), ptr(vc), ptr(ks), ptr(vs))
        if fused:
            getattr(kernels, f"fused_{cache}")(*front, *caches, *common, *rope_args)
        else:
            getattr(kernels, f"separate_{cache}")(*front, ptr(ky), *caches, *common, *rope_args)
        results.append((qy, kc, vc, ks, vs))
    for want, got in zip(*results, strict=True):
        np.testing.assert_array_equal(got, want)
    assert np.isfinite(results[1][0]).all()
    assert np.count_nonzero(results[1][1]) > 0 and np.count_nonzero(results[1][2]) > 0
    # the padding token wrote nothing: only the two real tokens' rows hold values
    rows = results[1][1].reshape(pages * page_size, kv_heads * head_dim)
    assert np.count_nonzero(rows.any(axis=1)) == 2
