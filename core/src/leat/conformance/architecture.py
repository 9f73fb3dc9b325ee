"""Checks every architecture passes, on tiny random-weight files written from its own ``tiny()`` and
``tensor_shapes()``: the file loads with every tensor consumed, chunked and batched forwards equal the whole one,
and float32 follows the float64 oracle."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from leat.architecture import Architecture
from leat.batch import Batch, Row
from leat.conformance.backend import cpu_oracle


class ArchitectureConformance:
    """Subclass and provide an ``architecture`` fixture returning your Architecture class.

    The checks run on the kit's reference backend (leat[conformance]), in float64 unless said otherwise; ``tokens``
    sets how many positions are compared, ``qtypes`` which storage types the tiny files are written in.
    ``capabilities`` selects optional checks: "embeddings" (the family implements :meth:`Architecture.hidden`).
    ``variants`` names overrides of ``tiny()`` (the family's other shapes) that the metadata round trip and the
    chunked-and-batched check also run on.
    """

    tokens: ClassVar[int] = 40
    qtypes: ClassVar[tuple[str, ...]] = ("F32", "Q8_0")
    capabilities: ClassVar[frozenset[str]] = frozenset()
    variants: ClassVar[dict[str, dict[str, Any]]] = {}

    @pytest.fixture
    def architecture(self) -> type[Architecture]:
        raise NotImplementedError("define an `architecture` fixture returning your Architecture class")

    @pytest.fixture
    def tiny_file(self, architecture, tmp_path):
        import gguf

        from leat.testing import write_tiny_gguf

        return write_tiny_gguf(architecture, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.F32)

    def load(self, architecture: type[Architecture], path, precision: str = "f64") -> Any:
        from leat.model import Model
        from leat.modelfile import ModelFile

        backend = cpu_oracle()(precision)
        file = ModelFile(path)
        return Model(file, architecture(file, backend), backend)

    def ids(self, architecture: type[Architecture], n: int, seed: int = 0) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, architecture.tiny().vocab, n)

    def test_declares_names_and_tiny(self, architecture):
        assert architecture.names and all(isinstance(n, str) for n in architecture.names)
        params = architecture.tiny()
        shapes = architecture.tensor_shapes(params)
        assert shapes and all(all(d > 0 for d in shape) for shape in shapes.values())
        assert architecture.kv_layouts(params), "kv_layouts() must describe at least one layer"

    def test_tiny_file_writes_and_loads(self, architecture, qtype, tmp_path):
        """For each of ``qtypes``."""
        import gguf

        from leat.modelfile import ModelFile
        from leat.testing import write_tiny_gguf

        path = write_tiny_gguf(architecture, tmp_path / f"tiny-{qtype}.gguf", gguf.GGMLQuantizationType[qtype])
        file = ModelFile(path)
        assert file.architecture in architecture.names
        model = self.load(architecture, path)  # Architecture.__init__ fails on any tensor it did not consume
        assert model.architecture.vocab_size == architecture.tiny().vocab
        logits = model.logits(self.ids(architecture, 8))
        assert logits.shape == (8, model.architecture.vocab_size) and np.all(np.isfinite(logits))

    def test_chunked_forward_equals_whole(self, architecture, tiny_file):
        model = self.load(architecture, tiny_file)
        ids = self.ids(architecture, self.tokens)
        whole = model.logits(ids, native=True)
        kv = model.new_kv(len(ids))
        parts, start = [], 0
        for size in (1, 7, 3, len(ids)):  # uneven chunks, the last one the rest
            chunk = ids[start : start + size]
            if len(chunk) == 0:
                break
            out = model.architecture.forward(Batch([Row(0, start, chunk, all_logits=True)]), kv)
            parts.append(model.backend.to_host(out))
            start += len(chunk)
        np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-9, atol=1e-9)

    def test_batched_forward_equals_single(self, architecture, tiny_file):
        model = self.load(architecture, tiny_file)
        a, b = self.ids(architecture, 12, seed=1), self.ids(architecture, 9, seed=2)
        alone = [model.logits(a, native=True), model.logits(b, native=True)]
        kv = model.new_kv(16, slots=2)
        # two prefills in one batch, then the two decode steps of the last tokens together
        out = model.backend.to_host(
            model.architecture.forward(
                Batch([Row(0, 0, a[:-1], all_logits=True), Row(1, 0, b[:-1], all_logits=True)]), kv
            )
        )
        np.testing.assert_allclose(out[: len(a) - 1], alone[0][:-1], rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(out[len(a) - 1 :], alone[1][:-1], rtol=1e-9, atol=1e-9)
        step = model.backend.to_host(
            model.architecture.forward(Batch([Row(1, len(b) - 1, b[-1:]), Row(0, len(a) - 1, a[-1:])]), kv)
        )
        np.testing.assert_allclose(step, np.stack([alone[1][-1], alone[0][-1]]), rtol=1e-9, atol=1e-9)

    def test_metadata_round_trips(self, architecture, variant, tmp_path):
        assert_metadata_round_trips(architecture, architecture.tiny(**self.variants[variant]), tmp_path)

    def test_chunked_and_batched_equal_whole(self, architecture, variant, tmp_path):
        from leat.modelfile import ModelFile
        from leat.testing import write_tiny_gguf

        params = architecture.tiny(**self.variants[variant])
        backend = cpu_oracle()("f64")
        model = architecture(ModelFile(write_tiny_gguf(architecture, tmp_path / "tiny.gguf", params=params)), backend)
        assert_chunked_and_batched_equal_whole(model, backend, params.vocab)

    @pytest.mark.leat_needs("embeddings")
    def test_forward_is_the_hidden_state_times_the_output(self, architecture, tiny_file):
        """The hidden states are the rows the logits are made of: over more positions than the model is wide, one
        affine map (the output matrix and any bias) from them gives every position's logits, and an embedding is a
        unit vector."""
        model = self.load(architecture, tiny_file)
        width = model.hidden(self.ids(architecture, 1)).shape[1]
        ids = self.ids(architecture, 2 * width + 8)
        assert len(ids) <= architecture.tiny().context, "tiny()'s context must hold 2 * width + 8 positions"
        states, logits = model.hidden(ids), model.logits(ids, native=True)
        rows = np.hstack([states, np.ones((len(ids), 1))])
        output, *_ = np.linalg.lstsq(rows, logits, rcond=None)
        np.testing.assert_allclose(rows @ output, logits, rtol=0, atol=1e-8 * np.abs(logits).max())
        assert abs(np.linalg.norm(model.embed(ids)) - 1.0) < 1e-6

    def test_f32_follows_the_float64_oracle(self, architecture, tiny_file):
        from leat.compare import compare

        ids = self.ids(architecture, self.tokens)
        reference = self.load(architecture, tiny_file, "f64").logits(ids, native=True)
        other = self.load(architecture, tiny_file, "f32").logits(ids)
        agreement = compare(reference, other, label="cpu f32 vs f64")
        failures = agreement.failures(top1=0.99, kl=1e-3)
        assert not failures, f"{agreement}: {'; '.join(failures)}"


def assert_chunked_and_batched_equal_whole(model: Any, backend: Any, vocab: int = 300, atol: float = 1e-10) -> None:
    """Sequence a prefilled in chunks of 7, 7 and 6 while sequence b prefills 8 tokens and then decodes token by
    token, in the same batches and different KV slots: every logit equals that of the sequence run whole and alone.

    ``model`` is an Architecture instance on ``backend`` (the float64 oracle gives equality to ``atol``).
    """

    def run(rows, kv=None):
        kv = kv or backend.allocate_kv(model.kv_layouts(model.params), 3, 64, page_size=8)
        return backend.to_host(model.forward(Batch(rows), kv)), kv

    rng = np.random.default_rng(0)
    a, b = rng.integers(0, vocab, 20), rng.integers(0, vocab, 11)
    whole_a, _ = run([Row(0, 0, a, all_logits=True)])
    whole_b, _ = run([Row(0, 0, b, all_logits=True)])
    first, kv = run([Row(2, 0, a[:7], all_logits=True), Row(1, 0, b[:8], all_logits=True)])
    np.testing.assert_allclose(first, np.concatenate([whole_a[:7], whole_b[:8]]), atol=atol)
    second, kv = run([Row(1, 8, b[8:9]), Row(2, 7, a[7:14], all_logits=True)], kv=kv)
    np.testing.assert_allclose(second, np.concatenate([whole_b[8:9], whole_a[7:14]]), atol=atol)
    third, _ = run([Row(2, 14, a[14:]), Row(1, 9, b[9:11])], kv=kv)
    np.testing.assert_allclose(third, np.stack([whole_a[-1], whole_b[-1]]), atol=atol)


def assert_metadata_round_trips(architecture: Any, params: Any, tmp_path: Any, floats: tuple[str, ...] = ("norm_eps",)):
    """A tiny file written from ``params`` reads back as ``params``; ``floats`` are stored as float32, so approximately."""
    import dataclasses

    from leat.modelfile import ModelFile
    from leat.testing import write_tiny_gguf

    read = architecture.read_params(
        ModelFile(write_tiny_gguf(architecture, tmp_path / "round-trip.gguf", params=params))
    )
    for name in floats:
        assert getattr(read, name) == pytest.approx(getattr(params, name)), name
    assert dataclasses.replace(read, **{name: getattr(params, name) for name in floats}) == params
