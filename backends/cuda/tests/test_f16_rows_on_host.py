"""ops.cu's f16 rows for the tensor-core and cuBLAS products (x_to_f16, scale_rows_bias) compiled for the host with
g++ and run with each CUDA thread a fiber (test_moe_mla_on_host.py's harness). No GPU needed; skipped where g++ is
missing."""

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
