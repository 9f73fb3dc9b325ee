"""Checks every backend passes: ops against float64 references, quantized uploads against gguf-py, and whole
tiny models against the CPU backend's float64 oracle."""

from __future__ import annotations

from typing import Any, ClassVar

import gguf
import numpy as np
import pytest

from leat.backend import Backend, KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.conformance.reference import reference
from leat.modelfile import Tensor

F32 = gguf.GGMLQuantizationType.F32


def cpu_oracle() -> type[Backend]:
    """The reference backend class (its "f64" precision is the oracle); fails the test, naming what to install,
    when leat[conformance] is not installed."""
    return reference("backends")


class BackendConformance:
    """Subclass and provide a ``backend`` fixture (an instance; parametrize it over the precisions you support).

    Override :meth:`to_device` when your ops do not take what ``backend.upload`` of an F32 tensor returns,
    ``tolerance`` to state your precision's bounds, ``model_qtypes`` to choose the tiny model files' storage types,
    and ``capabilities`` to say which optional checks apply: "windows" (windowed layers in page groups of their
    own), "softcap" and "sinks" (those options of :meth:`Backend.attention`), "q8_0_kv"
    (``allocate_kv(dtype="q8_0")``), "moe" (:meth:`Backend.moe`) and "recurrent" (:meth:`Backend.gated_delta_net`).
    """

    tolerance: ClassVar[dict[str, float]] = {"f16": 2e-3, "bf16": 2e-2, "f32": 5e-5, "f64": 1e-12}
    model_qtypes: ClassVar[tuple[str, ...]] = ("F32", "Q8_0")
    agreement_bars: ClassVar[dict[str, float]] = {"top1": 0.99, "kl": 1e-3}
    capabilities: ClassVar[frozenset[str]] = frozenset({"windows"})

    @pytest.fixture
    def backend(self) -> Backend:
        raise NotImplementedError("define a `backend` fixture returning an instance of your backend")

    # -- helpers a subclass may override --------------------------------------------------------------
    def to_device(self, backend: Backend, array: np.ndarray) -> Any:
        """An activation on the device: by default what ``backend.upload`` makes of an F32 tensor."""
        array = np.ascontiguousarray(array, dtype=np.float32)
        return backend.upload(Tensor("activation", F32, array.shape, array))

    def check(self, backend: Backend, got: Any, want: np.ndarray) -> None:
        tol = self.tolerance.get(backend.precision, 1e-4)
        host = np.asarray(backend.to_host(got), dtype=np.float64)
        np.testing.assert_allclose(host.reshape(want.shape), want, rtol=tol, atol=tol)

    def inputs(self, *shapes: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
        rng = np.random.default_rng(seed)
        return [rng.standard_normal(shape).astype(np.float32).astype(np.float64) for shape in shapes]

    # -- ops ------------------------------------------------------------------------------------------
    def test_argmax_and_top_k(self, backend):
        """Rows' argmax and top k as numpy's stable sort of -x: equal values by lower index, -inf rows and entries."""
        x = (np.random.default_rng(14).integers(-20, 20, (4, 1000)) / 4).astype(np.float32)  # many ties
        x[1] = -np.inf
        x[2, :995] = -np.inf  # five finite values: a top 8 takes three -inf ones
        device = backend.scale(self.to_device(backend, x), 1.0)  # logits: an op's output
        np.testing.assert_array_equal(np.asarray(backend.argmax(device)), np.argmax(x, axis=-1))
        for k in (1, 8, 64):
            values, ids = backend.top_k(device, k)
            order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
            np.testing.assert_array_equal(np.asarray(ids), order)
            np.testing.assert_array_equal(np.asarray(values, np.float64), np.take_along_axis(x, order, -1))

    def test_matmul_with_bias(self, backend):
        x, w, b = self.inputs((5, 64), (7, 64), (7,), seed=1)
        weight = backend.upload(Tensor("w", F32, w.shape, w.astype(np.float32)))
        got = backend.matmul(
            self.to_device(backend, x), weight, backend.upload(Tensor("b", F32, b.shape, b.astype(np.float32)))
        )
        self.check(backend, got, x @ w.T + b)

    def test_rms_norm(self, backend):
        x, w = self.inputs((4, 3, 32), (32,), seed=2)
        want = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-6) * w
        weight = backend.upload(Tensor("norm", F32, w.shape, w.astype(np.float32)))
        self.check(backend, backend.rms_norm(self.to_device(backend, x), weight, 1e-6), want)

    @pytest.mark.parametrize("neox", [False, True], ids=["normal", "neox"])
    def test_rope(self, backend, neox):
        (x,) = self.inputs((5, 2, 16), seed=3)
        positions = np.array([0, 1, 7, 100, 4000])
        dims = 16
        spec = RopeSpec(dims, 10000.0, neox, 1.0, None)
        want = x.copy()
        for i in range(dims // 2):
            angle = positions[:, None] * 10000.0 ** (-2 * i / dims)
            a, b = (i, i + dims // 2) if neox else (2 * i, 2 * i + 1)
            xa, xb = x[:, :, a], x[:, :, b]
            want[:, :, a] = xa * np.cos(angle) - xb * np.sin(angle)
            want[:, :, b] = xa * np.sin(angle) + xb * np.cos(angle)
        self.check(backend, backend.rope(self.to_device(backend, x), positions, spec), want)

    def test_attention_prefill_then_decode_two_sequences(self, backend):
        heads, kv_heads, dim, scale = 4, 2, 8, 0.3
        kv = backend.allocate_kv([KVLayout(kv_heads, dim)], slots=2, context=16)
        seqs = {s: self.inputs((9, heads, dim), (9, kv_heads, dim), (9, kv_heads, dim), seed=10 + s) for s in (0, 1)}
        steps = [[(0, 0, 6), (1, 0, 4)], [(1, 4, 1), (0, 6, 3)]]  # (slot, start, n): a prefill, then mixed
        for spans in steps:
            batch = Batch([Row(s, a, np.zeros(n, np.int64), all_logits=True) for s, a, n in spans])
            q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans]) for i in range(3))
            out = backend.to_host(
                backend.attention(*(self.to_device(backend, t) for t in (q, k, v)), kv, 0, batch, scale)
            )
            out = np.asarray(out, np.float64).reshape(len(q), heads * dim)
            offset = 0
            for s, a, n in spans:
                sq, sk, sv = seqs[s]
                want = _attention(sq[a : a + n], sk[: a + n], sv[: a + n], a, scale)
                tol = self.tolerance.get(backend.precision, 1e-4)
                np.testing.assert_allclose(out[offset : offset + n], want, rtol=tol, atol=tol)
                offset += n

    @pytest.mark.leat_needs("windows")
    def test_attention_through_page_groups(self, backend):
        """A full-attention layer and a windowed one in their own page groups; the windowed group has too few
        pages for the sequence, so pages behind the window go back (-1) and come again with stale contents.
        Then every group's pages are read, written to other ids of a fresh cache (a hibernated session's
        restore), and decoding goes on there."""
        heads, kv_heads, dim, scale, size, window = 4, 2, 8, 0.3, 4, 5
        layouts = [KVLayout(kv_heads, dim), KVLayout(kv_heads, dim, window=window)]
        steps = [(0, 6)] + [(p, 1) for p in range(6, 15)]  # (start, n): a prefill, then decoding

        def fresh():
            kv = backend.allocate_kv(layouts, slots=2, context=20, pages=[6, 4], page_size=size, groups=[0, 1])
            assert kv.pages == [6, 4] and kv.table(1) is kv.tables[1]
            return kv

        kv = fresh()
        q, k, v = self.inputs((16, heads, dim), (16, kv_heads, dim), (16, kv_heads, dim), seed=20)
        tables, free = [[], []], [list(range(6)), list(range(4))]

        def attend(kv, start, n):
            batch = Batch([Row(1, start, np.zeros(n, np.int64), all_logits=True)])
            span = slice(start, start + n)
            for layer, layout in enumerate(layouts):
                got = backend.attention(*(self.to_device(backend, t[span]) for t in (q, k, v)), kv, layer, batch, scale)
                want = _attention(q[span], k[: start + n], v[: start + n], start, scale, layout.window)
                tol = self.tolerance.get(backend.precision, 1e-4)
                np.testing.assert_allclose(
                    np.asarray(backend.to_host(got), np.float64).reshape(n, -1), want, rtol=tol, atol=tol
                )

        for start, n in steps:
            behind = max(0, start - window + 1) // size  # pages no query from `start` on reads
            for i in range(behind):
                if tables[1][i] >= 0:
                    free[1].append(tables[1][i])
                    tables[1][i] = -1
            for group in (0, 1):
                while len(tables[group]) * size < start + n:
                    tables[group].append(free[group].pop(0 if group == 0 else -1))
                backend.set_pages(kv, 1, np.array(tables[group]), group=group)
            attend(kv, start, n)
        assert -1 in tables[1], "the windowed group never gave a page back"
        restored = fresh()
        for group, ids in ((0, [5, 4, 3, 2]), (1, [3, 2, 1, 0])):
            held = [p for p in tables[group] if p >= 0]
            contents = backend.read_pages(kv, held, group=group)
            backend.write_pages(restored, ids[: len(held)], contents, group=group)
            moved = iter(ids)
            backend.set_pages(
                restored, 1, np.array([next(moved) if p >= 0 else -1 for p in tables[group]]), group=group
            )
        attend(restored, 15, 1)
        row = restored.tables[1][1, :4].copy()  # copy-on-write of the page at positions 12..15 into free page 0
        assert 0 not in row
        backend.copy_page(restored, int(row[3]), 0, group=1)
        row[3] = 0
        backend.set_pages(restored, 1, row, group=1)
        attend(restored, 15, 1)

    def attend(self, backend: Backend, kv: Any, inputs: Any, **options: Any) -> np.ndarray:
        """``backend.attention(q, k, v, kv, layer 0, batch, scale 0.3, **options)`` over ``inputs`` (q, k, v) of
        slot 0 in three steps (a prefill, one decode, a chunk), as host float64 [positions, heads * dim]."""
        q, k, v = inputs
        spans = [(0, 7), (7, 1), (8, len(q) - 8)]
        outs = []
        for start, n in spans:
            batch = Batch([Row(0, start, np.zeros(n, np.int64), all_logits=True)])
            span = slice(start, start + n)
            got = backend.attention(
                *(self.to_device(backend, t[span]) for t in (q, k, v)), kv, 0, batch, 0.3, **options
            )
            outs.append(np.asarray(backend.to_host(got), np.float64).reshape(n, -1))
        return np.concatenate(outs)

    def attention_inputs(self, positions: int = 11, heads: int = 4, kv_heads: int = 2, dim: int = 32) -> list:
        return self.inputs((positions, heads, dim), (positions, kv_heads, dim), (positions, kv_heads, dim), seed=30)

    @pytest.mark.leat_needs("softcap")
    def test_attention_softcap(self, backend):
        q, k, v = self.attention_inputs()
        kv = backend.allocate_kv([KVLayout(k.shape[1], k.shape[2])], slots=1, context=16)
        got = self.attend(backend, kv, (q, k, v), softcap=0.5)
        want = _attention(q, k, v, 0, 0.3, softcap=0.5)
        tol = self.tolerance.get(backend.precision, 1e-4)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

    @pytest.mark.leat_needs("sinks")
    def test_attention_sinks(self, backend):
        q, k, v = self.attention_inputs()
        kv = backend.allocate_kv([KVLayout(k.shape[1], k.shape[2])], slots=1, context=16)
        sinks = np.array([0.5, -1.0, 2.0, 0.0])
        device_sinks = backend.upload(Tensor("attn_sinks", F32, sinks.shape, sinks.astype(np.float32)))
        got = self.attend(backend, kv, (q, k, v), sinks=device_sinks)
        want = _attention(q, k, v, 0, 0.3, sinks=sinks)
        tol = self.tolerance.get(backend.precision, 1e-4)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

    @pytest.mark.leat_needs("softcap")
    @pytest.mark.leat_needs("sinks")
    def test_attention_softcap_with_sinks(self, backend):
        """Both options of one call: scores capped, then the sinks join the capped scores' softmax."""
        q, k, v = self.attention_inputs()
        kv = backend.allocate_kv([KVLayout(k.shape[1], k.shape[2])], slots=1, context=16)
        sinks = np.array([0.5, -1.0, 2.0, 0.0])
        device_sinks = backend.upload(Tensor("attn_sinks", F32, sinks.shape, sinks.astype(np.float32)))
        got = self.attend(backend, kv, (q, k, v), softcap=0.5, sinks=device_sinks)
        want = _attention(q, k, v, 0, 0.3, softcap=0.5, sinks=sinks)
        tol = self.tolerance.get(backend.precision, 1e-4)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

    @pytest.mark.leat_needs("q8_0_kv")
    def test_q8_0_kv_cache(self, backend):
        """Keys and values stored as Q8_0 blocks along the head dimension: attention over gguf-py's Q8_0 round trip
        of the same keys and values."""
        q, k, v = self.attention_inputs()
        kv = backend.allocate_kv([KVLayout(k.shape[1], k.shape[2])], slots=1, context=16, dtype="q8_0")
        got = self.attend(backend, kv, (q, k, v))
        q8 = gguf.GGMLQuantizationType.Q8_0

        def round_trip(x: np.ndarray) -> np.ndarray:
            stored = gguf.quants.quantize(x.astype(np.float32).reshape(-1, x.shape[-1]), q8)
            return gguf.quants.dequantize(stored, q8).reshape(x.shape).astype(np.float64)

        want = _attention(q, round_trip(k), round_trip(v), 0, 0.3)
        tol = max(self.tolerance.get(backend.precision, 1e-4), 1e-5)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

    @pytest.mark.leat_needs("moe")
    @pytest.mark.parametrize("gating, activation", [("softmax", "silu"), ("softmax_selected", "swiglu_oai")])
    def test_moe(self, backend, gating, activation):
        """Routing, the selected experts' gated MLPs and their weighted sum, against a float64 reference written
        from :meth:`Backend.moe`'s contract."""
        from leat.moe import MoESpec, MoEWeights

        n, d, ffn, experts, used = 5, 16, 8, 6, 2
        spec = MoESpec(experts, used, gating=gating, normalize=gating == "softmax", activation=activation)
        x, router, gate, up, down = self.inputs(
            (n, d), (experts, d), (experts, ffn, d), (experts, ffn, d), (experts, d, ffn), seed=40
        )
        up_bias, down_bias = self.inputs((experts, ffn), (experts, d), seed=41)

        def weight(name: str, array: np.ndarray) -> Any:
            return backend.upload(Tensor(name, F32, array.shape, array.astype(np.float32)))

        weights = MoEWeights(weight("router", router), weight("gate", gate), weight("up", up), weight("down", down))
        weights.up_bias, weights.down_bias = weight("up_bias", up_bias), weight("down_bias", down_bias)
        got = np.asarray(backend.to_host(backend.moe(self.to_device(backend, x), weights, spec)), np.float64)
        want = np.zeros((n, d))
        for t in range(n):
            logits = router @ x[t]
            top = sorted(range(experts), key=lambda e: (-logits[e], e))[:used]
            if gating == "softmax":
                p = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
                w = p[top] / p[top].sum()
            else:
                w = np.exp(logits[top] - logits[top].max()) / np.exp(logits[top] - logits[top].max()).sum()
            for e, we in zip(top, w, strict=True):
                g, u = gate[e] @ x[t], up[e] @ x[t] + up_bias[e]
                if activation == "silu":
                    h = g / (1 + np.exp(-g)) * u
                else:
                    g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
                    h = g / (1 + np.exp(-1.702 * g)) * (u + 1)
                want[t] += we * (down[e] @ h + down_bias[e])
        tol = self.tolerance.get(backend.precision, 1e-4)
        np.testing.assert_allclose(got.reshape(n, d), want, rtol=tol, atol=tol * 10)

    @pytest.mark.leat_needs("recurrent")
    def test_gated_delta_net_two_sequences_in_steps(self, backend):
        """Prefills of 5 and 3 tokens in slots 0 and 1 of one batch, then a decode step of each: every output as
        :func:`leat.deltanet.run` gives for the sequence whole (its state continues in its own slot)."""
        from leat.deltanet import DeltaNet, run

        conv, dt_bias, a_log, mixed, alpha, beta = self.inputs((64, 4), (4,), (4,), (10, 64), (10, 4), (10, 4), seed=7)
        net = DeltaNet(2, 4, 8, conv * 0.5, dt_bias, -np.exp(a_log), 1e-6)
        spans = {0: slice(0, 6), 1: slice(6, 10)}
        want = {
            s: run(net, mixed[r], alpha[r], beta[r], np.zeros((3, 64)), np.zeros((4, 8, 8))) for s, r in spans.items()
        }
        kv = backend.allocate_kv([KVLayout(1, 8)], slots=2, context=16)
        for rows in [[(0, 0, 5), (1, 0, 3)], [(1, 3, 1), (0, 5, 1)]]:
            picks = np.concatenate([np.arange(spans[s].start + p, spans[s].start + p + n) for s, p, n in rows])
            batch = Batch([Row(s, p, np.zeros(n, np.int64)) for s, p, n in rows])
            device = [self.to_device(backend, x[picks]) for x in (mixed, alpha, beta)]
            got = backend.gated_delta_net(*device, net, kv, 0, batch)
            self.check(backend, got, np.concatenate([want[s][p : p + n] for s, p, n in rows]))

    def test_silu_mul_and_add(self, backend):
        x, y = np.linspace(-30, 30, 64), np.linspace(2, -3, 64)
        xd, yd = self.to_device(backend, x), self.to_device(backend, y)
        x, y = x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)
        self.check(backend, backend.silu_mul(xd, yd), x / (1 + np.exp(-x)) * y)
        self.check(backend, backend.add(xd, yd), x + y)

    def test_embed(self, backend):
        (table,) = self.inputs((10, 32), seed=4)
        weight = backend.upload(Tensor("token_embd.weight", F32, table.shape, table.astype(np.float32)))
        self.check(backend, backend.embed(weight, np.array([4, 0, 9, 4])), table[[4, 0, 9, 4]])

    # -- quantized weights ------------------------------------------------------------------------------
    def test_quant_upload_equals_gguf_dequantize(self, backend):
        """Each of the backend's ``quant_types``, uploaded and multiplied by the identity, gives gguf-py's values."""
        checked = []
        for qtype in sorted(type(backend).quant_types, key=int):
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            rows, cols = 4, max(256, block)
            rng = np.random.default_rng(int(qtype))
            try:
                data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
            except NotImplementedError:
                data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
            stored = data if data.dtype == np.uint8 else data.view(np.uint8).reshape(rows, -1)
            try:
                with np.errstate(all="ignore"):  # random bytes may encode inf/nan scales
                    expected = gguf.quants.dequantize(stored, qtype).reshape(rows, cols).astype(np.float64)
            except NotImplementedError:
                continue
            if not np.all(np.isfinite(expected)):  # random bytes may encode inf/nan scales
                continue
            weight = backend.upload(Tensor("w", qtype, (rows, cols), stored))
            got = backend.to_host(backend.matmul(self.to_device(backend, np.eye(cols)), weight))
            got = np.asarray(got, np.float64).reshape(cols, rows).T
            tol = self.tolerance.get(backend.precision, 1e-4)
            scale = np.abs(expected).max() or 1.0
            np.testing.assert_allclose(got, expected, rtol=tol, atol=tol * scale, err_msg=qtype.name)
            checked.append(qtype.name)
        assert checked or not type(backend).quant_types, "no quant type could be checked"

    # -- whole models -------------------------------------------------------------------------------------
    def test_tiny_llama_agrees_with_the_float64_oracle(self, backend, qtype, tmp_path):
        """A tiny random model of the reference architecture (leat[conformance]'s), stored as each of
        ``model_qtypes``: this backend's logits against the reference backend's float64 ones (top-1, mean KL).
        (The name is older than the reference's declaration; tests call it by name.)"""
        from leat.compare import compare
        from leat.testing import write_tiny_gguf

        arch = reference("architectures")
        kind = gguf.GGMLQuantizationType[qtype]
        if kind != F32 and kind not in type(backend).quant_types:
            pytest.fail(f"{type(backend).__name__} does not take {qtype}: leave it out of model_qtypes", pytrace=False)
        path = write_tiny_gguf(arch, tmp_path / f"tiny-{qtype}.gguf", kind)
        tokens = np.random.default_rng(0).integers(0, arch.tiny().vocab, 48)
        reference_logits = _logits(arch, path, cpu_oracle()("f64"), tokens)
        other = _logits(arch, path, backend, tokens)
        agreement = compare(reference_logits, other, label=f"{backend.name} {backend.precision} vs cpu f64 on {qtype}")
        failures = agreement.failures(top1=self.agreement_bars["top1"], kl=self.agreement_bars["kl"])
        assert not failures, f"{agreement}: {'; '.join(failures)}"


def _attention(q, k, v, start, scale, window=None, softcap=None, sinks=None):
    """Causal attention of queries at ``start``.. over keys 0..: GQA, a sliding ``window``, scores soft-capped, and
    a per-head ``sinks`` logit in each softmax's denominator, as :meth:`Backend.attention` says."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    out = np.zeros((n, heads, v.shape[2]))
    for t in range(n):
        first = 0 if window is None else max(0, start + t - window + 1)
        for h in range(heads):
            scores = k[first : start + t + 1, h // group] @ q[t, h] * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            top = scores.max() if sinks is None else max(scores.max(), sinks[h])
            p = np.exp(scores - top)
            total = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[t, h] = (p / total) @ v[first : start + t + 1, h // group]
    return out.reshape(n, -1)


def _logits(arch_cls, path, backend: Backend, tokens: np.ndarray) -> np.ndarray:
    from leat.model import Model
    from leat.modelfile import ModelFile

    file = ModelFile(path)
    return Model(file, arch_cls(file, backend), backend).logits(tokens, native=True).astype(np.float64)
