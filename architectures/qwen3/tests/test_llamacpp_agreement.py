"""leat against llama.cpp on tiny Qwen files (Qwen3, Qwen3-MoE, Qwen2): the CPU float64 oracle matches llama.cpp's
recorded logits, and the float32 path matches the oracle (:class:`leat.conformance.llamacpp.LlamaCppAgreement`,
which states the bars and leaves out tokens whose MoE expert choice is within 1e-3 of a tie).
"""

from pathlib import Path
from typing import ClassVar

from leat.conformance.llamacpp import LlamaCppAgreement


class TestLlamaCppAgreement(LlamaCppAgreement):
    references = Path(__file__).parent / "references"
    # Measured (llama-cpp-python 0.3.36): mean KL <= 1.6e-7 (F32) and <= 4.6e-7 (F16), log-prob error <= 0.23%;
    # these KL bars sit a bit above, to catch a regression long before it would cross the design's bars.
    kl: ClassVar[dict[str, float]] = {"F32": 1e-6, "F16": 3e-6}
