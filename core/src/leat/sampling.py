"""Sampling: the parameters of a request and the chain of stages that picks the next token.

A chain is built from stages that plugins register (see :func:`leat.hookspecs.register_samplers`),
in llama.cpp's default order: penalties, top_k, top_p, min_p, temperature, then a selector
(``categorical``, or ``greedy`` when the temperature is 0). Stages work on float64 numpy logits;
that chain is the reference every backend's sampler is tested against.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import gguf
import numpy as np

from leat import plugins
from leat.errors import PluginError

CHAIN = ("penalties", "top_k", "top_p", "min_p", "temperature")

# Parameters a GGUF can recommend (general.sampling.*), used when a request leaves them out.
GGUF_KEYS = {
    "temperature": gguf.Keys.General.SAMPLING_TEMP,
    "top_k": gguf.Keys.General.SAMPLING_TOP_K,
    "top_p": gguf.Keys.General.SAMPLING_TOP_P,
    "min_p": gguf.Keys.General.SAMPLING_MIN_P,
    "repeat_penalty": gguf.Keys.General.SAMPLING_PENALTY_REPEAT,
    "repeat_last_n": gguf.Keys.General.SAMPLING_PENALTY_LAST_N,
}

# field: (integer?, allowed range, as said in the error)
_RULES = {
    "temperature": (False, lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_k": (True, lambda v: True, ""),
    "top_p": (False, lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "min_p": (False, lambda v: 0 <= v <= 1, "must be between 0 and 1"),
    "repeat_penalty": (False, lambda v: v > 0, "must be > 0 (1 = off)"),
    "presence_penalty": (False, lambda v: True, ""),
    "frequency_penalty": (False, lambda v: True, ""),
    "repeat_last_n": (True, lambda v: v >= -1, "must be >= -1 (-1 = whole history, 0 = off)"),
    "seed": (True, lambda v: v >= 0, "must be >= 0 (leave it out for a random seed)"),
}


def _check(name: str, value: Any) -> Any:
    if name == "seed" and value is None:
        return None
    integer, in_range, expected = _RULES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        # ValueError, not TypeError: callers treat every bad request value alike
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")  # noqa: TRY004
    value = int(value) if integer else float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not in_range(value):
        raise ValueError(f"{name} {expected}, got {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to pick tokens. Defaults are llama.cpp's; a stage is off at its neutral value (top_k <= 0, top_p 1, ...)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _check(f.name, getattr(self, f.name)))

    @classmethod
    def resolve(cls, request: dict[str, Any], metadata: dict[str, Any]) -> SamplingParams:
        """Each field from ``request``, else the GGUF's ``general.sampling.*`` value, else the default.

        ``None`` counts as left out; keys that are not fields are ignored (a request carries other things).
        """
        values = {}
        for f in fields(cls):
            key = GGUF_KEYS.get(f.name)
            if request.get(f.name) is not None:
                values[f.name] = request[f.name]
            elif key and metadata.get(key) is not None:
                try:
                    values[f.name] = _check(f.name, metadata[key])
                except ValueError as e:
                    raise ValueError(f"{e} (from the model's {key})") from None
        return cls(**values)


class Stage:
    """One logits transform. ``apply`` gets a float64 row it may change in place (masked = -inf) and returns it."""

    name: str = ""

    def __init__(self, params: SamplingParams):
        self.params = params

    def enabled(self) -> bool:
        return True

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        raise NotImplementedError


class Selector:
    """Picks the token id from the final float64 logits."""

    name: str = ""

    def __init__(self, params: SamplingParams):
        self.params = params

    def select(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        raise NotImplementedError


def _load(host: plugins.PluginHost, name: str, base: type) -> type:
    entry = host.get("samplers", name)
    if entry is None:
        raise PluginError(
            f"sampler {name!r} is not registered by any loaded plugin; install leat-samplers or "
            f"add it to LEAT_PLUGINS / --plugins"
        )
    cls = entry.load()
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(f"plugin {entry.plugin}: sampler {name!r} ({entry.ref}) is not a {base.__name__} subclass")
    return cls


class Sampler:
    """A chain of enabled stages and a selector, with the random generator of one request."""

    def __init__(self, stages: list[Stage], selector: Selector, seed: int | None = None):
        self.stages = stages
        self.selector = selector
        self.rng = np.random.default_rng(seed)

    @classmethod
    def build(cls, params: SamplingParams, host: plugins.PluginHost | None = None) -> Sampler:
        host = host or plugins.host()
        greedy = params.temperature <= 0
        # Penalties are the only stage that can change which token has the highest logit.
        names = ("penalties",) if greedy else CHAIN
        stages = [stage for stage in (_load(host, name, Stage)(params) for name in names) if stage.enabled()]
        selector = _load(host, "greedy" if greedy else "categorical", Selector)(params)
        return cls(stages, selector, params.seed)

    @property
    def greedy(self) -> bool:
        return self.selector.name == "greedy"

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id from one row of logits, given the ids generated (and prompted) so far."""
        return self.selector.select(self._chain(logits, history), self.rng)

    def probabilities(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution a ``categorical`` selector draws from: softmax of the chain's final logits.

        Speculative verification needs this distribution itself, not one sample of it.
        """
        x = self._chain(logits, history)
        p = np.zeros_like(x)
        live = x > -np.inf
        p[live] = np.exp(x[live] - x[live].max())
        return p / p.sum()

    def _chain(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        x = np.array(logits, dtype=np.float64)  # a copy, so stages may work in place
        if x.ndim != 1:
            raise ValueError(f"logits must be one row (vocab,), got shape {x.shape}")
        for stage in self.stages:
            x = stage.apply(x, history)
        return x
