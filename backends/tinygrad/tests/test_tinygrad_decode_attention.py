"""Decode attention as ``attention.py``'s kernels (every row one token, all rows at once): the kernels against a
float64 reference written here, the backend's op against its row-by-row path, and whole tiny models' jitted decode
steps against the CPU float64 oracle (leat.compare's bars: top-1 >= 99%, mean KL < 1e-3)."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import gguf
import leat
import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.compare import compare
from leat_backend_tinygrad.backend import TinygradBackend, probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat_backend_tinygrad import attention
from leat_backend_tinygrad.attention import decode_attention, rope_write
from tinygrad import Device, Tensor
from tinygrad.helpers import GlobalCounters

if "PARALLEL" not in os.environ:  # as test_tinygrad_backend.py: compile in this process on a 2-core machine
    from tinygrad.helpers import PARALLEL

    PARALLEL.value = 0
os.environ.setdefault("LEAT_TINYGRAD_HALF", "0")

Q = gguf.GGMLQuantizationType
REFERENCES = Path(__file__).parents[3] / "tests" / "references"
BARS = {"top1": 0.99, "kl": 1e-3}
HEADS, KV_HEADS, DIM, PAGE, PAGES = 6, 2, 32, 4, 8  # GQA: three query heads a KV head; 32 positions a row
AT = [0, 5, 17, 31]  # each row's position: the first, inside a page, a page's first, the last one


def reference(q, keys, values, at, scale, window=None, softcap=None, sinks=None):
    """float64 [rows, heads * dim]: each row's softmax over its positions 0..at (the last ``window`` of them) of
    keys/values [rows, positions, kv_heads, dim], loop by loop."""
    rows, heads, _ = q.shape
    group = heads // keys.shape[2]
    out = np.zeros((rows, heads, values.shape[3]))
    for r in range(rows):
        seen = [t for t in range(at[r] + 1) if window is None or t > at[r] - window]
        for h in range(heads):
            scores = [float(q[r, h] @ keys[r, t, h // group]) * scale for t in seen]
            if softcap is not None:
                scores = [softcap * math.tanh(s / softcap) for s in scores]
            top = max(scores + ([sinks[h]] if sinks is not None else []))
            total = sum(math.exp(s - top) for s in scores) + (math.exp(sinks[h] - top) if sinks is not None else 0)
            out[r, h] = sum(math.exp(s - top) / total * values[r, t, h // group] for s, t in zip(scores, seen))
    return out.reshape(rows, -1)


def paged(rng, kind: str, at=AT, pages=PAGES):
    """Random keys and values [rows, positions, kv_heads, dim] stored in shuffled pages of one storage (float32,
    float16 or q8_0 as the backend stores them), with each row's table (``pages`` pages a row, a row at each
    position of ``at``); positions past a row's own hold values 100 times larger (a kernel that attends one position
    too many would be far off). Returns (stored keys and values, q8_0 scales or None, tables, the float64 values the
    storage holds [rows, positions, kv_heads, dim])."""
    rows, positions = len(at), PAGE * pages
    table = rng.permutation(rows * pages).reshape(rows, pages).astype(np.int32)
    stored, scales, held = [], [], []
    for _ in range(2):
        x = rng.standard_normal((rows, positions, KV_HEADS, DIM)).astype(np.float32)
        x[np.arange(positions)[None, :] > np.asarray(at)[:, None]] *= 100
        storage = np.zeros((rows * positions, KV_HEADS, DIM), np.float32)
        storage[(table[:, :, None] * PAGE + np.arange(PAGE)).reshape(rows, positions)] = x
        if kind == "q8_0":
            blocks = gguf.quants.quantize(storage.reshape(-1, DIM), Q.Q8_0).reshape(-1, 34)
            scales.append(Tensor(blocks[:, :2].copy().view(np.float16).reshape(-1, KV_HEADS, DIM // 32)))
            stored.append(Tensor(blocks[:, 2:].copy().view(np.int8).reshape(storage.shape)))
            values = gguf.quants.dequantize(blocks.reshape(-1), Q.Q8_0).reshape(storage.shape)
        else:
            kind_dtype = np.float16 if kind == "f16" else np.float32
            stored.append(Tensor(storage.astype(kind_dtype)))
            values = storage.astype(kind_dtype)
        held.append(values.astype(np.float64)[(table[:, :, None] * PAGE + np.arange(PAGE)).reshape(rows, positions)])
    return stored, (tuple(scales) if scales else None), table, held


def _kernels_case(
    kind: str, feature: str, device: str, fused: bool | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernels on ``device`` for one storage kind and feature: (their output, the float64 reference, the stored
    values in float64)."""
    rng = np.random.default_rng(7)
    (keys, values), scales, table, (k64, v64) = paged(rng, kind)
    q = rng.standard_normal((len(AT), HEADS, DIM)).astype(np.float32)
    sinks = np.array([-2.0, 0.0, 1.5, 4.0, -30.0, 0.7], np.float32)
    window = 6 if feature == "window" else None
    softcap = 1.5 if feature == "softcap" else None
    moved = [t.to(device).realize() for t in (keys, values, *(scales or ()))]
    got = decode_attention(
        Tensor(q, device=device),
        moved[0],
        moved[1],
        Tensor(table, device=device),
        Tensor(np.asarray(AT, np.int32), device=device),
        PAGE,
        0.3,
        window,
        softcap,
        Tensor(sinks, device=device) if feature == "sinks" else None,
        tuple(moved[2:]) if scales else None,
        fused,
    ).numpy()
    want = reference(q, k64, v64, AT, 0.3, window, softcap, sinks if feature == "sinks" else None)
    return got, want, v64


@pytest.mark.parametrize("kind", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("feature", ["plain", "window", "softcap", "sinks"])
def test_kernels_against_float64(kind, feature):
    got, want, v64 = _kernels_case(kind, feature, Device.DEFAULT)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the row at position 0 sees its first value only (no sink: its one weight is 1)
    if feature != "sinks":
        np.testing.assert_allclose(got[0].reshape(HEADS, DIM), v64[0, 0].repeat(HEADS // KV_HEADS, 0), atol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize(("kind", "feature"), [("f16", "window"), ("q8_0", "sinks"), ("f32", "softcap")])
def test_kernels_with_thread_groups_against_float64(kind, feature, fused):
    """The kernels on tinygrad's PYTHON device, which runs thread groups (their local axes) as a GPU does: the scores
    and chunks as one kernel (their scores in local memory) or as two."""
    got, want, _ = _kernels_case(kind, feature, "PYTHON", fused)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(("kind", "feature", "mode"), [("f16", "sinks", "local"), ("q8_0", "window", "group")])
def test_the_combines_lanes_against_float64(kind, feature, mode, monkeypatch):
    """The combine with each value entry's chunks shared by lanes (chunks of 4 positions, 8 a row, 4 lanes of two
    chunks each) on the PYTHON device: the lanes' max and sums through local memory as the butterfly's exchanges
    (CUDA's shuffles) or as tinygrad's group reduce (AMD's default)."""
    monkeypatch.setattr(attention, "FUSED_MIN_CHUNK", 4)
    monkeypatch.setattr(attention, "COMBINE_LANES", 4)
    monkeypatch.setenv("LEAT_TINYGRAD_LANE_SUM", mode)
    assert attention.combine_lanes(PAGE * PAGES // 4) == 4
    got, want, _ = _kernels_case(kind, feature, "PYTHON", True)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_the_combines_lanes_past_the_last_chunk_against_float64():
    """Nine chunks (slots of nine pages of 4 positions) over 8 lanes: the last lanes' second chunk is past the last,
    read as empty (no load, weight 0), on the PYTHON device."""
    rng = np.random.default_rng(11)
    pages, at = 9, [35, 20]
    assert attention.combine_lanes(pages) == 8
    (keys, values), _, table, (k64, v64) = paged(rng, "f32", at, pages)
    q = rng.standard_normal((2, HEADS, DIM)).astype(np.float32)
    sinks = np.array([-2.0, 0.0, 1.5, 4.0, -30.0, 0.7], np.float32)
    got = decode_attention(
        Tensor(q, device="PYTHON"),
        keys.to("PYTHON").realize(),
        values.to("PYTHON").realize(),
        *(Tensor(x, device="PYTHON") for x in (table, np.asarray(at, np.int32))),
        PAGE,
        0.3,
        sinks=Tensor(sinks, device="PYTHON"),
    ).numpy()
    np.testing.assert_allclose(got, reference(q, k64, v64, at, 0.3, sinks=sinks), rtol=2e-5, atol=2e-5)


def test_off_by_one_in_the_causal_length_would_fail():
    """The reference given one position more per row differs from the kernels by far more than the tolerance."""
    rng = np.random.default_rng(8)
    (keys, values), _, table, (k64, v64) = paged(rng, "f32")
    q = rng.standard_normal((len(AT) - 1, HEADS, DIM)).astype(np.float32)
    at = AT[:-1]  # the last row's position is the last one: it has no next position
    got = decode_attention(
        Tensor(q), keys, values, Tensor(table[:-1]), Tensor(np.asarray(at, np.int32)), PAGE, 0.3
    ).numpy()
    np.testing.assert_allclose(got, reference(q, k64, v64, at, 0.3), rtol=2e-5, atol=2e-5)
    assert np.abs(got - reference(q, k64, v64, [a + 1 for a in at], 0.3)).max() > 1.0


def test_the_backends_decode_step_attends_all_rows_at_once_as_its_row_by_row_path():
    rng = np.random.default_rng(9)
    out = {}
    for on in (True, False):
        backend = TinygradBackend()
        backend.decode_attention = on
        kv = backend.allocate_kv([KVLayout(KV_HEADS, DIM, window=5)], slots=3, context=24, page_size=4, dtype="f16")
        for slot in range(3):
            backend.set_pages(kv, slot, np.arange(6 * slot, 6 * slot + 6)[::-1].copy())
        prompts = {0: 9, 1: 1, 2: 14}
        gen = np.random.default_rng(10)
        for slot, n in prompts.items():  # the same prefill for both paths (the row-by-row one)
            q, k, v = (gen.standard_normal((n, h, DIM)).astype(np.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
            backend.attention(q, k, v, kv, 0, Batch([Row(slot, 0, np.zeros(n, int))]), 0.3)
        rows = [Row(slot, n, np.zeros(1, int)) for slot, n in prompts.items()]
        kernels = []
        for n in (1, 3):  # the first row alone, then all three (its K and V written again, the same)
            q, k, v = (Tensor(rng.standard_normal((3, h, DIM)).astype(np.float32)[:n]).realize() for h in (6, 2, 2))
            rng = np.random.default_rng(9)  # the same decode inputs for both paths
            GlobalCounters.reset()
            out[on] = backend.attention(q, k, v, kv, 0, Batch(rows[:n]), 0.3).numpy()
            kernels.append(GlobalCounters.kernel_count)
        if on:  # two more rows, no more kernels: one K write, one V write and the attention's for all rows
            assert kernels[1] == kernels[0]
        else:  # row by row: the writes and the attention's kernels again for each row
            assert kernels[1] - kernels[0] > 2 * 2
    np.testing.assert_allclose(out[True], out[False], rtol=1e-5, atol=1e-5)


def _rope64(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotated: int, neox: bool) -> np.ndarray:
    """float64 RoPE of x [rows, heads, dim] (its first ``rotated`` entries) with each row's cos, sin [rows, rotated / 2]."""
    out, half = x.astype(np.float64).copy(), rotated // 2
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = (x[..., :half], x[..., half:rotated]) if neox else (x[..., 0:rotated:2], x[..., 1:rotated:2])
    first, second = a * c - b * s, a * s + b * c
    if neox:
        out[..., :half], out[..., half:rotated] = first, second
    else:
        out[..., 0:rotated:2], out[..., 1:rotated:2] = first, second
    return out


@pytest.mark.parametrize("device", ["default", "PYTHON"])  # default: DEV's (CPU in CI); PYTHON: thread groups
@pytest.mark.parametrize(("neox", "rotated"), [(True, DIM), (False, DIM), (True, DIM // 2), (False, DIM // 2)])
@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_rope_and_both_cache_writes_in_one_kernel(kind, neox, rotated, device):
    """rope_write: q rotated (returned), k rotated and v written at each row's position through its page table,
    against float64 RoPE; every other storage row unchanged."""
    device = Device.DEFAULT if device == "default" else device
    rng = np.random.default_rng(12)
    rows = len(AT)
    table = rng.permutation(rows * PAGES).reshape(rows, PAGES).astype(np.int32)
    dtype = np.float16 if kind == "f16" else np.float32
    before = [rng.standard_normal((rows * PAGES * PAGE, KV_HEADS, DIM)).astype(dtype) for _ in range(2)]
    q = rng.standard_normal((rows, HEADS, DIM)).astype(np.float32)
    k, v = (rng.standard_normal((rows, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    angles = np.asarray(AT, np.float64)[:, None] * 10000.0 ** (-np.arange(rotated // 2) * 2 / rotated)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    keys, values = (Tensor(b.copy(), device=device).realize() for b in before)
    got = rope_write(
        *(Tensor(t, device=device) for t in (q, k, v, cos, sin)),
        keys,
        values,
        Tensor(table, device=device),
        Tensor(np.asarray(AT, np.int32), device=device),
        PAGE,
        rotated,
        neox,
    ).numpy()
    np.testing.assert_allclose(got, _rope64(q, cos, sin, rotated, neox), rtol=1e-6, atol=1e-6)
    stored = [table[r, AT[r] // PAGE] * PAGE + AT[r] % PAGE for r in range(rows)]
    want_k, want_v = before[0].copy(), before[1].copy()
    want_k[stored], want_v[stored] = _rope64(k, cos, sin, rotated, neox).astype(dtype), v.astype(dtype)
    tolerance = 1e-3 if kind == "f16" else 1e-6  # one rounding to float16 of float32 values
    np.testing.assert_allclose(keys.numpy(), want_k, rtol=tolerance, atol=tolerance)
    np.testing.assert_array_equal(values.numpy(), want_v)
    # the rotation is there: an unrotated k differs (every row but the one at position 0)
    assert np.abs(keys.numpy()[stored[1:]] - k[1:].astype(dtype)).max() > 0.1


def _tiny(name: str, path: Path) -> str:
    if name == "gemma3":  # sliding-window layers (two page groups)
        from leat import plugins
        from leat.testing import write_tiny_gguf

        entry = plugins.host().get("architectures", name)
        if entry is None:
            pytest.skip(f"no installed plugin serves {name}")
        return str(write_tiny_gguf(entry.load(), path))
    spec = importlib.util.spec_from_file_location("leat_tests_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build(name, path))


@pytest.mark.parametrize(
    ("name", "kind", "integer"),
    [
        ("q4_k-llama3", "f32", "0"),
        ("q4_k-llama3", "f16", "0"),
        ("q4_k-llama3", "q8_0", "0"),
        ("gemma3", "f16", "0"),
        ("q4_k-llama3", "f16", "1"),  # the products on 16-bit integer x (the default on CUDA)
    ],
)
def test_jitted_decode_steps_of_rows_at_different_depths_match_the_f64_oracle(
    name, kind, integer, tmp_path, monkeypatch
):
    """Three slots decoded together under TinyJit (a bucket of 4: a padding row too), one from position 0, the
    others after prompts of 8 and 13 tokens; every step's logits against the row-by-row path's (the same KV
    storage, so the same rounding) and the oracle's: the bars (q8_0 KV: its mean KL only; its rounding may flip
    a top-1 of these few positions, the row-by-row path's as well), float32 KV within 1e-4; and with the products on
    16-bit integer x in both paths."""
    monkeypatch.setenv("LEAT_TINYGRAD_INT_PRODUCTS", integer)
    path = _tiny(name, tmp_path / f"tiny-{name}.gguf")
    ids = [np.arange(1, 25), np.arange(30, 54), np.arange(7, 55, 2)]
    want = [leat.load(path, backend="cpu", precision="f64").logits(seq.tolist(), native=True) for seq in ids]
    got: dict[bool, list[np.ndarray]] = {}
    for on in (True, False):
        model = leat.load(path, backend="tinygrad")
        backend, forward = model.backend, model.architecture.forward
        backend.decode_attention = backend.fuse_products = on  # off: row by row, each product and rope on its own
        layouts = model.architecture.kv_layouts(model.architecture.params)
        kv = backend.allocate_kv(layouts, slots=3, context=24, pages=18, page_size=4, dtype=kind)
        for slot in range(3):
            backend.set_pages(kv, slot, np.arange(6 * slot, 6 * slot + 6))
        starts = [8, 0, 13]
        for slot in (0, 2):
            backend.run(forward, Batch([Row(slot, 0, ids[slot][: starts[slot]])]), kv)
        got[on] = []
        for i in range(5):
            rows = [
                Row(slot, starts[slot] + i, ids[slot][starts[slot] + i : starts[slot] + i + 1]) for slot in range(3)
            ]
            got[on].append(np.asarray(backend.to_host(backend.run(forward, Batch(rows), kv))))
        assert backend._jits[(forward, id(kv), 4)].cnt >= 4  # replayed
        assert bool(backend._quantized) == (integer == "1")  # integer x where asked, float x else
    for slot, start in enumerate([8, 0, 13]):
        mine = np.stack([step[slot] for step in got[True]])
        # integer x: the two paths' x differ in float32 rounding, which can move an integer by one (half a step of a
        # run's amax / 32767 in each value): the logits then differ by up to ~2e-4 here, so 1e-3 for them
        tolerance = 1e-4 if integer == "0" else 1e-3
        np.testing.assert_allclose(mine, np.stack([step[slot] for step in got[False]]), rtol=tolerance, atol=tolerance)
        agreement = compare(want[slot][start : start + 5], mine, label=f"{name} {kind} KV, slot {slot}")
        bars = BARS if kind != "q8_0" else {"top1": 0.0, "kl": BARS["kl"]}
        assert not agreement.failures(**bars), f"{agreement}"
        if kind == "f32":
            np.testing.assert_allclose(mine, want[slot][start : start + 5], rtol=1e-4, atol=1e-4)


def test_an_eager_decode_step_rotates_and_writes_in_rope_write(tmp_path, monkeypatch):
    """Outside TinyJit too (the forward called as it is), a decode step's attention takes q and k from before rope
    into rope_write (or, on a device with thread groups, the products themselves into qkv.py's one kernel), and its
    logits are those of the step with the fusions off (each rope and write its own)."""
    import leat_backend_tinygrad.backend as module
    from leat_backend_tinygrad import qkv

    calls = []
    monkeypatch.setattr(module, "rope_write", lambda *a: calls.append(1) or rope_write(*a))
    products = qkv.rope_write_products
    monkeypatch.setattr(qkv, "rope_write_products", lambda *a: calls.append(2) or products(*a))
    path = _tiny("q4_k-llama3", tmp_path / "tiny.gguf")
    ids = np.arange(3, 12)
    logits = {}
    for on in (True, False):
        model = leat.load(path, backend="tinygrad")
        backend, forward = model.backend, model.architecture.forward
        backend.fuse_products = on
        layouts = model.architecture.kv_layouts(model.architecture.params)
        kv = backend.allocate_kv(layouts, slots=1, context=16, pages=4, page_size=4, dtype="f32")
        backend.set_pages(kv, 0, np.arange(4))
        forward(Batch([Row(0, 0, ids[:8])]), kv)
        calls.clear()
        logits[on] = np.asarray(backend.to_host(forward(Batch([Row(0, 8, ids[8:9])]), kv)))
        assert (len(calls) > 0) == on  # once a layer with the fusions on, never with them off
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)
