"""``qkv.py``: a decode step's q, k (and v) products with RoPE and the cache writes in one kernel, against the two
kernels it replaces (``gemv_segments``, then ``attention.rope_write``): bit for bit on tinygrad's PYTHON device (each
operation rounded as rendered), within float32 rounding on a compiled device (a GPU compiler contracts multiplies and
adds into fused ones differently in the two programs: on the H200 3-12% of q's entries differ, by at most 3.1e-7 of
their size)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from leat_backend_tinygrad.backend import probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat_backend_tinygrad import intx
from leat_backend_tinygrad.attention import rope_write
from leat_backend_tinygrad.gemv import Shape, as_words, gemv_segments
from leat_backend_tinygrad.qkv import fitted, rope_write_products
from tinygrad import Device, Tensor

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, DIM, PAGE, PAGES, K = 4, 2, 16, 4, 3, 512
AT = [5, 0, 9]  # each row's position


def _blocks(rng, outputs: int) -> np.ndarray:
    """Random Q4_K blocks [outputs, K / 256, 144] with moderate d and dmin."""
    stored = rng.integers(0, 256, (outputs, K // 256, 144), dtype=np.uint8)
    stored[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)
    return stored


@pytest.mark.parametrize("device", ["default", "PYTHON"])  # default: DEV's (CPU in CI); PYTHON: thread groups
@pytest.mark.parametrize("v_apart", [False, True])  # v a third product of the kernel, or its own kernel's output
@pytest.mark.parametrize(
    ("kind", "rotated", "integer"), [("f16", DIM, False), ("f32", DIM // 2, False), ("f16", DIM, True)]
)
def test_one_kernel_equals_the_products_then_rope_write(kind, rotated, integer, v_apart, device):
    device = Device.DEFAULT if device == "default" else device
    if not Device[device].renderer.has_local:
        pytest.skip(f"{device} has no thread groups: the backend keeps the products and rope_write there")
    rng = np.random.default_rng(rotated + 2 * v_apart)
    rows = len(AT)
    words = [
        Tensor(as_words(_blocks(rng, n), Q.Q4_K), device=device).realize()
        for n in (HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM)
    ]
    x = Tensor(rng.standard_normal((rows, K)).astype(np.float32), device=device).realize()
    if integer:  # x as 16-bit integers (intx.py): integer products in both kernels
        x = intx.quantize(x)
    table = Tensor(rng.permutation(rows * PAGES).reshape(rows, PAGES).astype(np.int32), device=device).realize()
    at = Tensor(np.asarray(AT, np.int32), device=device).realize()
    angles = np.asarray(AT, np.float64)[:, None] * 10000.0 ** (-np.arange(rotated // 2) * 2 / rotated)
    cos, sin = (Tensor(f(angles).astype(np.float32), device=device).realize() for f in (np.cos, np.sin))
    dtype = np.float16 if kind == "f16" else np.float32
    before = [rng.standard_normal((rows * PAGES * PAGE, KV_HEADS, DIM)).astype(dtype) for _ in range(2)]
    local = Device[device].renderer.has_local
    shape = fitted(Shape(16, 4, 2), tuple(w.shape[0] for w in words), local)
    assert shape is not None

    keys, values = (Tensor(b.copy(), device=device).realize() for b in before)
    q, k, v = gemv_segments(x, words, Q.Q4_K, shape)
    views = (q.reshape(rows, HEADS, DIM), *(t.reshape(rows, KV_HEADS, DIM) for t in (k, v)))
    want_q = rope_write(*views, cos, sin, keys, values, table, at, PAGE, rotated, False).numpy()
    want_k, want_v = keys.numpy(), values.numpy()

    keys, values = (Tensor(b.copy(), device=device).realize() for b in before)
    apart = v.realize() if v_apart else None
    got = rope_write_products(
        x, words[:2] if v_apart else words, Q.Q4_K, shape, apart, cos, sin, keys, values, table, at, PAGE, rotated
    )
    same = np.testing.assert_array_equal if device == "PYTHON" else _within_rounding
    same(got.numpy(), want_q)
    same(keys.numpy(), want_k)
    same(values.numpy(), want_v)
    assert (want_k != before[0]).any() and (want_v != before[1]).any()  # the rows were written


def _within_rounding(got: np.ndarray, want: np.ndarray) -> None:
    """Equal but for the last bits of float32 (f16 storage: of float16) rounding, relative to the largest entry."""
    eps = float(np.finfo(want.dtype).eps)
    np.testing.assert_allclose(got, want, rtol=4 * eps, atol=4 * eps * float(np.abs(want).max()))


def test_a_shape_pairs_each_threads_outputs():
    assert fitted(Shape(16, 4, 2), (64, 32, 32), local=True) == Shape(16, 4, 2)
    assert fitted(Shape(16, 4, 1), (64, 32, 32), local=True) is None  # one output a thread: no pair
    assert fitted(Shape(16, 4, 4), (64, 32, 32), local=False) == Shape(16, 1, 4)
