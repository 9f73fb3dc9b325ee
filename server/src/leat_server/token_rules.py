"""vLLM's token-level sampling controls as one logits processor: ``allowed_token_ids`` (only those may be sampled) and
``min_tokens`` (the end-of-generation tokens and ``stop_token_ids`` are banned until that many tokens are out). It
carries its spec, so an engine in another process rebuilds it (``leat.engine_process.build_processor``)."""

from __future__ import annotations

from typing import Any

import numpy as np


class TokenRules:
    def __init__(self, allowed: list[int] | None, banned: list[int], until: int):
        self.allowed = None if allowed is None else np.asarray(sorted(set(allowed)), dtype=np.int64)
        self.banned, self.until = sorted(set(banned)), until
        self.label = "token rules"  # names it in the error if it fails
        self.spec = (f"{__name__}:rebuild", {"allowed": allowed, "banned": self.banned, "until": until})

    def __call__(self, logits: np.ndarray, generated: Any) -> np.ndarray:
        if self.allowed is not None:
            kept = logits[self.allowed]
            logits[:] = -np.inf
            logits[self.allowed] = kept
        if len(generated) < self.until and self.banned:
            logits[self.banned] = -np.inf
        return logits


def rebuild(payload: dict[str, Any], model: Any) -> TokenRules:
    """The processor, rebuilt in an engine process from its spec's payload (checked by the frontend)."""
    return TokenRules(payload["allowed"], payload["banned"], payload["until"])
