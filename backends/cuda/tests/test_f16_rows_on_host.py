"""ops.cu's f16 rows for the tensor-core and cuBLAS products (x_to_f16, scale_rows_bias and its fused forms) compiled for the host with
g++ and run with each CUDA thread a fiber (test_moe_mla_on_host.py's harness). No GPU needed; skipped where g++ is
missing."""

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
extern "C" void to_f16(const float* x, u16* xh, float* xscale, int n, int cols) {
    launch({(unsigned)n, 1, 1}, 256, [=] { x_to_f16(x, xh, xscale, cols); });
}
extern "C" void epilogue(float* y, const float* xscale, const float* bias, int m, int n) {
    launch({2, 4, 1}, 16, [=] { scale_rows_bias(y, xscale, bias, m, n); });  // both grid strides taken
}
extern "C" void split(const float* y, const float* xscale, float* o0, float* o1, float* o2, const float* b0,
                      const float* b1, const float* b2, int m0, int m1, int m2, int n) {
    launch({2, 4, 1}, 16, [=] { scale_split(y, xscale, o0, o1, o2, b0, b1, b2, m0, m1, m2, n); });
}
extern "C" void gated(const float* y, const float* xscale, const float* bg, const float* bu, float* out, int m, int n) {
    launch({2, 4, 1}, 16, [=] { scale_silu_mul(y, xscale, bg, bu, out, m, n); });
}
extern "C" void residual(const float* y, const float* xscale, const float* bias, const float* a, float* out, int m,
                         int n) {
    launch({2, 4, 1}, 16, [=] { scale_add(y, xscale, bias, a, out, m, n); });
}
extern "C" void silu(const float* g, const float* u, float* out, long n) {
    launch({3, 1, 1}, 32, [=] { silu_mul(g, u, out, n); });
}
extern "C" void plus(const float* a, const float* b, float* out, long n) {
    launch({3, 1, 1}, 32, [=] { add(a, b, out, n); });
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host.host_library(tmp_path_factory, "f16-rows", host._kernel("ops.cu") + HARNESS)


def test_rows_in_f16_range_keep_scale_1_and_the_epilogue_leaves_them(kernels):
    """Rows whose largest value is in [2^-6, 2^15) go to f16 as they are (scale 1, so no epilogue pass over their
    products: before, every row was scaled to [2^14, 2^15) and every product row read and written again); larger and
    smaller rows by a power of two into [2^14, 2^15). Every row times its scale is x within f16 rounding."""
    rng = np.random.default_rng(3)
    n, cols = 6, 256
    peaks = np.array([2.0**-6, 0.5, 37.0, 2.0**15 * 0.999, 1e5, 1e-4])  # four in range, one above, one below
    x = rng.standard_normal((n, cols))
    x = f32(x / np.abs(x).max(axis=1, keepdims=True) * peaks[:, None])
    xh, xscale = np.zeros((n, cols), np.uint16), np.full(n, np.nan, np.float32)
    kernels.to_f16(ptr(x), ptr(xh), ptr(xscale), n, cols)
    assert list(xscale[:4]) == [1.0] * 4
    scaled = np.abs(xh.view(np.float16).astype(np.float64)).max(axis=1)
    assert all(2.0**14 <= s < 2.0**15 for s in scaled[4:]) and xscale[4] > 1 and xscale[5] < 1
    back = xh.view(np.float16).astype(np.float64) * xscale[:, None]
    assert (np.abs(back - x) <= 2.0**-11 * np.abs(x) + 2.0**-24 * xscale[:, None]).all()

    m = 48
    y = f32(rng.standard_normal((n, m)))
    for bias in (None, f32(rng.standard_normal(m))):
        got = y.copy()
        kernels.epilogue(ptr(got), ptr(xscale), ptr(bias), m, n)
        np.testing.assert_array_equal(got, y * xscale[:, None] + (0.0 if bias is None else bias))


def test_the_fused_epilogues_give_the_bits_of_the_epilogue_then_its_consumer(kernels):
    """scale_split (a layer's q, k and v made side by side by one cuBLAS product), scale_silu_mul (gate and up side by
    side) and scale_add (a product added to the residual) give bit for bit what scale_rows_bias on each product, then
    silu_mul or add, gave: rows of scale 1, 2^-20 and 2^9; with biases and without."""
    rng = np.random.default_rng(4)
    n, widths = 5, (40, 24, 24)
    xscale = f32([1.0, 2.0**-20, 1.0, 2.0**9, 1.0])
    y = f32(rng.standard_normal((n, sum(widths))) * 8)
    parts = np.split(y, np.cumsum(widths)[:-1], axis=1)

    def epilogue(part, bias):
        got = np.ascontiguousarray(part)
        kernels.epilogue(ptr(got), ptr(xscale), ptr(bias), got.shape[1], n)
        return got

    for with_bias in (False, True):
        biases = [f32(rng.standard_normal(m)) if with_bias else None for m in widths]
        outs = [np.full((n, m), np.nan, np.float32) for m in widths]
        kernels.split(ptr(y), ptr(xscale), *map(ptr, outs), *map(ptr, biases), *widths, n)
        for out, part, bias in zip(outs, parts, biases):
            np.testing.assert_array_equal(out, epilogue(part, bias))

        m = 24
        gate_up = np.ascontiguousarray(y[:, : 2 * m])
        out, want = np.full((n, m), np.nan, np.float32), np.full((n, m), np.nan, np.float32)
        kernels.gated(ptr(gate_up), ptr(xscale), ptr(biases[1]), ptr(biases[2]), ptr(out), m, n)
        g, u = epilogue(gate_up[:, :m], biases[1]), epilogue(gate_up[:, m:], biases[2])  # kept alive: ptr's
        kernels.silu(ptr(g), ptr(u), ptr(want), ctypes.c_long(n * m))
        np.testing.assert_array_equal(out, want)

        a = f32(rng.standard_normal((n, m)))
        product = np.ascontiguousarray(y[:, :m])
        kernels.residual(ptr(product), ptr(xscale), ptr(biases[1]), ptr(a), ptr(out), m, n)
        scaled = epilogue(product, biases[1])
        kernels.plus(ptr(a), ptr(scaled), ptr(want), ctypes.c_long(n * m))
        np.testing.assert_array_equal(out, want)
        assert np.isfinite(out).all()
