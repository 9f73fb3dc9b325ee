"""``norm.py``'s one-kernel RMS norm against float64, on tinygrad's PYTHON device (thread groups and local memory run
as a GPU's), and the backend's choice of it."""

from __future__ import annotations

import numpy as np
import pytest
from leat_backend_tinygrad.backend import probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat_backend_tinygrad import norm
from tinygrad import Device, Tensor
from tinygrad.helpers import GlobalCounters


def reference(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    y = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    return y * w if w is not None else y


# default: DEV's device (a GPU there; CI's CPU has no thread groups and skips); PYTHON: thread groups run as a GPU's
@pytest.mark.parametrize("device", ["default", "PYTHON"])
@pytest.mark.parametrize(("rows", "k", "weighted"), [(1, 512, True), (3, 384, True), (2, 256, False)])
def test_one_kernel_against_float64_with_thread_groups(rows, k, weighted, device):
    device = Device.DEFAULT if device == "default" else device
    if not Device[device].renderer.has_local:
        pytest.skip(f"{device} has no thread groups: rms_norm keeps tinygrad's kernels there")
    rng = np.random.default_rng(rows * k)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 30, (rows, 1))).astype(np.float32)
    w = rng.standard_normal(k).astype(np.float32) if weighted else None
    xt = Tensor(x, device=device).realize()
    wt = Tensor(w, device=device).realize() if w is not None else None
    assert norm.applies(xt)
    GlobalCounters.reset()
    got = norm.rms_norm(xt, wt, 1e-5).realize()
    assert GlobalCounters.kernel_count == 1
    # float32 sums of at most 512 squares, one rsqrt, two products: a few float32 epsilons of each value
    np.testing.assert_allclose(got.numpy(), reference(x, w, 1e-5), rtol=2e-6, atol=1e-6)


def test_each_lane_holds_whole_loads_and_few_values():
    assert norm.lanes(4096) == 128  # 32 values a thread, 8 loads of 4
    assert norm.lanes(896) == 32  # 7 loads of 4 a thread: 896 is not a multiple of 64 x 4
    assert norm.lanes(2560) == 128
    assert norm.lanes(100) is None  # no whole 4-value loads for 32 lanes
    assert norm.lanes(128 * 4 * 17) is None  # 68 values a thread: past MOST_VALUES, tinygrad's own kernels instead
    for k in (256, 384, 512, 896, 2048, 4096, 5120, 8192):
        n = norm.lanes(k)
        assert n is not None and k % (n * norm.VECTOR) == 0 and k // n <= norm.MOST_VALUES


def test_the_backend_keeps_tinygrads_norm_where_the_kernel_does_not_apply():
    from leat_backend_tinygrad.backend import TinygradBackend

    backend = TinygradBackend()
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((2, 100)).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    assert not norm.applies(Tensor(x))  # no whole loads: the Tensor ops on any device
    got = backend.to_host(backend.rms_norm(backend.from_host(x), w, 1e-6))
    np.testing.assert_allclose(got, reference(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    on_groups = Device[Device.DEFAULT].renderer.has_local
    assert norm.applies(Tensor(np.zeros((2, 512), np.float32))) == on_groups


@pytest.mark.parametrize("device", ["default", "PYTHON"])
@pytest.mark.parametrize("k", [512, 384, 8192])  # 16 and 12 threads of a run, 128 of two (run_lanes)
def test_the_quantizing_kernel_gives_the_norm_and_its_integers(k, device):
    """rms_norm_quantized: each thread holding whole runs of 32; its norm within float32 rounding of rms_norm's (the
    lanes' sums add in another order), its integers, scales and sums intx.quantize's of that output, bit for bit."""
    from leat_backend_tinygrad import intx

    device = Device.DEFAULT if device == "default" else device
    if not Device[device].renderer.has_local:
        pytest.skip(f"{device} has no thread groups: rms_norm keeps tinygrad's kernels there")
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((2, k)) * 3).astype(np.float32)
    w = rng.standard_normal(k).astype(np.float32)
    xt, wt = Tensor(x, device=device).realize(), Tensor(w, device=device).realize()
    assert norm.run_lanes(k) is not None
    y, quantized = norm.rms_norm_quantized(xt, wt, 1e-5)
    np.testing.assert_allclose(y.numpy(), reference(x, w, 1e-5), rtol=2e-6, atol=1e-6)
    again = intx.quantize(y.realize())
    for got, want in zip(quantized.tensors(), again.tensors()):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_threads_of_whole_runs():
    assert norm.run_lanes(4096) == 128 and norm.run_lanes(8192) == 128 and norm.run_lanes(2048) == 64
    assert norm.run_lanes(896) == 28 and norm.run_lanes(100) is None and norm.run_lanes(16384) is None


@pytest.mark.parametrize("device", ["default", "PYTHON"])
@pytest.mark.parametrize(("rows", "padded", "k"), [(32, 32, 256), (20, 32, 512), (48, 64, 128)])
def test_the_norm_written_in_the_rings_layout_is_the_interleave_of_its_output(rows, padded, k, device):
    """rms_norm_laid_out (a prompt chunk's norm before a staged product of ring.py's): bit for bit ring.interleaved
    of rms_norm's output (float16, rows past the chunk's zero), as one kernel where no padding is asked."""
    from leat_backend_tinygrad import ring
    from tinygrad import dtypes

    device = Device.DEFAULT if device == "default" else device
    if not Device[device].renderer.has_local:
        pytest.skip(f"{device} has no thread groups: rms_norm keeps tinygrad's kernels there")
    rng = np.random.default_rng(rows + k)
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    w = rng.standard_normal(k).astype(np.float32)
    xt, wt = Tensor(x, device=device).realize(), Tensor(w, device=device).realize()
    GlobalCounters.reset()
    got = norm.rms_norm_laid_out(xt, wt, 1e-5, 32, padded).realize()
    assert GlobalCounters.kernel_count == (1 if rows == padded else 2)  # (the padding's copy)
    want = ring.interleaved(norm.rms_norm(xt, wt, 1e-5), 32, padded, dtypes.float16).numpy()
    assert got.shape == want.shape == (padded // 2, 2 * k)
    np.testing.assert_array_equal(got.numpy(), want)
