"""``softmax.py``'s one-kernel attention probabilities of a prompt chunk against float64, on tinygrad's PYTHON device
(thread groups and local memory run as a GPU's) and DEV's device where it has thread groups (a GPU), and the
backend's use of it: the same probabilities as its Tensor ops, eager and at a jitted step's offset."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from leat_backend_tinygrad.backend import probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat.batch import Row
from leat_backend_tinygrad import softmax
from tinygrad import Device, Tensor, dtypes
from tinygrad.helpers import GlobalCounters


def reference(scores, positions, offset, scale, window=None, softcap=None, sinks=None) -> np.ndarray:
    """float64 probabilities [heads, length, total] of scores [heads, length, total], sinks [heads]."""
    _, length, total = scores.shape
    x = scores.astype(np.float64) * scale
    if softcap is not None:
        x = np.tanh(x / softcap) * softcap
    own = positions[offset : offset + length].astype(np.int64)[:, None]
    t = np.arange(total)[None, :]
    seen = t <= own
    if window is not None:
        seen &= t > own - window
    x = np.where(seen[None], x, -np.inf)
    peak = x.max(-1, keepdims=True)
    if sinks is not None:
        peak = np.maximum(peak, sinks.astype(np.float64)[:, None, None])
    e = np.exp(x - peak)
    denominator = e.sum(-1, keepdims=True)
    if sinks is not None:
        denominator += np.exp(sinks.astype(np.float64)[:, None, None] - peak)
    return e / denominator


def _device(device: str) -> str:
    device = Device.DEFAULT if device == "default" else device
    if not Device[device].renderer.has_local:
        pytest.skip(f"{device} has no thread groups: a chunk's softmax keeps tinygrad's kernels there")
    return device


# (kv_heads, group, length, total, offset, window, softcap, sinks, float16): a total whose last load some lanes pass
# (40, 100, 530), one every lane fills (64); GQA groups; a window, a soft cap, sinks; float16 probabilities
CASES = [
    (3, 1, 5, 40, 2, None, None, False, False),
    (1, 2, 4, 100, 0, 7, 30.0, True, True),
    (1, 1, 3, 64, 1, None, None, False, False),
    (1, 2, 2, 530, 3, 200, None, True, True),
]


@pytest.mark.parametrize("device", ["default", "PYTHON"])
@pytest.mark.parametrize(
    ("kv_heads", "group", "length", "total", "offset", "window", "softcap", "sinks", "half"), CASES
)
def test_one_kernel_against_float64(kv_heads, group, length, total, offset, window, softcap, sinks, half, device):
    device = _device(device)
    rng = np.random.default_rng(total)
    heads = kv_heads * group
    scores = (rng.standard_normal((kv_heads, group, length, total)) * 8).astype(np.float32)
    # the chunk's queries at the end of what the keys hold (a later chunk of a prompt), after `offset` other rows
    positions = np.arange(total - length - offset, total).astype(np.int32)
    logits = rng.standard_normal(heads).astype(np.float32) * 3 if sinks else None
    inputs = [Tensor(a, device=device).realize() for a in (scores, positions)]
    sink = Tensor(logits, device=device).realize() if sinks else None
    GlobalCounters.reset()
    got = softmax.probabilities(*inputs, offset, 0.3, window, softcap, sink, dtypes.float16 if half else dtypes.float32)
    got = got.realize()
    assert GlobalCounters.kernel_count == 1 and got.shape == scores.shape
    want = reference(scores.reshape(heads, length, total), positions, offset, 0.3, window, softcap, logits)
    got = got.reshape(heads, length, total)
    if half:  # float16's rounding of values at most 1: half an ulp of 1 (2^-11) at most
        np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=0, atol=2.0**-11)
    else:  # float32 exponents and sums of at most 530 terms: a few float32 epsilons of each
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-6, atol=1e-8)
    assert np.all(got.numpy()[:, :, positions[offset + length - 1] + 1 :] == 0)  # masked keys: exactly 0


def test_lanes_double_while_a_thread_would_hold_many_values():
    assert softmax.lanes(40) == 32 and softmax.lanes(512) == 32  # 2 and 16 values a thread
    assert softmax.lanes(528) == 64 and softmax.lanes(2048) == 128  # 9 and 16
    assert softmax.lanes(8192) == 128 and softmax.lanes(8193) is None  # 64 a thread at most: tinygrad's kernels past


def test_the_backend_takes_the_kernel_where_it_applies_with_the_tensor_ops_probabilities(monkeypatch, cpu_device):
    """The backend's chunk probabilities (``_probabilities``) through the kernel and through its Tensor ops, on the
    PYTHON device: eager (positions made from the row) and jitted (the step's positions, at the row's offset), with a
    window, a soft cap and sinks; and on a device without thread groups the Tensor ops only."""
    from leat_backend_tinygrad.backend import TinygradBackend

    calls = []
    original = softmax.probabilities
    monkeypatch.setattr(softmax, "probabilities", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    backend = TinygradBackend()
    backend.device = "PYTHON"  # the backend's own tensors (positions, sinks) on the device the kernel runs on
    kv_heads, group, length, total, offset, start = 1, 2, 4, 16, 3, 10
    rng = np.random.default_rng(5)
    scores = (rng.standard_normal((kv_heads, group, length, total)) * 6).astype(np.float32)
    sinks = Tensor(rng.standard_normal(kv_heads * group).astype(np.float32), device="PYTHON").realize()
    row = Row(0, start, np.zeros(length, np.int64))
    steps = [None, SimpleNamespace(positions=Tensor(np.arange(start - offset, start + length, dtype=np.int32)))]
    for step in steps:
        if step is not None:
            step.positions = step.positions.to("PYTHON").realize()
        at = offset if step is not None else 0
        made = []
        for kernel in (True, False):
            backend.softmax_kernel = kernel
            x = Tensor(scores, device="PYTHON")
            made.append(backend._probabilities(x, None, 0.4, 20.0, 4, sinks, row, step, at).realize().numpy())
        np.testing.assert_allclose(made[0], made[1], rtol=2e-6, atol=1e-8)
        assert made[0].shape == (kv_heads, group, length, total)
    assert calls == [0, offset]  # the kernel ran once each way (not with softmax_kernel off), at the row's offset
    backend.softmax_kernel, backend.device = True, cpu_device
    x = Tensor(scores, device=cpu_device)  # tinygrad's CPU device: no thread groups, the Tensor ops
    backend._probabilities(x, None, 0.4, 20.0, 4, None, row, None, 0).realize()
    assert calls == [0, offset]
