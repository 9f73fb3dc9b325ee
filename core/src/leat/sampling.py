"""Sampling: the parameters of a request and the chain of stages that picks the next token.

A chain is built from the stages that plugins register (see :func:`leat.hookspecs.register_samplers`). Each stage
declares the request fields it reads (a msgspec struct, :attr:`Stage.Params`) and its place in the chain
(:attr:`Stage.order`), and the engine asks a stage what it can do (:meth:`Stage.keeps_top`,
:attr:`Stage.changes_argmax`), never its name. A selector then picks the token: ``categorical``, or ``greedy``
when the temperature is 0. Stages work on float64 numpy logits; that chain is the reference every backend's sampler
is tested against.
"""

from __future__ import annotations

import functools
import math
import numbers
import random
import sys
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import gguf
import msgspec
import numpy as np

from leat import plugins
from leat.errors import PluginError

# llama.cpp's default chain (common/common.h) as Stage.order positions; a stage that goes between two takes a number
# between theirs
ORDER = {"penalties": 10, "dry": 20, "top_n_sigma": 30, "top_k": 40, "typical_p": 50, "top_p": 60, "min_p": 70}
ORDER |= {"xtc": 80, "temperature": 90}


def gguf_key(key: str) -> dict[str, str]:
    """``msgspec.Meta(extra=gguf_key(KEY))`` on a sampling field: a model file may recommend its value under ``KEY``
    (``general.sampling.*``), used when a request leaves the field out."""
    return {"gguf": key}


def generator(seed: int | None) -> np.random.Generator:
    """numpy's default generator for ``seed`` (None: from the OS's entropy). numpy.random's first import gets a
    ``secrets`` with the real one's ``randbits`` (``SystemRandom``'s), all numpy takes from it: the real module brings
    hmac and OpenSSL's libcrypto (:mod:`leat.sha256`). A later ``import secrets`` gets the real one."""
    if "numpy.random" not in sys.modules and "secrets" not in sys.modules:
        sys.modules["secrets"] = types.SimpleNamespace(randbits=random.SystemRandom().getrandbits)  # type: ignore[assignment]
        try:
            import numpy.random  # noqa: F401
        finally:
            del sys.modules["secrets"]
    return np.random.default_rng(seed)


def _recommended_key(field: msgspec.structs.FieldInfo) -> str | None:
    if typing.get_origin(field.type) is not Annotated:
        return None
    return next((m.extra["gguf"] for m in field.type.__metadata__ if m.extra and "gguf" in m.extra), None)


class ChainParams(msgspec.Struct, kw_only=True):
    """The fields the chain itself reads, whichever stages are installed: the temperature chooses the selector."""

    temperature: Annotated[
        float,
        msgspec.Meta(
            ge=0, description="divides the logits; 0 = greedy", extra=gguf_key(gguf.Keys.General.SAMPLING_TEMP)
        ),
    ] = 0.8
    seed: (
        Annotated[int, msgspec.Meta(ge=0, description="seeds the random draws; leave out for a random one")] | None
    ) = None


class Stage:
    """One logits transform. ``apply`` gets a float64 row it may change in place (masked = -inf) and returns it.

    A stage declares what a request may set for it and where it runs; the host builds every request's parameters
    and the server's request bodies from these declarations.
    """

    name: str = ""
    #: The request fields this stage reads: a ``msgspec.Struct`` (``kw_only``) whose fields have defaults (llama.cpp's
    #: where it has one) and ``msgspec.Meta`` constraints and descriptions (``extra=gguf_key(KEY)`` where a model file
    #: may recommend a value). Two stages may not declare one field.
    Params: ClassVar[type[msgspec.Struct] | None] = None
    #: Place in the chain: stages run in increasing order (see :data:`ORDER` for llama.cpp's stages).
    order: ClassVar[float] = 50
    #: True when the stage can change which token has the highest logit (penalties can, truncations cannot):
    #: only such stages run when the temperature is 0.
    changes_argmax: ClassVar[bool] = False

    def __init__(self, params: SamplingParams, rng: np.random.Generator | None = None):
        self.params = params
        if rng is not None:
            self.rng = rng

    @functools.cached_property
    def rng(self) -> np.random.Generator:  # made on first use: a greedy chain never draws
        return generator(self.params.seed)

    def enabled(self) -> bool:
        return True

    def keeps_top(self) -> int | None:
        """K when this stage keeps only the row's K largest logits (equal ones by lower id) and -inf elsewhere, and
        its result depends on those K alone; None otherwise. The engine may then read back only the K largest."""
        return None

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


@functools.lru_cache(maxsize=8)
def stages(host: plugins.PluginHost) -> tuple[type[Stage], ...]:
    """The stage classes ``host``'s plugins register, in chain order (selectors left out)."""
    found = []
    for name, entry in host.registry["samplers"].items():
        cls = entry.load()
        if not isinstance(cls, type) or not issubclass(cls, Stage | Selector):
            raise PluginError(f"plugin {entry.plugin}: sampler {name!r} ({entry.ref}) is not a Stage or Selector")
        if issubclass(cls, Stage):
            found.append(cls)
    return tuple(sorted(found, key=lambda cls: (cls.order, cls.name)))


@functools.lru_cache(maxsize=8)
def fields(host: plugins.PluginHost) -> dict[str, msgspec.structs.FieldInfo]:
    """Every sampling field a request may set with ``host``'s stages: the chain's own, then each stage's."""
    table = {f.name: f for f in msgspec.structs.fields(ChainParams)}
    owner = dict.fromkeys(table, "the chain")
    for cls in stages(host):
        for f in msgspec.structs.fields(cls.Params) if cls.Params else ():
            if f.name in table:
                raise PluginError(
                    f"sampling field {f.name!r} is declared by two stages: {owner[f.name]} and {cls.name}"
                )
            table[f.name], owner[f.name] = f, cls.name
    return table


@functools.lru_cache(maxsize=256)
def _one_field(name: str, kind: Any) -> Any:  # a Struct with one field, `value`, named `name` on the wire
    return msgspec.defstruct("Field", [("value", kind)], rename={"value": name})


def _check(field: msgspec.structs.FieldInfo, value: Any) -> Any:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{field.name} must be a finite number, got {value!r}")
    try:
        return msgspec.convert({field.name: value}, _one_field(field.name, field.type)).value
    except msgspec.ValidationError as e:
        expected = str(e).split(" - at ")[0].removeprefix("Expected ").split(", got")[0]
        raise ValueError(f"{field.name} must be {expected}, got {value!r}") from None


class SamplingParams:
    """How to pick tokens: the chain's fields (:class:`ChainParams`) and every field the installed stages declare.

    Defaults are the declarations' (llama.cpp's); a stage is off at its neutral value (top_k <= 0, top_p 1, ...).
    A field no loaded stage declares is an error naming the fields there are.
    """

    def __init__(self, host: plugins.PluginHost | None = None, **values: Any):
        table = fields(host or plugins.host())
        unknown = sorted(set(values) - set(table))
        if unknown:
            raise ValueError(
                f"{unknown[0]} is not a sampling field of the loaded stages; they take {', '.join(sorted(table))}"
            )
        self._values = {
            name: _check(f, values[name]) if name in values else f.default
            for name, f in table.items()
            if name in values or f.default is not msgspec.NODEFAULT
        }

    @classmethod
    def resolve(
        cls, request: dict[str, Any], metadata: dict[str, Any], host: plugins.PluginHost | None = None
    ) -> SamplingParams:
        """Each field from ``request``, else the GGUF's ``general.sampling.*`` value, else the default.

        ``None`` counts as left out; keys that are not fields are ignored (a request carries other things).
        """
        host = host or plugins.host()
        table = fields(host)
        values = {name: request[name] for name in table if request.get(name) is not None}
        for name, field in table.items():
            key = _recommended_key(field)
            if name not in values and key and metadata.get(key) is not None:
                try:
                    values[name] = _check(field, metadata[key])
                except ValueError as e:
                    raise ValueError(f"{e} (from the model's {key})") from None
        return cls(host, **values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"no sampling field {name!r} (no loaded stage declares it)") from None

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingParams) and self._values == other._values

    def __repr__(self) -> str:
        return f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class Sampler:
    """A chain of enabled stages and a selector, with the random generator of one request."""

    def __init__(self, stages: list[Stage], selector: Selector, seed: int | None = None):
        self.stages = stages
        self.selector = selector
        self.seed = seed

    @functools.cached_property
    def rng(self) -> np.random.Generator:  # made on first use: a greedy chain never draws
        return generator(self.seed)

    @classmethod
    def build(cls, params: SamplingParams, host: plugins.PluginHost | None = None) -> Sampler:
        host = host or plugins.host()
        greedy = params.temperature <= 0
        selector = _load(host, "greedy" if greedy else "categorical", Selector)(params)
        sampler = cls([], selector, params.seed)
        rng = None if greedy else sampler.rng
        chain = (stage(params, rng) for stage in stages(host) if stage.changes_argmax or not greedy)
        sampler.stages = [stage for stage in chain if stage.enabled()]
        return sampler

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
