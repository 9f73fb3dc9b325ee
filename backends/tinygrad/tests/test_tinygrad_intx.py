"""``intx.py``: x quantized to 16-bit integers a run of 32, and Q4_K and Q6_K products of it with integer dot
products, against float64 (with the same quantized x: float32 rounding only; with x itself: the quantizing's error)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from leat_backend_tinygrad.backend import probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat_backend_tinygrad import intx
from leat_backend_tinygrad.gemv import Shape, as_words, gemv, gemv_segments
from tinygrad import Device, Tensor

Q = gguf.GGMLQuantizationType
K = 512


def _blocks(rng, outputs: int, qtype: Q = Q.Q4_K) -> np.ndarray:
    """Random blocks of ``qtype`` (every quant and scale byte random) with small super-block scales."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    stored = rng.integers(0, 256, (outputs, K // 256, size), dtype=np.uint8)
    if qtype == Q.Q4_K:
        stored[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)
    else:  # Q6_K: d last
        stored[..., -2:] = np.array([0.02], np.float16).view(np.uint8)
    return stored


def _x(rng, rows: int) -> np.ndarray:
    x = (rng.standard_normal((rows, K)) * rng.uniform(0.1, 20, (rows, 1))).astype(np.float32)
    x[0, 32:64] = 0  # a run of zeros: scale 0, integers 0
    return x


def _dequantized(q: intx.Quantized) -> np.ndarray:
    words = q.words.numpy().astype(np.int64)
    low, high = ((words << 16) & 0xFFFFFFFF).astype(np.uint32).view(np.int32) >> 16, words.astype(np.int32) >> 16
    ints = np.stack([low, high], axis=-1).reshape(words.shape[0], -1)
    return ints, ints * np.repeat(q.scales.numpy().astype(np.float64), 32, axis=1)


@pytest.mark.parametrize("device", ["default", "PYTHON"])
def test_quantized_x_round_trips_within_half_a_step(device):
    device = Device.DEFAULT if device == "default" else device
    rng = np.random.default_rng(1)
    x = _x(rng, 3)
    q = intx.quantize(Tensor(x, device=device).realize())
    ints, back = _dequantized(q)
    scales = q.scales.numpy().astype(np.float64)
    assert np.abs(ints).max() == intx.LIMIT and (scales[0, 1] == 0) and (ints[0, 32:64] == 0).all()
    np.testing.assert_array_less(np.abs(back - x), np.repeat(scales, 32, axis=1) * 0.5 + 1e-12)
    np.testing.assert_array_equal(q.sums.numpy(), ints.reshape(3, -1, 16).sum(-1))


@pytest.mark.parametrize("device", ["default", "PYTHON"])
@pytest.mark.parametrize("kind", ["plain", "glu", "segments"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=["q4_k", "q6_k"])
def test_integer_products_against_float64(qtype, kind, device):
    device = Device.DEFAULT if device == "default" else device
    rng = np.random.default_rng(2)
    outputs, rows = 16, 2
    stored = [_blocks(rng, outputs, qtype) for _ in range(2)]
    w = [gguf.quants.dequantize(s.reshape(outputs, -1), qtype).reshape(outputs, K).astype(np.float64) for s in stored]
    words = [Tensor(as_words(s, qtype), device=device).realize() for s in stored]
    x = _x(rng, rows)
    q = intx.quantize(Tensor(x, device=device).realize())
    _, xq = _dequantized(q)
    shape = Shape(16, 2, 2)
    if kind == "plain":
        got, want, exact = gemv(q, words[0], qtype, shape).numpy(), xq @ w[0].T, x @ w[0].T
    elif kind == "glu":
        got = gemv(q, words[0], qtype, shape, up=words[1]).numpy()
        gate, gate_x = xq @ w[0].T, x.astype(np.float64) @ w[0].T
        with np.errstate(over="ignore"):  # silu of a large negative gate: exp overflows, the product is -0
            want = gate / (1 + np.exp(-gate)) * (xq @ w[1].T)
            exact = gate_x / (1 + np.exp(-gate_x)) * (x @ w[1].T)
    else:
        made = gemv_segments(q, words, qtype, shape)
        got = np.concatenate([m.numpy() for m in made], axis=1)
        want, exact = np.concatenate([xq @ m.T for m in w], axis=1), np.concatenate([x @ m.T for m in w], axis=1)
    magnitude = (np.abs(xq) @ np.abs(np.concatenate(w)).T).max(axis=1, keepdims=True)
    # float32 sums of exact integer products, scaled: a few float32 epsilons of the magnitudes
    bound = magnitude**2 if kind == "glu" else magnitude  # silu(gate) * up: each sum's rounding times the other
    assert (np.abs(got - want) <= 1e-5 * bound).all(), np.abs(got - want).max()
    # against x itself: within the quantizing's error (half a step a value, a run's amax / 32767)
    assert np.abs(got - exact).max() <= 1e-3 * np.abs(exact).max()
    # the same product of the float path (gemv's float kernel), to the quantizing's error
    if kind == "plain":
        floats = gemv(Tensor(x, device=device), words[0], qtype, shape).numpy()
        assert np.abs(got - floats).max() <= 1e-3 * np.abs(floats).max()


@pytest.mark.parametrize("name", ["q4_k-llama3", "q6_k"])
def test_decode_steps_with_integer_products_meet_the_backend_bar(name, tmp_path, monkeypatch):
    """A tiny Q4_K Llama-3's (and a Q6_K Llama's) jitted decode steps with LEAT_TINYGRAD_INT_PRODUCTS=1 (every
    few-row product of the type, fused or not, on 16-bit integer x) against the float64 oracle: the backend bar,
    top-1 >= 99% and mean KL < 1e-3 (16-bit x cannot hold float32's ~1e-13)."""
    import importlib.util
    from pathlib import Path

    import leat
    from leat.batch import Batch, Row
    from leat.compare import compare

    spec = importlib.util.spec_from_file_location(
        "tiny_models", Path(__file__).parents[3] / "tests/references/tiny_models.py"
    )
    tiny_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_models)
    path = str(tiny_models.build(name, tmp_path / "tiny.gguf"))
    ids = np.arange(1, 25)
    want = leat.load(path, backend="cpu", precision="f64").logits(ids.tolist(), native=True)
    monkeypatch.setenv("LEAT_TINYGRAD_INT_PRODUCTS", "1")
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    assert backend.int_products
    kv = model.new_kv(32, slots=1, dtype="f32")
    backend.run(forward, Batch([Row(0, 0, ids[:8])]), kv)
    got = [
        np.asarray(backend.to_host(backend.run(forward, Batch([Row(0, p, ids[p : p + 1])]), kv)))[-1]
        for p in range(8, 24)
    ]
    assert backend._quantized  # the products took quantized x
    agreement = compare(want[8:24], np.stack(got), label="tinygrad integer products vs cpu f64")
    print(agreement)
    assert not agreement.failures(top1=0.99, kl=1e-3), f"{agreement}"
    assert agreement.mean_kl > 1e-12  # not the float path (float32 against float64: ~1e-13)


@pytest.mark.parametrize(("mode", "quantized"), [("0", False), ("1", True), ("normed", False)])
def test_which_products_take_integer_x(mode, quantized, monkeypatch):
    """LEAT_TINYGRAD_INT_PRODUCTS: "1" quantizes a Q4_K or Q6_K product's x (once an x, shared by both types),
    "normed" only an x the norm kernel quantized (none here: x is made directly), "0" none; other types never.
    LEAT_TINYGRAD_INT_TYPES narrows the types."""
    from leat_backend_tinygrad.backend import TinygradBackend

    monkeypatch.setenv("LEAT_TINYGRAD_INT_PRODUCTS", mode)
    backend = TinygradBackend()
    x = Tensor(np.ones((1, 64), np.float32)).realize()
    made = backend._gemv_x(x, Q.Q4_K)
    assert isinstance(made, intx.Quantized) == quantized
    assert backend._gemv_x(x, Q.Q4_K) is made  # once an x
    assert backend._gemv_x(x, Q.Q6_K) is made
    assert backend._gemv_x(x, Q.Q8_0) is x
    monkeypatch.setenv("LEAT_TINYGRAD_INT_TYPES", "q4_k")
    backend = TinygradBackend()
    assert backend._gemv_x(x, Q.Q6_K) is x and backend.describe()["int_types"] == "q4_k"
    assert isinstance(backend._gemv_x(x, Q.Q4_K), intx.Quantized) == quantized
    monkeypatch.setenv("LEAT_TINYGRAD_INT_TYPES", "q4_k,q8_0")
    with pytest.raises(ValueError, match="q8_0"):
        TinygradBackend()
    monkeypatch.setenv("LEAT_TINYGRAD_INT_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="use 0, 1 or normed"):
        TinygradBackend()


@pytest.mark.parametrize("cuda", [True, False])
def test_integer_products_are_the_default_where_the_renderer_has_dp2a(cuda, monkeypatch):
    """Unset, LEAT_TINYGRAD_INT_PRODUCTS is "1" on a CUDA renderer (its dp2a: measured faster on the H200) and "0"
    elsewhere (the portable integer sums are not yet timed)."""
    from leat_backend_tinygrad.backend import TinygradBackend

    monkeypatch.delenv("LEAT_TINYGRAD_INT_PRODUCTS", raising=False)
    monkeypatch.setattr(intx, "intrinsic", lambda device: cuda)
    backend = TinygradBackend()
    assert backend.int_products == cuda and not backend.int_products_normed_only
    monkeypatch.undo()
    monkeypatch.delenv("LEAT_TINYGRAD_INT_PRODUCTS", raising=False)
    assert TinygradBackend().int_products == intx.intrinsic(Device.DEFAULT)  # this machine's device as it is
