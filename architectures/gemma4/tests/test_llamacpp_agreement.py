"""leat against llama.cpp on tiny Gemma 4 files: the CPU float64 oracle matches llama.cpp's recorded logits, and the
float32 path matches the oracle (:class:`leat.conformance.llamacpp.LlamaCppAgreement`).

The files (``references/tiny_models.py``) cover what is Gemma 4's own: the two kinds of layer with their own head
sizes, KV heads and RoPE (proportional on the full layers), sliding windows, shared-KV layers, per-layer embeddings,
per-layer MLP widths, output scales, k as v, tied and untied outputs, capped and uncapped logits.

The bars are the design's (top-1 >= 99%, log-prob error within 2% of the logits' spread, 5% on F16), with top-1
counted where llama.cpp's top two are 0.1 apart or more. Measured (llama-cpp-python 0.3.36): the oracle's logits are
0.025 to 0.079 from llama.cpp's on these files, and the distance is llama.cpp's rounding: its CPU GELU reads a table
indexed by the input rounded to f16, and its KV cache is F16 under unscaled scores (Gemma 4's attention scale is 1).
On the e2b file with another 64-token prompt: 0.108 with llama.cpp's F16 KV cache, 0.032 with an F32 one, and 0.003
once the oracle also rounds GELU as that table does. The one recorded top-1 that differs (``gemma4-f32-e2b``,
position 38) has its top two 0.005 apart.
"""

from pathlib import Path
from typing import ClassVar

import numpy as np
from leat.compare import compare
from leat.conformance.llamacpp import LlamaCppAgreement

MIN_GAP = 0.1


class TestLlamaCppAgreement(LlamaCppAgreement):
    references = Path(__file__).parent / "references"
    kl: ClassVar[dict[str, float]] = {}  # the design's bars only (measured mean KL 4e-6 to 1.8e-5)

    def check_llamacpp(self, name, oracle, keep, recorded, tmp_path):
        reference = recorded[1][f"{name}/logits"][keep]
        agreement = compare(reference, oracle[keep], min_gap=MIN_GAP, label=f"{name} f64 vs llama.cpp")
        print(agreement)
        assert agreement.counted >= 0.6 * len(reference), agreement
        qtype = self.models().configs[name]["qtype"]
        self.assert_within(agreement, top1=0.99, logprob_error=self.logprob_error[qtype])
        assert np.abs(reference - oracle[keep]).max() < 0.12, agreement
