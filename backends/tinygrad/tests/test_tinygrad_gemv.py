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
from tinygrad import Device, Tensor

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
    # lanes doubled for products of few outputs: 16 for the 8B file's output matrix, 32 for down and o, 64 for k and v
    sizes = (128256, 4096, 1024)
    assert [Shape.for_product(n, threads=65536) for n in sizes] == [shape, Shape(32, 4, 2), Shape(64, 4, 2)]
    assert Shape.for_product(1024, threads=0) == shape
    assert Shape.for_product(14336, gated=True) == Shape(64, 1, 2)  # the gated unit: one shape of its own
    assert Shape.for_product(1024, threads=65536, qtype=Q.Q6_K) == Shape(32, 4, 2)  # Q6_K: 32 lanes at most


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


def _silu(v: np.ndarray) -> np.ndarray:
    return v * 0.5 * (1 + np.tanh(v / 2))  # v * sigmoid(v), without exp's overflow for large -v


@pytest.mark.parametrize("device", ["default", "PYTHON"])  # default: DEV's (CPU in CI); PYTHON: as a GPU's groups
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_the_gated_unit_and_the_residual_in_the_products_kernel(qtype, device):
    """``up=``: silu(x G^T) * (x U^T) from one kernel; ``residual=``: x W^T + r. Each against float64 within the
    float32 sums' bound (carried through silu and the product of the two sums)."""
    device = Device.DEFAULT if device == "default" else device
    rng = np.random.default_rng(int(qtype) + 7)
    outputs, k, shape = 16, 512, Shape(16, 4, 2)
    gate, up = (random_blocks(qtype, outputs, k, rng) for _ in range(2))
    g64, u64 = (
        gguf.quants.dequantize(m.reshape(outputs, -1), qtype).reshape(outputs, k).astype(np.float64) for m in (gate, up)
    )
    x = rng.standard_normal((2, k)).astype(np.float32)
    residual = rng.standard_normal((2, outputs)).astype(np.float32)
    words = [Tensor(as_words(m, qtype), device=device) for m in (gate, up)]
    xt = Tensor(x, device=device)
    glu = gemv(xt, words[0], qtype, shape, up=words[1]).numpy()
    added = gemv(xt, words[0], qtype, shape, residual=Tensor(residual, device=device)).numpy()
    x64 = x.astype(np.float64)
    bound_g, bound_u = (1e-6 * (np.abs(x64) @ np.abs(m).T) for m in (g64, u64))
    sg, su = x64 @ g64.T, x64 @ u64.T
    # silu's slope is at most 1.1: each factor off by its sum's bound (and float32 rounding of the outputs)
    limit = 1.1 * bound_g * np.abs(su) + np.abs(_silu(sg)) * bound_u + 1e-6 * np.abs(_silu(sg) * su) + 1e-6
    assert (np.abs(glu - _silu(sg) * su) <= limit).all()
    assert (np.abs(added - (sg + residual)) <= bound_g + 1e-6 * np.abs(sg + residual)).all()
    # the gate alone is not the gated unit: a kernel that skipped up would fail the check above
    assert np.abs(glu - _silu(sg)).max() > 10 * limit.max()


@pytest.mark.parametrize("fused", [True, False])
def test_the_backend_takes_a_products_consumer_into_its_kernel(fused):
    """silu_mul of a gate and an up product of one x is one kernel, add of a product and the residual is one kernel
    (LEAT_TINYGRAD_FUSE_PRODUCTS on); off, the products and their consumers run apart. Both give the float64
    values."""
    from tinygrad.helpers import GlobalCounters

    rng = np.random.default_rng(11)
    backend = TinygradBackend()
    backend.fuse_products = fused
    k, outputs = 512, 64
    g, u, w = (
        backend.upload(FileTensor(n, Q.Q4_K, (outputs, k), random_blocks(Q.Q4_K, outputs, k, rng).reshape(outputs, -1)))
        for n in "guw"
    )
    x = Tensor(rng.standard_normal((2, k)).astype(np.float32)).realize()
    residual = Tensor(rng.standard_normal((2, outputs)).astype(np.float32)).realize()
    GlobalCounters.reset()
    glu = backend.silu_mul(backend.matmul(x, g), backend.matmul(x, u)).realize()
    assert GlobalCounters.kernel_count == (1 if fused else 3)
    GlobalCounters.reset()
    added = backend.add(residual, backend.matmul(x, w))
    assert GlobalCounters.kernel_count == (1 if fused else 2)
    x64 = x.numpy().astype(np.float64)
    g64, u64, w64 = (
        gguf.quants.dequantize(m.data.numpy().view(np.uint8), Q.Q4_K).reshape(outputs, k) for m in (g, u, w)
    )
    ax = np.abs(x64)
    glu_bound = 1e-5 * (ax @ np.abs(g64).T) * (ax @ np.abs(u64).T) + 1e-6  # float32 sums, through silu and a product
    assert (np.abs(glu.numpy() - _silu(x64 @ g64.T) * (x64 @ u64.T)) <= glu_bound).all()
    add_bound = 1e-6 * (ax @ np.abs(w64).T + np.abs(residual.numpy())) + 1e-6
    assert (np.abs(added.numpy() - (residual.numpy() + x64 @ w64.T)) <= add_bound).all()
    # a product that is not its consumer's operand any more (consumed once) is made again as it was
    y = backend.matmul(x, w)
    assert backend.add(residual, y).numpy() == pytest.approx(backend.add(residual, y).numpy(), abs=1e-6)


@pytest.mark.parametrize("device", ["default", "PYTHON"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_several_products_of_one_x_in_one_kernel(qtype, device):
    """gemv_segments (a layer's q, k and v): each output equal to its own product's, bit for bit (the same sums in
    the same order; each weight's rows read through gated loads, stored through gated stores)."""
    from leat_backend_tinygrad.gemv import gemv_segments

    device = Device.DEFAULT if device == "default" else device
    rng = np.random.default_rng(int(qtype) + 3)
    k, shape = 512, Shape(16, 4, 2)
    words = [Tensor(as_words(random_blocks(qtype, n, k, rng), qtype), device=device).realize() for n in (32, 16, 8)]
    x = Tensor(rng.standard_normal((2, k)).astype(np.float32), device=device).realize()
    together = gemv_segments(x, words, qtype, shape)
    assert [t.shape for t in together] == [(2, 32), (2, 16), (2, 8)]
    for got, w in zip(together, words):
        np.testing.assert_array_equal(got.numpy(), gemv(x, w, qtype, shape).numpy())
    # five rows: the thread groups shrink to outputs that divide every weight's (none straddles two weights; on a GPU
    # a 16-thread group, part of a warp), bit for bit the five rows' own product of that shape, and within float32
    # rounding the rows of the eight-row product's (another kernel: NVRTC may contract its sums otherwise)
    five = words[2][:5].contiguous().realize()
    odd = gemv_segments(x, [words[0], five], qtype, shape)
    np.testing.assert_array_equal(odd[1].numpy(), gemv(x, five, qtype, shape.fitting(5, True)).numpy())
    np.testing.assert_allclose(odd[1].numpy(), gemv(x, words[2], qtype, shape).numpy()[:, :5], rtol=1e-5, atol=1e-5)
