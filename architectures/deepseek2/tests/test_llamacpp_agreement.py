"""leat's DeepSeek2 against llama.cpp's recorded logits (references/record_llamacpp.py regenerates them), through
:class:`leat.conformance.llamacpp.LlamaCppAgreement`: the tiny files rebuilt bit for bit, the float64 oracle against
llama.cpp (top-1 >= 99%, log-prob error <= 2% of the logits' spread on F32 files, 5% on F16), the float32 path
against the oracle (top-1 >= 99%, mean KL < 1e-3).

Positions where some layer's expert choice is within 1e-3 of a tie (:func:`leat.moe.selection_margin` of the
oracle's own router) are left out of the llama.cpp comparison: there either engine's choice is right, as
where the output's top-2 gap is below 1e-3.
"""

from pathlib import Path
from typing import ClassVar

import numpy as np
from leat.conformance.llamacpp import LlamaCppAgreement


class TestLlamaCppAgreement(LlamaCppAgreement):
    references = Path(__file__).parent / "references"
    tiny_models = "tiny_deepseek2.py"
    arrays = "llamacpp_deepseek2_tiny.npz"
    manifest = "llamacpp_deepseek2.json"
    kl: ClassVar[dict[str, float]] = {}  # the design's bars only
    rerecord = "re-record with references/record_llamacpp.py (see its docstring)"

    def prompt(self, name, arrays):
        return arrays[f"{name}/tokens"].astype(np.int64)  # llama.cpp's tokens of PROMPT_TEXT
