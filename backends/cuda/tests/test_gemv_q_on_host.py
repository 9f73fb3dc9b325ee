"""matmul.cu's gemv_q (one-token and two-token products with int16 x) compiled for the host with g++ and run with each
CUDA thread a fiber (test_moe_mla_on_host.py's harness), against the float64 products: with a bias and a residual,
the RMS norm inside, the gated unit, three segments in one launch (q, k and v), and the pipelined loop equal to the
plain one bit for bit. The GPU tests check every instantiation on a GPU; these check the kernel's logic on any
machine with g++ (skipped where it is missing)."""

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

# (struct, tokens, rows a warp, units, mode) of each exported instantiation: mode 1 norm, 2 gated unit, 4 pipelined;
# TQ4_KP and TQ6_KP are the decode step's Q4_K and Q6_K products (64-value units)
STRUCTS = {"TQ8_0": Q.Q8_0, "TQ4_0": Q.Q4_0, "TQ4_KP": Q.Q4_K, "TQ6_KP": Q.Q6_K}
SHAPES = [(s, 1, r, u, m) for s in STRUCTS for r, u in ((8, 2), (2, 1)) for m in (0, 1, 4, 5)]
SHAPES += [(s, 1, 1, 2, m) for s in STRUCTS for m in (2, 3, 6, 7)]
SHAPES += [(s, 2, 2, 2, m) for s in ("TQ8_0", "TQ4_KP") for m in (0, 3, 4, 7)]


def _name(shape) -> str:
    return "gemv_{}_{}_{}_{}_{}".format(*shape)


HARNESS = r"""
template <class T, int NC, int R, int U, int MODE>
void product(const u8* w, const u8* w2, const u8* w3, i64 nb, i64 nb2, i64 nb3, const float* x, float* y, float* y2,
             float* y3, const float* bias, const float* res, const float* nw, int M, int M2, int M3, int K, int grid) {
    launch({(unsigned)grid, 1, 1}, 128, [=] {
        gemv_q<T, NC, R, U, MODE>(w, w2, w3, nb, nb2, nb3, x, y, y2, y3, bias, nullptr, nullptr, res, nw, 1e-5f, M, M2,
                                  M3, K);
    });
}
#define PRODUCT(NAME, T, NC, R, U, MODE)                                                                              \
    extern "C" void NAME(const u8* w, const u8* w2, const u8* w3, i64 nb, i64 nb2, i64 nb3, const float* x, float* y, \
                         float* y2, float* y3, const float* bias, const float* res, const float* nw, int M, int M2,  \
                         int M3, int K, int grid) {                                                                   \
        product<T, NC, R, U, MODE>(w, w2, w3, nb, nb2, nb3, x, y, y2, y3, bias, res, nw, M, M2, M3, K, grid);        \
    }
""" + "\n".join(f"PRODUCT({_name(s)}, {s[0]}, {s[1]}, {s[2]}, {s[3]}, {s[4]})" for s in SHAPES)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    matmul = host._kernel("matmul.cu")
    matmul = matmul[: matmul.index("// Y = X W^T (+ bias) for a few tokens")]  # gemv and gemv_q, not the GEMMs
    matmul = matmul.replace("extern __shared__ uint4 xsh[];", "uint4* xsh = (uint4*)host_smem;")
    headers = {name: host._kernel(name) for name in ("quants.cuh", "runs.cuh", "iq_grids.cuh")}
    headers["mma.cuh"] = (Path(__file__).parent / "host" / "mma.cuh").read_text()  # included, not used by gemv_q
    return host.host_library(tmp_path_factory, "gemv-q-host", matmul + HARNESS, headers)


def _weights(qtype, rows, cols, rng):
    """A random matrix as the backend uploads it (Q8_0, Q6_K: planes), its blocks, and its exact values (types
    gguf-py cannot quantize: random blocks with small scales, test_moe_mla_on_host.upload)."""
    stored, blocks, exact = host.upload(qtype, rng.standard_normal((rows, cols)), rng)
    return stored, blocks, np.asarray(exact, np.float64)


@pytest.mark.parametrize("shape", [s for s in SHAPES if not s[4] & 4], ids=_name)
def test_gemv_q_against_float64_and_pipelined_equal_to_plain(kernels, shape):
    """Rows not a multiple of any group (three segments of 75, 40 and 33 rows; the gated unit 75), several steps a
    lane (960 columns: 60 units of 16 values, 30 of 32; 4,352 for the K types: 68 units of 64), a grid of 3 blocks
    for more groups (each block takes several); a bias and a residual on the first segment; the pipelined twin
    (mode | 4) gives the same bits."""
    struct, tokens, r, u, mode = shape
    qtype = STRUCTS[struct]
    rng = np.random.default_rng(7000 + SHAPES.index(shape))
    cols, gated = 960 if quants.LAYOUTS[qtype].block == 32 else 4352, bool(mode & 2)
    sizes = [75] if gated else [75, 40, 33]
    segments = [_weights(qtype, m, cols, rng) for m in sizes]
    if gated:  # gate and up: w and w2, both of the gate's blocks (nb); no bias, no residual
        segments.append(_weights(qtype, sizes[0], cols, rng))
        ws, nbs, ms = [segments[0][0], segments[1][0], None], [segments[0][1], 0, 0], [sizes[0], 0, 0]
    else:
        ws, nbs, ms = [w for w, _, _ in segments], [nb for _, nb, _ in segments], sizes
    x, nw = f32(rng.standard_normal((tokens, cols)) * 2), f32(rng.standard_normal(cols))
    bias, res = (None, None) if gated else (f32(rng.standard_normal(75)), f32(rng.standard_normal((tokens, 75))))
    results = []
    for twin in (mode, mode | 4):
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
    for got, want in zip(results[0], wants, strict=True):
        assert relative_error(got, want) < 3e-4, shape
    for plain, pipelined in zip(*results, strict=True):
        np.testing.assert_array_equal(pipelined, plain)
