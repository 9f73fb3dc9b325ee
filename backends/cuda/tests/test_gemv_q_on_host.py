"""matmul.cu's gemv_q (one-token and two-token products with int16 x) compiled for the host with g++ and run with each
CUDA thread a fiber (test_moe_mla_on_host.py's harness), against the float64 products: with a bias and a residual,
the RMS norm inside, the gated unit, three segments in one launch (q, k and v), and the pipelined loop equal to the
plain one bit for bit, the split over K (8 warps a block) within float32 rounding of the plain; and its ROPE
epilogue (one token's q rotated out, k rotated and v written into the cache) equal to the products followed by
rope_kv_write (ops.cu) bit for bit, split or not. The GPU tests check every instantiation on a GPU; these check the
kernel's logic on any machine with g++ (skipped where it is missing)."""

import ctypes
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.testing import relative_error
from leat_backend_cuda import quants

_spec = importlib.util.spec_from_file_location("moe_mla_on_host", Path(__file__).parent / "test_moe_mla_on_host.py")
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)
ptr, f32 = host.ptr, host.f32
Q = gguf.GGMLQuantizationType

# (struct, tokens, rows a warp, units, mode) of each exported instantiation: mode 1 norm, 2 gated unit, 4 pipelined,
# 32 split over K; TQ4_KP and TQ6_KP are the decode step's Q4_K and Q6_K products (64-value units)
STRUCTS = {"TQ8_0": Q.Q8_0, "TQ4_0": Q.Q4_0, "TQ4_KP": Q.Q4_K, "TQ6_KP": Q.Q6_K}
SPLIT = quants.GEMV_Q_SPLIT
SHAPES = [(s, 1, r, u, m) for s in STRUCTS for r, u in ((8, 2), (2, 1)) for m in (0, 1, 4, 5, SPLIT, SPLIT | 1)]
SHAPES += [(s, 1, 1, 2, m) for s in STRUCTS for m in (2, 3, 6, 7, SPLIT | 2, SPLIT | 3)]
SHAPES += [(s, 2, 2, 2, m) for s in ("TQ8_0", "TQ4_KP") for m in (0, 3, 4, 7)]


def _name(shape) -> str:
    return "gemv_{}_{}_{}_{}_{}".format(*shape)


HARNESS = r"""
template <class T, int NC, int R, int U, int MODE>
void product(const u8* w, const u8* w2, const u8* w3, i64 nb, i64 nb2, i64 nb3, const float* x, float* y, float* y2,
             float* y3, const float* bias, const float* res, const float* nw, int M, int M2, int M3, int K, int grid) {
    launch({(unsigned)grid, 1, 1}, (MODE & SPLIT) ? 256 : 128, [=] {
        gemv_q<T, NC, R, U, MODE>(w, w2, w3, nb, nb2, nb3, x, y, y2, y3, bias, nullptr, nullptr, res, nw, 1e-5f, M, M2,
                                  M3, K, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0, 0,
                                  0, 0.0f);
    });
}
#define PRODUCT(NAME, T, NC, R, U, MODE)                                                                              \
    extern "C" void NAME(const u8* w, const u8* w2, const u8* w3, i64 nb, i64 nb2, i64 nb3, const float* x, float* y, \
                         float* y2, float* y3, const float* bias, const float* res, const float* nw, int M, int M2,  \
                         int M3, int K, int grid) {                                                                   \
        product<T, NC, R, U, MODE>(w, w2, w3, nb, nb2, nb3, x, y, y2, y3, bias, res, nw, M, M2, M3, K, grid);        \
    }
// blocks so far whose lanes passed different numbers of block barriers (the shim's count)
extern "C" int uneven() { return uneven_blocks; }
""" + "\n".join(f"PRODUCT({_name(s)}, {s[0]}, {s[1]}, {s[2]}, {s[3]}, {s[4]})" for s in SHAPES)

ROPE_HARNESS = r"""
// gemv_q<TQ8_0, 1 token, 8 rows a warp, 2 units, MODE> over up to three segments (q, k, v) with the norm inside;
// MODE 1 plain, 17 with the ROPE epilogue, 33 and 49 their splits over K
template <int MODE>
void rope_product(const u8* w, const u8* w2, const u8* w3, i64 nb, i64 nb2, i64 nb3, const float* x, float* y, float* y2,
             float* y3, const float* nw, int M, int M2, int M3, int K, int roles, const int* slots,
             const int* cache_pos, const int* table, const int* rope_pos, const double* inv_freq, void* kc, void* vc,
             int kv_f16, int head_dim, int dims, int per_slot, int page_size, float magnitude) {
    const unsigned groups = (unsigned)((M + 31) / 32 + (M2 + 31) / 32 + (M3 + 31) / 32);
    // fewer blocks than groups: each takes several
    launch({groups < 3 ? groups : 3, 1, 1}, (MODE & SPLIT) ? 256 : 128, [=] {
        gemv_q<TQ8_0, 1, 8, 2, MODE>(w, w2, w3, nb, nb2, nb3, x, y, y2, y3, nullptr, nullptr, nullptr, nullptr, nw, 1e-5f,
                                      M, M2, M3, K, roles, slots, cache_pos, table, rope_pos, inv_freq, kc, vc, kv_f16,
                                      head_dim, dims, per_slot, page_size, magnitude);
    });
}
#define PRODUCT(NAME, MODE)                                                                                           \
    extern "C" void NAME(const u8* w, const u8* w2, const u8* w3, i64 nb, i64 nb2, i64 nb3, const float* x, float* y, \
                         float* y2, float* y3, const float* nw, int M, int M2, int M3, int K, int roles,              \
                         const int* slots, const int* cache_pos, const int* table, const int* rope_pos,               \
                         const double* inv_freq, void* kc, void* vc, int kv_f16, int head_dim, int dims,              \
                         int per_slot, int page_size, float magnitude) {                                              \
        rope_product<MODE>(w, w2, w3, nb, nb2, nb3, x, y, y2, y3, nw, M, M2, M3, K, roles, slots, cache_pos, table,       \
                      rope_pos, inv_freq, kc, vc, kv_f16, head_dim, dims, per_slot, page_size, magnitude);           \
    }
PRODUCT(product_plain, 1)
PRODUCT(product_rope, 17)
PRODUCT(product_plain_split, 33)
PRODUCT(product_rope_split, 49)
// rope_kv_write as the backend launches it (one-token q and k without per-head norms)
template <typename KV>
void rope_kv(const float* q, const float* k, const float* v, float* qy, KV* kc, KV* vc, const int* table,
             const int* slots, const int* cache_pos, const int* rope_pos, const double* inv_freq, int heads,
             int kv_heads, int head_dim, int dims, float magnitude, int per_slot, int page_size) {
    const unsigned threads = (unsigned)max(32, min(256, (head_dim + 31) / 32 * 32));
    launch({(unsigned)(heads + kv_heads), 1, 1}, threads, [=] {
        rope_kv_write<KV, false>(q, k, v, nullptr, nullptr, 0.0f, 0.0f, qy, kc, vc, nullptr, nullptr, table, slots,
                                 cache_pos, rope_pos, inv_freq, heads, kv_heads, head_dim, head_dim, dims, 0, magnitude,
                                 per_slot, page_size);
    });
}
#define ROPE_KV(NAME, KV)                                                                                             \
    extern "C" void NAME(const float* q, const float* k, const float* v, float* qy, KV* kc, KV* vc, const int* table, \
                         const int* slots, const int* cache_pos, const int* rope_pos, const double* inv_freq,         \
                         int heads, int kv_heads, int head_dim, int dims, float magnitude, int per_slot,              \
                         int page_size) {                                                                             \
        rope_kv<KV>(q, k, v, qy, kc, vc, table, slots, cache_pos, rope_pos, inv_freq, heads, kv_heads, head_dim,     \
                    dims, magnitude, per_slot, page_size);                                                           \
    }
ROPE_KV(rope_kv_f32, float)
ROPE_KV(rope_kv_f16, u16)
"""
CACHES = {"f32": np.float32, "f16": np.uint16}


def _library(tmp_path_factory, name: str, harness: str, defines: str = ""):
    """ops.cu and matmul.cu's gemv and gemv_q (not the GEMMs) with ``harness``, built for the host; ``defines`` go
    first (before runs.cuh is included)."""
    matmul = host._kernel("matmul.cu")
    matmul = matmul[: matmul.index("// Y = X W^T (+ bias) for a few tokens")]  # gemv and gemv_q, not the GEMMs
    matmul = matmul.replace("extern __shared__ uint4 xsh[];", "uint4* xsh = (uint4*)host_smem;")
    headers = {name: host._kernel(name) for name in ("quants.cuh", "runs.cuh", "iq_grids.cuh")}
    headers["mma.cuh"] = (Path(__file__).parent / "host" / "mma.cuh").read_text()  # included, not used by gemv_q
    # ops.cu (rope_kv_write, the ROPE epilogue's reference) first: matmul.cu's mode macros (NORM, ...) would rename
    # its template parameters
    source = defines + host._kernel("ops.cu") + matmul + harness
    return host.host_library(tmp_path_factory, name, source, headers)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return _library(tmp_path_factory, "gemv-q-host", HARNESS + ROPE_HARNESS)


def _weights(qtype, rows, cols, rng):
    """A random matrix as the backend uploads it (Q8_0, Q6_K: planes), its blocks, and its exact values (types
    gguf-py cannot quantize: random blocks with small scales, test_moe_mla_on_host.upload)."""
    stored, blocks, exact = host.upload(qtype, rng.standard_normal((rows, cols)), rng)
    return stored, blocks, np.asarray(exact, np.float64)


def _products(kernels, shape, twins, cols, seed):
    """Run gemv_q ``shape`` and each mode of ``twins`` on the same weights and x: three segments of 75, 40 and 33 rows
    (rows not a multiple of any group: warps with no rows) with a bias and a residual on the first, or the gated
    unit's gate and up of 75 rows (no bias, no residual); a grid of 3 blocks for more groups (each block takes
    several). Returns each twin's outputs and the float64 products they must match."""
    struct, tokens, r, u, mode = shape
    qtype = STRUCTS[struct]
    rng = np.random.default_rng(seed + SHAPES.index(shape))
    gated = bool(mode & 2)
    sizes = [75] if gated else [75, 40, 33]
    segments = [_weights(qtype, m, cols, rng) for m in sizes]
    if gated:  # gate and up: w and w2, both of the gate's blocks (nb)
        segments.append(_weights(qtype, sizes[0], cols, rng))
        ws, nbs, ms = [segments[0][0], segments[1][0], None], [segments[0][1], 0, 0], [sizes[0], 0, 0]
    else:
        ws, nbs, ms = [w for w, _, _ in segments], [nb for _, nb, _ in segments], sizes
    x, nw = f32(rng.standard_normal((tokens, cols)) * 2), f32(rng.standard_normal(cols))
    bias, res = (None, None) if gated else (f32(rng.standard_normal(75)), f32(rng.standard_normal((tokens, 75))))
    results = []
    for twin in twins:
        outs = [np.full((tokens, m), np.nan, np.float32) for m in ms[: len(sizes)]]
        run = getattr(kernels, _name((struct, tokens, r, u, twin)))
        run(*map(ptr, ws), *map(ctypes.c_longlong, nbs), ptr(x), *map(ptr, outs + [None] * (3 - len(outs))),
            ptr(bias), ptr(res), ptr(nw if mode & 1 else None), *ms, cols, 3)  # fmt: skip
        results.append(outs)
    xr = x.astype(np.float64)
    if mode & 1:
        xr = xr / np.sqrt(np.mean(xr**2, axis=1, keepdims=True) + 1e-5) * nw
    if gated:
        g, v = xr @ segments[0][2].T, xr @ segments[1][2].T
        with np.errstate(over="ignore"):  # exp(-g) of a large negative gate: inf, and silu(g) -0
            wants = [g / (1 + np.exp(-g)) * v]
    else:
        wants = [xr @ exact.T for _, _, exact in segments]
        wants[0] = wants[0] + bias + res
    return results, wants


@pytest.mark.parametrize("shape", [s for s in SHAPES if not s[4] & (4 | SPLIT)], ids=_name)
def test_gemv_q_against_float64_and_pipelined_equal_to_plain(kernels, shape):
    """_products' cases with several steps a lane (960 columns: 60 units of 16 values, 30 of 32; 4,352 for the K
    types: 68 units of 64); the pipelined twin (mode | 4) gives the same bits."""
    mode = shape[4]
    cols = 960 if quants.LAYOUTS[STRUCTS[shape[0]]].block == 32 else 4352
    (plain, pipelined), wants = _products(kernels, shape, (mode, mode | 4), cols, 7000)
    for got, want in zip(plain, wants, strict=True):
        assert relative_error(got, want) < 3e-4, shape
    for a, b in zip(plain, pipelined, strict=True):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[4] & SPLIT], ids=_name)
def test_gemv_q_split_over_k_against_float64_and_plain(kernels, shape):
    """The split over K (8 warps a block, warps w and w + 4 on the same rows, every other step of the units each) in
    _products' cases (warps with no rows must still meet the block's barriers), rows of 3,840 values (240 units of
    16, 120 of 32) or 8,448 (132 of 64) so that both halves of a group's warps take several steps and the last one
    partial; against the float64 products, and within float32 rounding of the plain products (mode without SPLIT:
    the same sums added in another order). Every lane of a block passes the same block barriers."""
    mode = shape[4]
    cols = 3840 if quants.LAYOUTS[STRUCTS[shape[0]]].block == 32 else 8448
    uneven = kernels.uneven()
    (split, plain), wants = _products(kernels, shape, (mode, mode & ~SPLIT), cols, 7500)
    assert kernels.uneven() == uneven, "a block's lanes passed different numbers of barriers"
    for got, flat, want in zip(split, plain, wants, strict=True):
        assert relative_error(got, want) < 3e-4, shape
        assert relative_error(got, flat) < 1e-6, shape
    assert any(not np.array_equal(a, b) for a, b in zip(split, plain, strict=True)), "the same bits: no split"


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("together", [True, False])
@pytest.mark.parametrize("slot", [0, -1])
def test_rope_epilogue_equals_products_then_rope_kv_write(kernels, cache, together, slot, split):
    """q (4 heads), k and v (2 heads) of 32 dimensions, 24 of them rotated, from one normed x of 256 values (2,048
    split over K: both halves of a group's warps take units); the token at position 6 of a slot whose pages are out
    of order (slot -1: a padding row, which writes no cache)."""
    rng = np.random.default_rng(31 + together)
    heads, kv_heads, head_dim, dims, k_cols, page_size = 4, 2, 32, 24, 2048 if split else 256, 4
    plain, fused = (
        (kernels.product_plain_split, kernels.product_rope_split)
        if split
        else (kernels.product_plain, kernels.product_rope)
    )
    uneven = kernels.uneven()
    rows = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    data = [gguf.quants.quantize(f32(rng.standard_normal((m, k_cols))), Q.Q8_0) for m in rows]
    weights = [quants.device_bytes(Q.Q8_0, d) for d in data]  # as the backend uploads them (Q8_0: planes)
    blocks = [quants.blocks_of(Q.Q8_0, m, k_cols) for m in rows]
    x, nw = f32(rng.standard_normal(k_cols) * 2), f32(rng.standard_normal(k_cols))
    inv_freq = np.ascontiguousarray(10000.0 ** (-np.arange(dims // 2) * 2 / dims), np.float64)
    table, slots, cache_pos, rope_pos = (
        np.array([[2, 0, 1]], np.int32),
        np.array([slot], np.int32),
        np.array([6], np.int32),
        np.array([6], np.int32),
    )
    size = 3 * page_size * kv_heads * head_dim
    magnitude = ctypes.c_float(0.9)
    kv_f16 = int(cache == "f16")
    none = (0, None, None, None, None, None, None, None, 0, 0, 0, 0, 0, ctypes.c_float(0.0))

    def launch(fn, segments, outs, roles=0, caches=(None, None)):
        nbs = [blocks[i] for i in segments] + [0] * (3 - len(segments))
        ms = [rows[i] for i in segments] + [0] * (3 - len(segments))
        segments = [weights[i] for i in segments] + [None] * (3 - len(segments))
        outs = outs + [None] * (3 - len(outs))
        rope = (
            (roles, ptr(slots), ptr(cache_pos), ptr(table), ptr(rope_pos), ptr(inv_freq), *map(ptr, caches), kv_f16)
            + (head_dim, dims, table.shape[1], page_size, magnitude)
            if roles
            else tuple(ptr(a) if isinstance(a, np.ndarray) or a is None else a for a in none)
        )
        fn(*map(ptr, segments), *map(ctypes.c_longlong, nbs), ptr(x), *map(ptr, outs), ptr(nw), *ms, k_cols, *rope)

    # the plain products, then rope_kv_write
    y = [np.full(m, np.nan, np.float32) for m in rows]
    launch(plain, [0, 1, 2], list(y))
    normed = x.astype(np.float64) / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-5) * nw
    for d, got in zip(data, y, strict=True):  # the products themselves: the float64 products of x's norm
        assert relative_error(got, gguf.quants.dequantize(d, Q.Q8_0).astype(np.float64) @ normed) < 3e-4
    want_q = np.full(rows[0], np.nan, np.float32)
    want_k, want_v = np.zeros(size, CACHES[cache]), np.zeros(size, CACHES[cache])
    getattr(kernels, f"rope_kv_{cache}")(
        *map(ptr, (y[0], y[1], y[2], want_q, want_k, want_v, table, slots, cache_pos, rope_pos, inv_freq)),
        heads,
        kv_heads,
        head_dim,
        dims,
        magnitude,
        table.shape[1],
        page_size,
    )
    # the products with the ROPE epilogue: q, k and v in one launch, or q and k, then v
    got_q = np.full(rows[0], np.nan, np.float32)
    got_k, got_v = np.zeros(size, CACHES[cache]), np.zeros(size, CACHES[cache])
    if together:
        launch(fused, [0, 1, 2], [got_q], 1 | 2 << 2 | 3 << 4, (got_k, got_v))
    else:
        launch(fused, [0, 1], [got_q], 1 | 2 << 2, (got_k, got_v))
        launch(fused, [2], [], 3, (got_k, got_v))
    assert kernels.uneven() == uneven, "a block's lanes passed different numbers of barriers"
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    if slot >= 0:  # the token's rows were written: the test compares something
        assert np.count_nonzero(want_k) >= kv_heads * head_dim - 2 and np.count_nonzero(want_v) > 0
    else:
        assert not np.any(want_k) and not np.any(got_v)


# the shapes the runs-ahead build is checked in: the norm inside (half the runs ahead), plain, pipelined, the gated
# unit, two tokens, split over K
AHEAD_SHAPES = [s for s in SHAPES if s[0] in ("TQ8_0", "TQ4_KP") and s[4] in (1, 4, 7, SPLIT | 1) or s[1] == 2]


@pytest.fixture(scope="module")
def ahead_kernels(tmp_path_factory):
    """gemv_q as compiled with LEAT_CUDA_RUNS_AHEAD=4 (backend.runs_ahead): quantize_runs loads four runs of x a
    thread (two with the norm) before it rounds any."""
    harness = HARNESS[: HARNESS.index("\nPRODUCT(gemv_")] + "\n"
    harness += "\n".join(f"PRODUCT({_name(s)}, {s[0]}, {s[1]}, {s[2]}, {s[3]}, {s[4]})" for s in AHEAD_SHAPES)
    return _library(tmp_path_factory, "gemv-q-ahead-host", harness, "#define LEAT_RUNS_AHEAD 4\n")


@pytest.mark.parametrize("shape", AHEAD_SHAPES, ids=_name)
def test_runs_ahead_gives_the_same_bits(kernels, ahead_kernels, shape):
    """quantize_runs with runs loaded ahead (LEAT_RUNS_AHEAD 4: several batches a thread, the last one partial, over
    14,336 values; one over 960) rounds x as one run at a time does: every output equal bit for bit."""
    for cols in (960, 14336) if quants.LAYOUTS[STRUCTS[shape[0]]].block == 32 else (4352, 14336):
        (one,), _ = _products(kernels, shape, (shape[4],), cols, 8000)
        (ahead,), _ = _products(ahead_kernels, shape, (shape[4],), cols, 8000)
        for a, b in zip(one, ahead, strict=True):
            assert not np.isnan(a).any()
            np.testing.assert_array_equal(b, a)
