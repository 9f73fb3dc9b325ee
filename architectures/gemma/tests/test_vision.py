"""Images through a tiny Gemma-3-style mmproj on a tiny Gemma 3 model, against llama.cpp's mtmd (recorded by
scripts/record_llamacpp_vision.py): the image embeddings, the prompt's ids around the image, and the logits of
the text after it, from leat's float64 oracle."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from leat.compare import compare
from leat.model import load
from leat.testing import encode_png

REFERENCES = Path(__file__).parent / "references"
RERECORD = "re-record with scripts/record_llamacpp_vision.py (see its docstring) and commit the new references"


def _tiny_vision():
    spec = importlib.util.spec_from_file_location("tiny_vision", REFERENCES / "tiny_vision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded() -> dict[str, np.ndarray]:
    return dict(np.load(REFERENCES / "llamacpp_vision.npz"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    info = _tiny_vision().build(tmp_path_factory.mktemp("vision"))
    manifest = json.loads((REFERENCES / "llamacpp_vision.json").read_text())
    if info["sha256"] != manifest["sha256"]:
        pytest.fail(f"the rebuilt tiny files differ from those llama.cpp was recorded on: {RERECORD}")
    return info


@pytest.fixture(scope="module")
def oracle(files: dict):
    model = load(files["model"], backend="cpu", precision="f64", pull=False)
    model.load_mmproj(files["mmproj"])
    ids, spans = model.image_prompt(files["prompt"], [Path(files["image"]).read_bytes()])
    return model, ids, spans


def test_the_prompt_places_the_image_as_llamacpp_does(oracle, recorded):
    _, ids, spans = oracle
    tokens = recorded["tokens"]
    image = np.flatnonzero(tokens < 0)
    assert len(spans) == 1 and spans[0].start == image[0] and spans[0].length == len(image)
    text = tokens >= 0
    assert np.array_equal(np.asarray(ids)[text], tokens[text]) and len(ids) == len(tokens)


def test_image_embeddings_match_llamacpp(oracle, recorded):
    model, _, spans = oracle
    got = model.backend.to_host(model.vision.embeddings(spans[0]))
    want = recorded["embeddings"].astype(np.float64)
    # llama.cpp computes the encoder in float32 (attention without flash, so not over f16 K and V); measured
    # 2.8e-4 of the largest entry when recorded (where in ggml that rounding comes from is not established)
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error < 1e-3, f"max |leat - llama.cpp| is {error:.3g} of the largest embedding entry"


def test_logits_after_the_image_match_llamacpp(oracle, recorded):
    model, ids, spans = oracle
    logits = model.logits(ids, images=spans, native=True)
    after = np.arange(spans[0].start + spans[0].length, len(ids))
    agreement = compare(recorded["logits"][after], logits[after], label="text after the image")
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def test_another_image_changes_the_logits(oracle, files, recorded):
    """The agreement above depends on the image: another image's logits are far from llama.cpp's."""
    model, ids, spans = oracle
    other = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    other_ids, other_spans = model.image_prompt(files["prompt"], [encode_png(other)])
    assert other_ids == ids and other_spans[0].digest != spans[0].digest
    changed = model.logits(other_ids, images=other_spans, native=True)[-1]
    assert np.abs(changed - recorded["logits"][-1]).max() > 1e-2
