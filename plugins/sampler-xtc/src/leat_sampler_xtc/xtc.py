"""XTC, "exclude top choices", as llama.cpp defines it (src/llama-sampler.cpp, llama_sampler_xtc_apply).

With probability ``xtc_probability`` per token, every candidate whose probability is at least ``xtc_threshold`` is
removed except the least likely of them, so the model's most predictable continuations give way to a less obvious
one that is still likely. It runs after min_p and before the temperature (llama.cpp's default chain), on the
probabilities of the candidates the earlier stages left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np
from leat.sampling import ORDER, Stage
from msgspec import Meta


class XTCParams(msgspec.Struct, kw_only=True):
    xtc_probability: Annotated[
        float, Meta(ge=0, le=1, description="chance per token that XTC removes the top choices; 0 = off")
    ] = 0.0
    xtc_threshold: Annotated[
        float, Meta(ge=0, le=1, description="a choice is 'top' at this probability or more; above 0.5 = off")
    ] = 0.1


class XTC(Stage):
    """Removes every candidate at or above the threshold but the least likely of them, with the given chance.

    Candidates are ordered by logit, equal logits by lower id (so among equal ones at the boundary the higher id
    stays). Like llama.cpp, a row with fewer than two candidates is left alone without a random draw; otherwise one
    uniform draw in [0, 1) decides, and XTC acts when it is at most ``xtc_probability``.
    """

    name = "xtc"
    Params = XTCParams
    order = ORDER["xtc"]
    changes_argmax = True  # it removes the most likely token, at temperature 0 too (as llama.cpp's chain does)

    def enabled(self) -> bool:
        return self.params.xtc_probability > 0 and self.params.xtc_threshold <= 0.5

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        live = np.flatnonzero(logits > -np.inf)
        if live.size < 2 or self.rng.random() > self.params.xtc_probability:
            return logits
        order = live[np.argsort(-logits[live], kind="stable")]
        p = np.exp(logits[order] - logits[order[0]])
        p /= p.sum()
        above = int(np.count_nonzero(p >= self.params.xtc_threshold))  # p is sorted, so these are its first ones
        if above > 1:
            logits[order[: above - 1]] = -np.inf
        return logits
