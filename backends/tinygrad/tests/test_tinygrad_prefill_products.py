"""The tinygrad backend's prefill products: the float16 weight copies kept across chunks
(``TinygradBackend._half_values``), against gguf's dequantization and float64 products written here."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import gguf
import leat
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare
from leat.modelfile import Tensor as FileTensor
from leat_backend_tinygrad.backend import TinygradBackend, Weight, probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

if not os.environ.get("LEAT_TINYGRAD_TEST_OPT"):  # as test_tinygrad_backend.py: the same math, a faster cold run
    from tinygrad.helpers import NOOPT

    NOOPT.value = 1
if "PARALLEL" not in os.environ:
    from tinygrad.helpers import PARALLEL

    PARALLEL.value = 0

Q = gguf.GGMLQuantizationType
REFERENCES = Path(__file__).parents[3] / "tests" / "references"


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A bound on a float16 product's error per output: each float16 product rounded (2^-11 relative), float32 sums."""
    return 2.0**-10 * (np.abs(x) @ np.abs(w).T) + 1e-6


def _tiny_models():
    spec = importlib.util.spec_from_file_location("leat_tests_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weights(obj):
    """The Weights in a model's (nested) dataclasses and lists."""
    if isinstance(obj, Weight):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _weights(item)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _weights(getattr(obj, f.name))


def _prefill(path: str, monkeypatch, budget: int):
    """A tiny Llama-3 Q4_K model's prompt on the tinygrad backend with float16 prefill products (as on a GPU) and
    ``budget`` bytes of float16 copies: a 5-token chunk run eagerly (below the products' 17 rows: no copies; its rope
    spec seen, so the next jit's first call is its capture), then three 32-token chunks under one TinyJit (captured at
    the first: the copies are made inside its capture; then replayed). The model, its logits and the kernels each
    chunk ran."""
    from tinygrad.helpers import GlobalCounters

    for key, value in {"HALF": "1", "GEMM_ROWS": "17", "PREFILL_JIT": "16,32", "F16_BUDGET": str(budget)}.items():
        monkeypatch.setenv(f"LEAT_TINYGRAD_{key}", value)
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    layouts = model.architecture.kv_layouts(model.architecture.params)
    kv = backend.allocate_kv(layouts, slots=1, context=104, pages=26, page_size=4)
    backend.set_pages(kv, 0, np.arange(26))
    ids = np.arange(1, 102)
    logits, kernels = [backend.to_host(forward(Batch([Row(0, 0, ids[:5])]), kv))], []  # eager: no jit's first call
    for start in (5, 37, 69):
        count = GlobalCounters.kernel_count
        logits.append(backend.to_host(backend.run(forward, Batch([Row(0, start, ids[start : start + 32])]), kv)))
        kernels.append(GlobalCounters.kernel_count - count)
    assert backend._jits[(forward, id(kv), "prefill", 32, False)].cnt == 4  # from 1: captured, replayed twice
    return model, np.concatenate(logits), kernels


def test_prefill_weights_float16_copies_are_made_once_outside_the_jit(tmp_path, monkeypatch):
    path = str(_tiny_models().build("q4_k-llama3", tmp_path / "tiny.gguf"))
    copied, got, kernels = _prefill(path, monkeypatch, 1 << 30)
    _, want, plain = _prefill(path, monkeypatch, 0)
    layers = copied.architecture.layers
    halves = [w for w in _weights([layers, copied.architecture.output]) if w.half is not None]
    # every quantized matrix of the layers (7 a layer; not the output's, a one-row product), each its dequantized
    # values in float16 (gguf's, independently)
    assert len(halves) == 7 * len(layers)
    for w in halves:
        want_half = gguf.quants.dequantize(np.asarray(w.host), w.qtype).reshape(w.shape).astype(np.float16)
        np.testing.assert_array_equal(w.half.numpy(), want_half)
    assert copied.backend.allocations.by_type["F16 copies"] == sum(2 * w.half.numel() for w in halves)
    # the replays run the products from the copies: one dequantization kernel fewer per copy, not one more (a copy
    # made inside the capture would be made again at each replay), and the same logits, bit for bit
    assert [p - k for p, k in zip(plain[1:], kernels[1:])] == [len(halves)] * 2, (plain, kernels)
    np.testing.assert_array_equal(got, want)
    oracle = leat.load(path, backend="cpu", precision="f64")
    positions = [4, *range(36, 101, 32)]
    agreement = compare(oracle.logits(list(range(1, 102)), native=True)[positions], got, label="float16 copies")
    assert not agreement.failures(top1=0.99, kl=1e-3), f"{agreement}"


def test_float16_copies_stop_at_the_budget(monkeypatch):
    monkeypatch.setenv("LEAT_TINYGRAD_F16_BUDGET", str(2 * 24 * 512 + 100))
    monkeypatch.setenv("LEAT_TINYGRAD_HALF", "1")
    monkeypatch.setenv("LEAT_TINYGRAD_GEMM_ROWS", "4")
    backend = TinygradBackend()
    rng = np.random.default_rng(5)
    stored = [rng.integers(0, 256, (24, 512 // 32 * 34), dtype=np.uint8) for _ in range(2)]
    for s in stored:
        s.reshape(24, 16, 34)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    weights = [backend.upload(FileTensor(f"w{i}", Q.Q8_0, (24, 512), s)) for i, s in enumerate(stored)]
    x = rng.standard_normal((8, 512)).astype(np.float16).astype(np.float64)  # float16 values: x is cast to them
    for weight, s in zip(weights, stored):
        w = gguf.quants.dequantize(s, Q.Q8_0).reshape(24, 512).astype(np.float16)
        w = w.astype(np.float64)
        got = backend.matmul(x.astype(np.float32), weight).numpy()
        assert (np.abs(got - x @ w.T) <= _bound(x, w)).all()
    assert weights[0].half is not None and weights[1].half is None  # the second past the budget: copied per product
    assert backend.f16_budget == 100
