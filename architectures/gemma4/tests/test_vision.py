"""Images through a tiny ``gemma4v`` mmproj on a tiny Gemma 4 model, against llama.cpp's mtmd (recorded by
``scripts/record_llamacpp_vision.py architectures/gemma4/tests/references``): the prompt's ids around the image, the
image embeddings, and the logits of the text after it, from leat's float64 oracle
(:class:`leat.conformance.vision.LlamaCppVision`); what is Gemma 4's own besides.

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

from pathlib import Path

import numpy as np
from leat.compare import compare
from leat.conformance.vision import LlamaCppVision
from leat.model import load


class TestVision(LlamaCppVision):
    references = Path(__file__).parent / "references"
    embedding_error = 5e-3
    min_gap = 0.1

    def test_the_image_takes_72_positions(self, oracle):
        assert oracle[2][0].length == 72

    def test_image_embeddings_with_ggmls_f16_patches_match_llamacpp(self, oracle, recorded):
        """As ggml's conv_2d computes the patches: pixels and kernel rounded to f16, sums in float32."""
        model, _, spans = oracle
        encoder, B = model.vision.encoder, model.backend
        want, exact_kernel = recorded["embeddings"].astype(np.float64), encoder.patch_kernel
        try:
            encoder.patch_kernel = B.from_host(B.to_host(exact_kernel).astype(np.float16))
            rounded = B.to_host(encoder.encode(spans[0].pixels.astype(np.float16).astype(np.float32)))
        finally:
            encoder.patch_kernel = exact_kernel
        error = np.abs(rounded - want).max() / np.abs(want).max()
        assert error < 1e-3, f"with ggml's f16 patches, max |leat - llama.cpp| is {error:.3g} of the largest entry"

    def test_the_full_layers_see_the_image_causally(self, oracle, recorded):
        """The image's row attends bidirectionally only in the sliding layers: bidirectional everywhere is far off."""
        assert failures(oracle, recorded, self.min_gap, causal=lambda batch: batch)

    def test_an_images_tokens_follow_its_size(self, oracle):
        """llama.cpp's dyn_size: sides rounded to multiples of patch * merge (12), then scaled into 70..1120 tokens."""
        encoder = oracle[0].vision.encoder
        assert encoder.size(100, 110) == (96, 108)  # 72 tokens: kept
        # 2 x 3 tokens, too few: times sqrt(10080 / 600) = 4.099, each side rounded up: 7 x 11
        assert encoder.size(20, 30) == (84, 132)
        # 83 x 167 tokens, too many: divided by sqrt(2e6 / 161280) = 3.521, each side rounded down: 23 x 47
        assert encoder.size(1000, 2000) == (276, 564)
        pixels = encoder.preprocess(np.zeros((30, 20, 3), np.uint8))
        assert pixels.shape == (3, 132, 84) and encoder.tokens_of(pixels) == 77

    def test_float32_matches_the_oracle(self, files, oracle):
        """The CPU backend's float32 path (encoder and model) against the float64 oracle: the design's bars."""
        model, ids, spans = oracle
        fast = load(files["model"], backend="cpu", precision="f32", pull=False)
        fast.load_mmproj(files["mmproj"])
        want = model.backend.to_host(model.vision.embeddings(spans[0]))
        got = fast.backend.to_host(fast.vision.embeddings(spans[0])).astype(np.float64)
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
        agreement = compare(model.logits(ids, images=spans, native=True), fast.logits(ids, images=spans), label="f32")
        assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)

    def test_the_engine_generates_after_the_image_as_the_logits_say(self, oracle, files):
        """Model.generate runs the image's row through the engine: each greedy token is the oracle's argmax."""
        model, ids, spans = oracle
        image = Path(files["image"]).read_bytes()
        tokens = [t.id for t in model.generate(files["prompt"], 4, {"temperature": 0.0}, images=[image]) if t.id >= 0]
        assert tokens
        for i, token in enumerate(tokens):
            assert token == int(np.argmax(model.logits(ids + tokens[:i], images=spans, native=True)[-1]))


class TestVisionAtE2BWidth(LlamaCppVision):
    """E2B's shape of the files (references/e2b_width): a text model 1536 wide, where llama.cpp decodes the image
    causally in every layer, and an mmproj without ``use_gelu`` (gelu_quick). The embeddings were 3.7e-3 of the
    largest entry from llama.cpp's when recorded (ggml's f16 patches and its gelu_quick, read from a table indexed by
    the input rounded to f16), which moves one top-1 of 31 after the image (top-1 96.8%, mean KL 3.6e-4): so the text
    model is checked here on llama.cpp's own embeddings (top-1 100%, mean KL 4.2e-5)."""

    references = Path(__file__).parent / "references" / "e2b_width"
    embedding_error = TestVision.embedding_error
    min_gap = TestVision.min_gap

    def test_logits_after_the_image_match_llamacpp(self, oracle, recorded):
        assert not failures(oracle, recorded, self.min_gap, recorded["embeddings"])

    def test_no_layer_sees_the_image_bidirectionally(self, oracle, recorded):
        """Bidirectional in the sliding layers, as at other widths, is far off."""
        assert failures(oracle, recorded, self.min_gap, recorded["embeddings"], CAUSAL_IMAGES=())


def failures(oracle, recorded, min_gap: float, embeddings: np.ndarray | None = None, **mask) -> list[str]:
    """How the oracle's logits after the image fail the bars against llama.cpp's (top-1 >= 99% at ``min_gap``, mean KL
    < 1e-3), with ``embeddings`` (else the encoder's) as the image's, and the architecture's attributes ``mask``
    (its image rows' mask) set on the model's instance."""
    model, ids, spans = oracle
    arch, vision = model.architecture, model.vision
    try:
        vars(arch).update(mask)
        if embeddings is not None:
            vision.embeddings = lambda span, start=None: model.backend.from_host(embeddings.astype(np.float64))
        logits = model.logits(ids, images=spans, native=True)
    finally:
        for name in mask:
            delattr(arch, name)
        vars(vision).pop("embeddings", None)
    after = np.arange(spans[0].start + spans[0].length, len(ids))
    agreement = compare(recorded["logits"][after], logits[after], min_gap=min_gap, label="after the image")
    assert agreement.counted >= 0.6 * len(after), str(agreement)
    return agreement.failures(top1=0.99, kl=1e-3)
