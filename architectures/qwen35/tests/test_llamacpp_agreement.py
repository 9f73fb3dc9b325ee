"""leat against llama.cpp on tiny Qwen3.5 files: the CPU float64 oracle matches llama.cpp's recorded logits, and the
float32 path matches the oracle (:class:`leat.conformance.llamacpp.LlamaCppAgreement`).

The files (``references/tiny_models.py``) cover what is Qwen3.5's own: gated delta-net layers with fewer key heads
than value heads and with as many, their convolution and recurrent state over a 64-token prompt, gated full attention
with IMRoPE (all pairs rotated, and sections that leave pairs unrotated), layer kinds by interval and as listed, tied
and untied outputs, and qwen35moe's routed experts beside a gated shared expert.

The bars are the design's (top-1 >= 99%, log-prob error within 2% of the logits' spread, 5% on F16) and the kit's KL
bar on F32. Measured (llama-cpp-python 0.3.36): on the F32 files mean KL 7.7e-10, 7.6e-8 and 6.3e-10 (MoE), log-prob
error 0.005%, 0.12% and 0.005% of the spread; on the F16 file mean KL 1.4e-5 and log-prob error 1.97% (llama.cpp
rounds the activations to f16 before each F16 product and keeps an F16 KV cache, and the recurrent state carries
each rounding on), so F16 has the design's log-prob bar and no KL bar. That distance is llama.cpp's rounding: the
CPU backend at float32 with ``activations="ggml"`` (llama.cpp's rounding of the activations) and an f16 KV cache
comes within mean KL 1.9e-7 and max |logit diff| 0.010 of llama.cpp on that file, against the oracle's 1.4e-5 and
0.149.
"""

from pathlib import Path
from typing import ClassVar

from leat.conformance.llamacpp import LlamaCppAgreement


class TestLlamaCppAgreement(LlamaCppAgreement):
    references = Path(__file__).parent / "references"
    kl: ClassVar[dict[str, float]] = {"F32": 1e-6}
