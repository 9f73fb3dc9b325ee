"""The default sampling stages, with llama.cpp's semantics (src/llama-sampler.cpp), on float64 numpy logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import gguf
import msgspec
import numpy as np
from leat.sampling import ORDER, Selector, Stage, gguf_key
from msgspec import Meta

General = gguf.Keys.General
Probability = Annotated[float, Meta(ge=0, le=1)]


class PenaltyParams(msgspec.Struct, kw_only=True):
    repeat_penalty: Annotated[
        float,
        Meta(
            gt=0,
            description="divides a seen token's positive logit; 1 = off",
            extra=gguf_key(General.SAMPLING_PENALTY_REPEAT),
        ),
    ] = 1.0
    presence_penalty: Annotated[float, Meta(description="subtracted once from a seen token's logit")] = 0.0
    frequency_penalty: Annotated[float, Meta(description="subtracted per occurrence of a seen token")] = 0.0
    repeat_last_n: Annotated[
        int,
        Meta(
            ge=-1,
            description="how many recent tokens count as seen; -1 = all, 0 = off",
            extra=gguf_key(General.SAMPLING_PENALTY_LAST_N),
        ),
    ] = 64


class TopKParams(msgspec.Struct, kw_only=True):
    top_k: Annotated[
        int, Meta(description="keep the k most likely tokens; <= 0 = off", extra=gguf_key(General.SAMPLING_TOP_K))
    ] = 40


class TopPParams(msgspec.Struct, kw_only=True):
    top_p: Annotated[
        Probability,
        Meta(description="keep the most likely tokens summing to p; 1 = off", extra=gguf_key(General.SAMPLING_TOP_P)),
    ] = 0.95


class MinPParams(msgspec.Struct, kw_only=True):
    min_p: Annotated[
        Probability,
        Meta(
            description="drop tokens less likely than min_p x the top one; 0 = off",
            extra=gguf_key(General.SAMPLING_MIN_P),
        ),
    ] = 0.05


class Penalties(Stage):
    """Repeat penalty (divides positive logits, multiplies negative ones), then frequency and presence penalties,
    for each token in the last ``repeat_last_n`` of the history."""

    name = "penalties"
    Params = PenaltyParams
    order = ORDER["penalties"]
    changes_argmax = True

    def enabled(self) -> bool:
        p = self.params
        return p.repeat_last_n != 0 and (p.repeat_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0)

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = self.params
        window = np.asarray(history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history, dtype=np.int64)
        counts = np.bincount(window, minlength=logits.size)[: logits.size]
        seen = counts > 0
        x = logits[seen]
        x = np.where(x <= 0, x * p.repeat_penalty, x / p.repeat_penalty)
        logits[seen] = x - counts[seen] * p.frequency_penalty - p.presence_penalty
        return logits


class TopK(Stage):
    """Keeps the ``top_k`` highest logits; among equal logits the lower token id wins, as with ``np.argmax``."""

    name = "top_k"
    Params = TopKParams
    order = ORDER["top_k"]

    def enabled(self) -> bool:
        return self.params.top_k > 0

    def keeps_top(self) -> int | None:
        return self.params.top_k

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        k = self.params.top_k
        if k >= logits.size:
            return logits
        kth = np.partition(logits, -k)[-k]
        keep = logits > kth
        keep[np.flatnonzero(logits == kth)[: k - np.count_nonzero(keep)]] = True
        logits[~keep] = -np.inf
        return logits


class TopP(Stage):
    """Keeps the most probable tokens whose probabilities first add up to ``top_p`` (always at least one)."""

    name = "top_p"
    Params = TopPParams
    order = ORDER["top_p"]

    def enabled(self) -> bool:
        return self.params.top_p < 1

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        live = np.flatnonzero(logits > -np.inf)
        order = live[np.argsort(-logits[live], kind="stable")]
        cumulative = np.cumsum(softmax(logits[order]))
        keep = np.searchsorted(cumulative, self.params.top_p) + 1
        logits[order[keep:]] = -np.inf
        return logits


class MinP(Stage):
    """Keeps tokens with probability >= ``min_p`` times the top token's."""

    name = "min_p"
    Params = MinPParams
    order = ORDER["min_p"]

    def enabled(self) -> bool:
        return self.params.min_p > 0

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        logits[logits < logits.max() + np.log(self.params.min_p)] = -np.inf
        return logits


class Temperature(Stage):
    """Divides the logits by the chain's own ``temperature`` field."""

    name = "temperature"
    order = ORDER["temperature"]

    def enabled(self) -> bool:
        return self.params.temperature > 0

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        logits /= self.params.temperature
        return logits


class Greedy(Selector):
    name = "greedy"

    def select(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        return int(np.argmax(logits))


class Categorical(Selector):
    """Draws a token with probability softmax(logits)."""

    name = "categorical"

    def select(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        live = np.flatnonzero(logits > -np.inf)
        return int(live[rng.choice(live.size, p=softmax(logits[live]))])


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()
