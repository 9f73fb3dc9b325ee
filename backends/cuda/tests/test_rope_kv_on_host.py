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

// One token's attention (heads of 128 dimensions: DL 4) over a cache that holds its earlier positions: rope_kv_write
// then attention (rotate = 0), or attention rotating q and k and writing the cache itself (rotate = 1); then
// attention_combine where there are several splits.
template <typename KV>
void attend_one(int rotate, const float* q, const float* k, const float* v, const float* qw, const float* kw,
                float eps, float* qy, KV* kc, KV* vc, u16* ks, u16* vs, const int* table, const int* slots,
                const int* cache_pos, float* out, float* ml, float* acc, int heads, int kv_heads, int per_slot,
                int page_size, int window, int split, int splits, ROPE_ARGS) {
    const int dim = 128;
    if (!rotate)
        fused<KV>(q, k, v, qw, kw, eps, qy, kc, vc, ks, vs, table, slots, cache_pos, 1, heads, kv_heads, dim,
                  per_slot, page_size, pos, inv_freq, dims, neox, magnitude);
    const unsigned chunks = (heads / kv_heads + 3) / 4;
    launch({1, (unsigned)(kv_heads * chunks), (unsigned)splits}, 128, [=] {
        attention<KV, 4, 4>(rotate ? nullptr : qy, kc, vc, ks, vs, table, slots, cache_pos, splits == 1 ? out : nullptr,
                            ml, acc, heads, kv_heads, dim, dim, per_slot, page_size, window, split, 0.3f, 0.0f,
                            nullptr, rotate ? q : nullptr, rotate ? k : nullptr, rotate ? v : nullptr, qw, kw, eps,
                            eps, qw != nullptr, kc, vc, ks, vs, pos, inv_freq, dims, neox, magnitude);
    });
    if (splits > 1)
        launch({(unsigned)heads, 1, 1}, 128, [=] { attention_combine(ml, acc, out, splits, dim, nullptr, heads); });
}
#define ATTEND(NAME, KV)                                                                                            \
    extern "C" void attend_##NAME(int rotate, const float* q, const float* k, const float* v, const float* qw,    \
                                  const float* kw, float eps, float* qy, KV* kc, KV* vc, u16* ks, u16* vs,         \
                                  const int* table, const int* slots, const int* cache_pos, float* out, float* ml,  \
                                  float* acc, int heads, int kv_heads, int per_slot, int page_size, int window,     \
                                  int split, int splits, ROPE_ARGS) {                                              \
        attend_one<KV>(rotate, q, k, v, qw, kw, eps, qy, kc, vc, ks, vs, table, slots, cache_pos, out, ml, acc,      \
                       heads, kv_heads, per_slot, page_size, window, split, splits, pos, inv_freq, dims, neox,       \
                       magnitude);                                                                                  \
    }
ATTEND(f32, float)
ATTEND(f16, u16)
ATTEND(q8_0, i8)
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


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(("position", "window", "split"), [(45, 0, 16), (37, 0, 64), (0, 0, 32), (41, 10, 8)])
def test_one_token_attention_rotating_q_and_k_itself(kernels, cache, norm, position, window, split):
    """A one-token step's attention that rotates q and k and writes the cache itself (the backend's path for one
    token) gives rope_kv_write then attention's output and cache bit for bit: two blocks a KV head (6 query heads
    a group), the new position owned by warp 1 (45), warp 0 (37), alone (0) and in a window cut by splits of 8
    (41), partial rotary dims, pages out of order."""
    rng = np.random.default_rng(position + int(norm) + 3 * list(CACHES).index(cache))
    heads, kv_heads, dim, dims, page_size = 12, 2, 128, 96, 8
    table = np.array([[3, 0, 5, 1, 4, 2, 6]], np.int32)
    pages = table.size
    q = f32(rng.standard_normal((1, heads, dim)) * 3)
    k = f32(rng.standard_normal((1, kv_heads, dim)) * 3)
    v = f32(rng.standard_normal((1, kv_heads, dim)))
    qw, kw = (f32(rng.standard_normal(dim)) if norm else None for _ in range(2))
    inv_freq = np.ascontiguousarray(10000.0 ** (-np.arange(dims // 2) * 2 / dims), np.float64)
    size = pages * page_size * kv_heads * dim
    earlier = rng.standard_normal((2, size)) * 2  # the cache's earlier positions, as the same values in both runs
    if cache == "q8_0":
        earlier_kv = [np.clip(np.round(e * 20), -127, 127).astype(np.int8) for e in earlier]
        earlier_scales = [np.full(size // 32, 0x2E66, np.uint16) for _ in range(2)]  # f16 0.1
    else:
        earlier_kv = [e.astype(np.float32) if cache == "f32" else e.astype(np.float16).view(np.uint16) for e in earlier]
        earlier_scales = [np.zeros(size // 32, np.uint16) for _ in range(2)]
    splits = -(-(position + 1) // split)
    slots, pos = np.array([0], np.int32), np.array([position], np.int32)
    results = []
    for rotate in (0, 1):
        kc, vc = (e.copy() for e in earlier_kv)
        ks, vs = (e.copy() for e in earlier_scales)
        qy = np.full(q.shape, np.nan, np.float32)
        out = np.full((1, heads * dim), np.nan, np.float32)
        ml, acc = np.zeros(heads * splits * 2, np.float32), np.zeros(heads * splits * dim, np.float32)
        getattr(kernels, f"attend_{cache}")(
            rotate,
            *map(ptr, (q, k, v, qw, kw)),
            ctypes.c_float(1e-5),
            *map(ptr, (qy, kc, vc, ks, vs, table, slots, pos, out, ml, acc)),
            heads,
            kv_heads,
            table.shape[1],
            page_size,
            window,
            split,
            splits,
            ptr(pos),
            ptr(inv_freq),
            dims,
            0,
            ctypes.c_float(0.9),
        )
        results.append((out, kc, vc, ks, vs))
    for want, got in zip(*results, strict=True):
        np.testing.assert_array_equal(got, want)
    out = results[1][0]
    assert np.isfinite(out).all() and np.abs(out).max() > 0
    # the new row was written: the caches differ from what they held before at the position's row only
    row = (table[0, position // page_size] * page_size + position % page_size) * kv_heads * dim
    changed = np.flatnonzero(results[1][1] != earlier_kv[0])
    assert changed.size > 0 and changed.min() >= row and changed.max() < row + kv_heads * dim
