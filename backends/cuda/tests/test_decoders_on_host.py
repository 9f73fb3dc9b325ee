"""The GGUF block decoders of kernels/quants.cuh, compiled for the host with g++ through a shim of the
CUDA builtins they use, equal gguf-py's dequantize bit for bit (and their fused fast path is within
float rounding of it). Needs no GPU; skipped where g++ is missing."""

import ctypes
import runpy
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat_backend_cuda import quants

Q = gguf.GGMLQuantizationType
# byte offsets of the f16 scale fields (d, and dmin where present) of types gguf-py cannot quantize
SCALES = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    **{q: (0,) for q in (Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S)},
}
# the IQ types with codebooks, decoded from enough random blocks to look up every codeword (2048 at most)
GRID_TYPES = (Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M)


def sane_scales(data: np.ndarray, qtype: Q, rng) -> None:
    """Small f16 scales (0.002 to 0.02) written into random blocks of ``qtype`` ([blocks, bytes])."""
    scale = rng.uniform(0.002, 0.02, len(data)).astype(np.float16).view(np.uint16)
    if qtype == Q.IQ1_M:  # d's four nibbles are the top nibbles of the four u16 scale words (bytes 48-55)
        words = data[:, 48:56].copy().view(np.uint16)
        nibbles = (scale[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF
        data[:, 48:56] = (words & 0x0FFF | nibbles << 12).astype(np.uint16).view(np.uint8)
    for offset in SCALES.get(qtype, ()):
        data[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)


HARNESS = """
#include "quants.cuh"
// Rows of W times x: each unit's runs quantized to int16 with a per-run scale, then T::dot (as gemv_q).
template <class T> void dots(const u8* w, i64 nb, const float* x, int rows, int K, float* out) {
    const int bpr = K / T::BLOCK;
    for (int row = 0; row < rows; ++row) {
        float total = 0.0f;
        for (int b = 0; b < bpr; ++b)
            for (int unit = 0; unit < T::UNITS; ++unit) {
                u32 xw[T::UV / 2];
                float xs[T::NR], xsum[T::NR];
                for (int run = 0; run < T::NR; ++run) {
                    const float* xr = x + b * T::BLOCK + T::run_offset(unit, run);
                    float amax = 0.0f, sum = 0.0f;
                    for (int i = 0; i < T::RL; ++i) { amax = fmaxf(amax, fabsf(xr[i])); sum += xr[i]; }
                    const float f = amax > 0.0f ? 32767.0f / amax : 0.0f;
                    for (int i = 0; i < T::RL; i += 2) {
                        const int a = (int)rintf(xr[i] * f), c = (int)rintf(xr[i + 1] * f);
                        xw[(run * T::RL + i) / 2] = (u32)(a & 0xFFFF) | ((u32)c << 16);
                    }
                    xs[run] = amax / 32767.0f;
                    xsum[run] = sum;
                }
                total += T::dot(T::load(w, nb, (i64)row * bpr + b, unit), unit, xw, xs, xsum);
            }
        out[row] = total;
    }
}

// TQ4_KP::dot with the high nibbles shifted down and signed dp2a (as before they stayed in place): the reference
// test_q4_k_dot_with_high_nibbles_in_place holds the kernel's to, bit for bit
float q4_kp_shifted(const TQ4_KP::Raw& r, int unit, const u32* xw, const float* xs, const float* xsum) {
    u32 sc, mn;
    TQ4_KP::scales(r.head, unit, sc, mn);
    const float d = f16_to_f32((u16)(r.head.x & 0xFFFF)), dmin = f16_to_f32((u16)(r.head.x >> 16));
    const int s0 = dot16(low_nibbles(r.lo.x), low_nibbles(r.lo.y), low_nibbles(r.lo.z), low_nibbles(r.lo.w), xw);
    const int s1 = dot16(low_nibbles(r.hi.x), low_nibbles(r.hi.y), low_nibbles(r.hi.z), low_nibbles(r.hi.w), xw + 8);
    const int s2 = dot16(high_nibbles(r.lo.x), high_nibbles(r.lo.y), high_nibbles(r.lo.z), high_nibbles(r.lo.w), xw + 16);
    const int s3 = dot16(high_nibbles(r.hi.x), high_nibbles(r.hi.y), high_nibbles(r.hi.z), high_nibbles(r.hi.w), xw + 24);
    const float low = byte_f32(sc, 0) * (xs[0] * (float)s0 + xs[1] * (float)s1);
    const float high = byte_f32(sc, 1) * (xs[2] * (float)s2 + xs[3] * (float)s3);
    const float mins = byte_f32(mn, 0) * (xsum[0] + xsum[1]) + byte_f32(mn, 1) * (xsum[2] + xsum[3]);
    return d * (low + high) - dmin * mins;
}
// n units: raw (12 words each), x (32 words and 8 floats each); the kernel's dot and the reference's
extern "C" void q4_kp_dots(const u32* raw, const u32* xw, const float* xf, int n, float* got, float* want) {
    for (int i = 0; i < n; ++i) {
        TQ4_KP::Raw r;
        memcpy(&r, raw + 12 * i, sizeof r);
        got[i] = TQ4_KP::dot(r, i & 3, xw + 32 * i, xf + 8 * i, xf + 8 * i + 4);
        want[i] = q4_kp_shifted(r, i & 3, xw + 32 * i, xf + 8 * i, xf + 8 * i + 4);
    }
}

template <class T, bool EXACT> void run(const u8* w, i64 nb, float* out) {
    for (i64 blk = 0; blk < nb; ++blk)
        for (int unit = 0; unit < T::UNITS; ++unit) {
            float v[T::UV];
            T::template decode<EXACT>(T::load(w, nb, blk, unit), unit, v);
            for (int run = 0; run < T::NR; ++run)
                for (int i = 0; i < T::RL; ++i) out[blk * T::BLOCK + T::run_offset(unit, run) + i] = v[run * T::RL + i];
        }
}
"""


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    folder = tmp_path_factory.mktemp("decoders")
    shutil.copy(Path(__file__).parent / "host" / "common.cuh", folder / "common.cuh")
    for header in ("quants.cuh", "iq_grids.cuh"):
        (folder / header).write_text(resources.files("leat_backend_cuda").joinpath("kernels", header).read_text())
    structs = sorted({layout.struct for layout in quants.LAYOUTS.values()})
    exports = "".join(
        f'extern "C" void dots_{s}(const u8* w, i64 nb, const float* x, int rows, int k, float* o) '
        f"{{ dots<{s}>(w, nb, x, rows, k, o); }}\n"
        for s in sorted({layout.dot_struct for layout in quants.LAYOUTS.values() if layout.integer})
    )
    exports += "".join(
        f'extern "C" void exact_{s}(const u8* w, i64 nb, float* o) {{ run<{s}, true>(w, nb, o); }}\n'
        f'extern "C" void fast_{s}(const u8* w, i64 nb, float* o) {{ run<{s}, false>(w, nb, o); }}\n'
        for s in structs
    )
    (folder / "harness.cpp").write_text(HARNESS + exports)
    library = folder / "libdecoders.so"
    subprocess.run(
        [compiler, "-O1", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-o", library, folder / "harness.cpp"],
        check=True,
    )
    return ctypes.CDLL(str(library))


@pytest.mark.parametrize("qtype", sorted(quants.LAYOUTS, key=int), ids=lambda q: q.name)
def test_decoder_equals_gguf(decoders, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = (32, 8192) if qtype in GRID_TYPES else (6, 512)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16):
        data = rng.standard_normal((rows, cols)).astype(np.float32 if qtype == Q.F32 else np.float16).view(np.uint8)
    else:  # any bytes are a valid block (NaN and inf scales included)
        data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(data, qtype).reshape(-1)
    stored = quants.device_bytes(qtype, data)
    nb = quants.blocks_of(qtype, rows, cols)
    struct = quants.LAYOUTS[qtype].struct
    results = {}
    for mode in ("exact", "fast"):
        out = np.full(rows * cols, np.nan, np.float32)
        getattr(decoders, f"{mode}_{struct}")(
            ctypes.c_void_p(stored.ctypes.data), ctypes.c_longlong(nb), ctypes.c_void_p(out.ctypes.data)
        )
        results[mode] = out
    np.testing.assert_array_equal(results["exact"], want)
    finite = np.isfinite(want)
    np.testing.assert_allclose(results["fast"][finite], want[finite], rtol=1e-6, atol=1e-6 * np.abs(want[finite]).max())


@pytest.mark.parametrize("qtype", sorted(set(quants.LAYOUTS) - {Q.F32, Q.F16, Q.BF16}, key=int), ids=lambda q: q.name)
def test_integer_dot_products(decoders, qtype):
    """dp2a dot products with int16 activations (one scale per run) are within 1e-4 of the float64 product."""
    rng = np.random.default_rng(50 + int(qtype))
    rows, cols = 8, 1024
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype).view(np.uint8)
    except NotImplementedError:  # random blocks with small f16 scales
        data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        sane_scales(data, qtype, rng)
    data = data.reshape(rows, -1)
    x = (rng.standard_normal(cols) * np.exp(rng.standard_normal(cols))).astype(np.float32)  # uneven magnitudes
    want = gguf.quants.dequantize(data, qtype).reshape(rows, cols).astype(np.float64) @ x.astype(np.float64)
    stored = quants.device_bytes(qtype, data)
    got = np.zeros(rows, np.float32)
    getattr(decoders, f"dots_{quants.LAYOUTS[qtype].dot_struct}")(
        ctypes.c_void_p(stored.ctypes.data),
        ctypes.c_longlong(quants.blocks_of(qtype, rows, cols)),
        ctypes.c_void_p(x.ctypes.data),
        ctypes.c_int(rows),
        ctypes.c_int(cols),
        ctypes.c_void_p(got.ctypes.data),
    )
    scale = np.abs(gguf.quants.dequantize(data, qtype).reshape(rows, cols)).astype(np.float64) @ np.abs(x)
    assert np.all(np.abs(got - want) <= 1e-4 * scale), (got, want)


def test_q4_k_dot_with_high_nibbles_in_place(decoders):
    """TQ4_KP::dot (the decode step's Q4_K products) multiplies each byte's high nibble in place, 16 times its value,
    by unsigned dp2a and takes 1/16 into the scale: the same float32 values, bit for bit, as with the nibbles shifted
    down, over random blocks, int16 x to the extremes and scales of every magnitude."""
    rng = np.random.default_rng(16)
    n = 20000
    raw = rng.integers(0, 2**32, (n, 12), dtype=np.uint64).astype(np.uint32)
    raw[:, 0] &= 0x3BFF3BFF  # d and dmin finite f16s, under 1
    xw = rng.integers(0, 2**32, (n, 32), dtype=np.uint64).astype(np.uint32)
    xw[::3] = (xw[::3] & 0x7FFF7FFF) | 0x80008000  # -32768..-1 in both halves
    xw[1::3] = np.uint32(0x7FFF7FFF)  # 32767 in both halves
    xf = (rng.standard_normal((n, 8)) * np.exp2(rng.integers(-30, 30, (n, 8)))).astype(np.float32)
    got, want = np.zeros(n, np.float32), np.zeros(n, np.float32)
    decoders.q4_kp_dots(
        *(ctypes.c_void_p(a.ctypes.data) for a in (raw, xw, xf)),
        ctypes.c_int(n),
        *(ctypes.c_void_p(a.ctypes.data) for a in (got, want)),
    )
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_codebooks_header_is_gguf_py_tables():
    """kernels/iq_grids.cuh is what scripts/gen_iq_grids.py writes from gguf-py's tables today."""
    script = Path(__file__).parents[3] / "scripts" / "gen_iq_grids.py"
    written = runpy.run_path(str(script))["header"]()
    assert resources.files("leat_backend_cuda").joinpath("kernels", "iq_grids.cuh").read_text() == written
