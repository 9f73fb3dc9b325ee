"""Images against llama.cpp's mtmd on a plugin's tiny files: subclass :class:`LlamaCppVision` in the plugin's tests,
point it at the references and state the bars.

The references folder holds ``tiny_vision.py`` (its ``build(out)`` writes the tiny model, mmproj and image and returns
their paths, SHA-256s and the prompt) and what ``scripts/record_llamacpp_vision.py FOLDER`` recorded from them:
``llamacpp_vision.npz`` (the prompt's ids, -1 at the image's positions; the image embeddings; the logits) and its
manifest ``llamacpp_vision.json``. The files are rebuilt and must hash as they did when recorded.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from leat.compare import compare
from leat.model import load
from leat.testing import encode_png
from leat.vision import image


class LlamaCppVision:
    """The float64 oracle's prompt ids, image embeddings (within ``embedding_error`` of the largest entry) and logits
    after the image (top-1 >= 99% where llama.cpp's top two are ``min_gap`` apart, mean KL < 1e-3) against
    llama.cpp's; and another image's logits far from them, so the agreement depends on the image."""

    references: ClassVar[Path]
    embedding_error: ClassVar[float] = 1e-3
    min_gap: ClassVar[float] = 1e-3

    @pytest.fixture
    def recorded(self) -> dict[str, np.ndarray]:
        return dict(np.load(self.references / "llamacpp_vision.npz"))

    @pytest.fixture
    def files(self) -> dict[str, Any]:
        return _files(self.references)

    @pytest.fixture
    def oracle(self) -> tuple[Any, list[int], list[Any]]:
        return _oracle(self.references)

    def test_the_prompt_places_the_image_as_llamacpp_does(self, oracle, recorded):
        _, ids, spans = oracle
        tokens = recorded["tokens"]
        positions = np.flatnonzero(tokens < 0)
        assert len(spans) == 1 and spans[0].start == positions[0] and spans[0].length == len(positions)
        text = tokens >= 0
        assert np.array_equal(np.asarray(ids)[text], tokens[text]) and len(ids) == len(tokens)

    def test_image_embeddings_match_llamacpp(self, oracle, recorded):
        model, _, spans = oracle
        got = model.backend.to_host(model.vision.embeddings(spans[0]))
        want = recorded["embeddings"].astype(np.float64)
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < self.embedding_error, f"max |leat - llama.cpp| is {error:.3g} of the largest embedding entry"

    def test_logits_after_the_image_match_llamacpp(self, oracle, recorded):
        model, ids, spans = oracle
        logits = model.logits(ids, images=spans, native=True)
        after = np.arange(spans[0].start + spans[0].length, len(ids))
        agreement = compare(recorded["logits"][after], logits[after], min_gap=self.min_gap, label="after the image")
        assert agreement.counted >= 0.6 * len(after), str(agreement)
        assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)

    def test_another_image_changes_the_logits(self, oracle, files, recorded):
        model, ids, spans = oracle
        shape = image.decode(Path(files["image"]).read_bytes()).shape
        other = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        other_ids, other_spans = model.image_prompt(files["prompt"], [encode_png(other)])
        assert other_ids == ids and other_spans[0].digest != spans[0].digest
        changed = model.logits(other_ids, images=other_spans, native=True)[-1]
        assert np.abs(changed - recorded["logits"][-1]).max() > 1e-2


@functools.cache
def _files(references: Path) -> dict[str, Any]:
    """The rebuilt files, in a folder removed when the session ends (the folder is kept in the result)."""
    spec = importlib.util.spec_from_file_location("tiny_vision", references / "tiny_vision.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = tempfile.TemporaryDirectory(prefix="leat-vision-")
    info = module.build(Path(folder.name)) | {"folder": folder}
    if info["sha256"] != json.loads((references / "llamacpp_vision.json").read_text())["sha256"]:
        pytest.fail(
            "the rebuilt tiny files differ from those llama.cpp was recorded on: re-record with "
            f"scripts/record_llamacpp_vision.py {references} (see its docstring) and commit the new references"
        )
    return info


@functools.cache
def _oracle(references: Path) -> tuple[Any, list[int], list[Any]]:
    files = _files(references)
    model = load(files["model"], backend="cpu", precision="f64", pull=False)
    model.load_mmproj(files["mmproj"])
    ids, spans = model.image_prompt(files["prompt"], [Path(files["image"]).read_bytes()])
    return model, ids, spans
