"""Images through a tiny ``gemma4v`` mmproj on a tiny Gemma 4 model, against llama.cpp's mtmd (recorded by
``scripts/record_llamacpp_vision.py architectures/gemma4/tests/references``): the prompt's ids around the image, the
image embeddings, and the logits of the text after it, from leat's float64 oracle.

The image (100 x 110 pixels) is resized as llama.cpp's ``dyn_size`` preprocessor does (bicubic, letterboxed into
96 x 108: 72 image tokens); the mmproj has clamped products, ``std_bias``/``std_scale`` and 2-D RoPE; the model's
sliding window (8) is shorter than the image, whose row attends bidirectionally in the sliding layers only.

Measured when recorded (llama-cpp-python 0.3.36): the embeddings are 3.1e-3 of the largest entry from llama.cpp's,
and 5.5e-4 once the patch product's operands are rounded to f16 as ggml's ``conv_2d`` does (its im2col is F16); the
rest is ggml's GELU, read from a table indexed by the input rounded to f16. The logits after the image: top-1 100% where
llama.cpp's top two are 0.1 apart or more (29 of 41 positions; Gemma 4's text references count top-1 at that gap
too: test_llamacpp_agreement.py), mean KL 6.9e-4.
"""

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
RERECORD = "re-record with scripts/record_llamacpp_vision.py architectures/gemma4/tests/references (see its docstring)"
MIN_GAP = 0.1


def _tiny_vision():
    spec = importlib.util.spec_from_file_location("tiny_vision_gemma4", REFERENCES / "tiny_vision.py")
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
    assert len(spans) == 1 and spans[0].start == image[0] and spans[0].length == len(image) == 72
    text = tokens >= 0
    assert np.array_equal(np.asarray(ids)[text], tokens[text]) and len(ids) == len(tokens)


def test_image_embeddings_match_llamacpp(oracle, recorded):
    model, _, spans = oracle
    want = recorded["embeddings"].astype(np.float64)
    got = model.backend.to_host(model.vision.embeddings(spans[0]))
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error < 5e-3, f"max |leat - llama.cpp| is {error:.3g} of the largest embedding entry"
    # as ggml's conv_2d computes the patches: pixels and kernel rounded to f16, sums in float32
    encoder, B = model.vision.encoder, model.backend
    exact_kernel = encoder.patch_kernel
    try:
        encoder.patch_kernel = B.from_host(B.to_host(exact_kernel).astype(np.float16))
        rounded = B.to_host(encoder.encode(spans[0].pixels.astype(np.float16).astype(np.float32)))
    finally:
        encoder.patch_kernel = exact_kernel
    error = np.abs(rounded - want).max() / np.abs(want).max()
    assert error < 1e-3, f"with ggml's f16 patches, max |leat - llama.cpp| is {error:.3g} of the largest entry"


def test_logits_after_the_image_match_llamacpp(oracle, recorded):
    model, ids, spans = oracle
    logits = model.logits(ids, images=spans, native=True)
    after = np.arange(spans[0].start + spans[0].length, len(ids))
    agreement = compare(recorded["logits"][after], logits[after], min_gap=MIN_GAP, label="text after the image")
    assert agreement.counted >= 0.6 * len(after), agreement
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def test_the_full_layers_see_the_image_causally(oracle, recorded):
    """The image's row attends bidirectionally only in the sliding layers: bidirectional everywhere is far off."""
    model, ids, spans = oracle
    arch = model.architecture
    try:
        arch.causal = lambda batch: batch
        everywhere = model.logits(ids, images=spans, native=True)
    finally:
        del arch.causal
    after = np.arange(spans[0].start + spans[0].length, len(ids))
    agreement = compare(recorded["logits"][after], everywhere[after], min_gap=MIN_GAP, label="bidirectional")
    assert agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def test_another_image_changes_the_logits(oracle, files, recorded):
    """The agreement above depends on the image: another image's logits are far from llama.cpp's."""
    model, ids, spans = oracle
    other = np.random.default_rng(0).integers(0, 256, (110, 100, 3), dtype=np.uint8)
    other_ids, other_spans = model.image_prompt(files["prompt"], [encode_png(other)])
    assert other_ids == ids and other_spans[0].digest != spans[0].digest
    changed = model.logits(other_ids, images=other_spans, native=True)[-1]
    assert np.abs(changed - recorded["logits"][-1]).max() > 1e-2


def test_an_images_tokens_follow_its_size(oracle):
    """llama.cpp's dyn_size: sides rounded to multiples of patch * merge (12), then scaled into 70..1120 tokens."""
    encoder = oracle[0].vision.encoder
    assert encoder.size(100, 110) == (96, 108)  # 72 tokens: kept
    # 2 x 3 tokens, too few: times sqrt(10080 / 600) = 4.099, each side rounded up: 7 x 11
    assert encoder.size(20, 30) == (84, 132)
    # 83 x 167 tokens, too many: divided by sqrt(2e6 / 161280) = 3.521, each side rounded down: 23 x 47
    assert encoder.size(1000, 2000) == (276, 564)
    pixels = encoder.preprocess(np.zeros((30, 20, 3), np.uint8))
    assert pixels.shape == (3, 132, 84) and encoder.tokens_of(pixels) == 77


def test_float32_matches_the_oracle(files, oracle):
    """The CPU backend's float32 path (encoder and model) against the float64 oracle: the design's bars."""
    model, ids, spans = oracle
    fast = load(files["model"], backend="cpu", precision="f32", pull=False)
    fast.load_mmproj(files["mmproj"])
    want = model.backend.to_host(model.vision.embeddings(spans[0]))
    got = fast.backend.to_host(fast.vision.embeddings(spans[0])).astype(np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    agreement = compare(model.logits(ids, images=spans, native=True), fast.logits(ids, images=spans), label="f32")
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def test_the_engine_generates_after_the_image_as_the_logits_say(oracle, files):
    """Model.generate runs the image's row through the engine: each greedy token is the oracle's argmax."""
    model, ids, spans = oracle
    image = Path(files["image"]).read_bytes()
    tokens = [t.id for t in model.generate(files["prompt"], 4, {"temperature": 0.0}, images=[image]) if t.id >= 0]
    assert tokens
    for i, token in enumerate(tokens):
        assert token == int(np.argmax(model.logits(ids + tokens[:i], images=spans, native=True)[-1]))
