"""The few-row quantized products of ``gemv.py`` against ``gguf.quants.dequantize`` and float64 products."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from leat.modelfile import Tensor as FileTensor
from leat_backend_tinygrad.backend import TinygradBackend, probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat_backend_tinygrad.gemv import LAYOUTS, MAX_ROWS, Shape, as_words, gemv
from tinygrad import Tensor

Q = gguf.GGMLQuantizationType
TYPES = list(LAYOUTS)


def random_blocks(qtype: Q, outputs: int, k: int, rng) -> np.ndarray:
    """Random bytes as blocks [outputs, blocks, block_bytes], with the float scales kept finite and moderate."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    stored = rng.integers(0, 256, (outputs, k // block, size), dtype=np.uint8)
    if qtype in (Q.Q8_0, Q.Q4_0):
        stored[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    elif qtype == Q.Q6_K:
        stored[..., -2:] = np.array([0.01], np.float16).view(np.uint8)
    elif qtype == Q.Q4_K:
        stored[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)
    elif qtype == Q.MXFP4:  # exponents from the subnormal 0 and 1 up to 2^11
        stored[..., 0] = rng.integers(0, 140, stored.shape[:-1])
        stored[0, :2, 0] = (0, 1)
    return stored


OUTPUTS, K = 40, 512


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_weight_values_bit_for_bit_and_products_against_float64(qtype):
    rng = np.random.default_rng(int(qtype))
    stored = random_blocks(qtype, OUTPUTS, K, rng)
    w = gguf.quants.dequantize(stored.reshape(OUTPUTS, -1), qtype).reshape(OUTPUTS, K)
    # the first rows of x pick one column each: each output is one weight value times 1 plus zeros, exact in
    # float32, so the kernel's decoding must give gguf's values bit for bit (a low nibble in a first half of 128,
    # a high nibble in a second half); the last two rows are random, a misdecoded value would show in their sums
    low = rng.integers(0, 2) * 256 + rng.integers(0, 4) * 32 + rng.integers(0, 16)
    columns = [low, rng.integers(0, 2) * 256 + 128 + rng.integers(0, 4) * 32 + 16 + rng.integers(0, 16)]
    picks = len(columns)
    x = np.zeros((picks + 2, K), np.float32)
    x[np.arange(picks), columns] = 1
    x[picks:] = rng.standard_normal((2, K))
    got = gemv(Tensor(x), Tensor(as_words(stored, qtype)), qtype).numpy()
    np.testing.assert_array_equal(got[:picks], w[:, columns].T)
    # float32 sums of 512 terms: within a few float32 epsilons of the sum of magnitudes
    x64, w64 = x[picks:].astype(np.float64), w.astype(np.float64)
    assert (np.abs(got[picks:] - x64 @ w64.T) <= 1e-6 * (np.abs(x64) @ np.abs(w64).T)).all()


def test_the_backends_few_row_product_is_one_kernel():
    from tinygrad.helpers import GlobalCounters

    rng = np.random.default_rng(3)
    backend = TinygradBackend()
    stored = random_blocks(Q.Q8_0, OUTPUTS, K, rng).reshape(OUTPUTS, -1)
    weight = backend.upload(FileTensor("w", Q.Q8_0, (OUTPUTS, K), stored))
    x = Tensor(rng.standard_normal((MAX_ROWS, K)).astype(np.float32)).realize()
    GlobalCounters.reset()
    y = backend.matmul(x, weight).realize()
    assert GlobalCounters.kernel_count == 1
    w = gguf.quants.dequantize(stored, Q.Q8_0).astype(np.float64)
    np.testing.assert_allclose(y.numpy(), x.numpy().astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)


def test_a_shape_fits_the_outputs_and_the_device():
    shape = Shape(16, 4, 2)
    assert shape.fitting(4096, local=True) == shape
    assert shape.fitting(4096, local=False) == Shape(16, 1, 2)  # no local memory: one set of lanes a group
    assert shape.fitting(12, local=True) == Shape(16, 2, 2)
    assert shape.fitting(6, local=True) == Shape(16, 1, 2)
    assert shape.fitting(41, local=True) == Shape(16, 1, 1)


# tinygrad's PYTHON device runs kernels with local memory (thread groups, barriers) in Python: slow, so few outputs
@pytest.mark.parametrize("shape", [Shape(16, 4, 2), Shape(64, 2, 1), Shape(32, 1, 4)], ids=str)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_thread_shapes_with_row_groups_give_the_same_products(qtype, shape):
    """Several sets of lanes a thread group and several outputs a thread (x loaded once for them): each output
    still the float64 product of its own row, on a device with local memory."""
    rng = np.random.default_rng(int(qtype) + shape.lanes)
    outputs, k = 16, 512
    stored = random_blocks(qtype, outputs, k, rng)
    w = gguf.quants.dequantize(stored.reshape(outputs, -1), qtype).reshape(outputs, k).astype(np.float64)
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = gemv(Tensor(x, device="PYTHON"), Tensor(as_words(stored, qtype), device="PYTHON"), qtype, shape).numpy()
    x64 = x.astype(np.float64)
    assert (np.abs(got - x64 @ w.T) <= 1e-6 * (np.abs(x64) @ np.abs(w).T)).all()
