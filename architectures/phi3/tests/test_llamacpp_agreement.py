"""leat against llama.cpp on tiny Phi-3 files: the CPU float64 oracle matches llama.cpp's recorded logits, and the
float32 path matches the oracle (:class:`leat.conformance.llamacpp.LlamaCppAgreement`, which states the bars).

The files (``references/tiny_models.py``) cover what is Phi-3's own: fused attn_qkv and ffn_up (and separate
q/k/v), LongRoPE's long and short factors and magnitude, partial RoPE, a sliding window that llama.cpp does not
apply, tied and untied outputs.
"""

from pathlib import Path
from typing import ClassVar

from leat.conformance.llamacpp import LlamaCppAgreement


class TestLlamaCppAgreement(LlamaCppAgreement):
    references = Path(__file__).parent / "references"
    # Measured (llama-cpp-python 0.3.36): top-1 100% everywhere, mean KL <= 1.2e-7 (F32) and <= 3.5e-7 (F16),
    # log-prob error <= 0.098%; these KL bars sit a bit above, to catch a regression long before it would cross the
    # design's bars.
    kl: ClassVar[dict[str, float]] = {"F32": 1e-6, "F16": 3e-6}
