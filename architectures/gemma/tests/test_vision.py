"""Images through a tiny Gemma-3-style mmproj on a tiny Gemma 3 model, against llama.cpp's mtmd (recorded by
scripts/record_llamacpp_vision.py): the image embeddings, the prompt's ids around the image, and the logits of
the text after it, from leat's float64 oracle (:class:`leat.conformance.vision.LlamaCppVision`).

llama.cpp computes the encoder in float32 (attention without flash, so not over f16 K and V); the embeddings were
2.8e-4 of the largest entry from leat's when recorded (the bar is the kit's 1e-3): 1.3e-4 once the patch product's
operands are rounded to f16, as ggml's conv_2d does (its im2col is F16); the 47 text positions after the image top-1
100%, mean KL 5.4e-8.
"""

from __future__ import annotations

from pathlib import Path

from leat.conformance.vision import LlamaCppVision


class TestVision(LlamaCppVision):
    references = Path(__file__).parent / "references"
