"""Several models by name in one ``leat serve``: each loaded model is its own engine, loaded when a request names it
and unloaded, least recently used first, when the memory budget (``--models-memory``) would be exceeded.

A request's ``model`` picks its :class:`Entry` (by name or alias); a loaded entry is *leased* for the request's
life (:class:`Lease`), so an engine is never stopped under a request. Loading runs on a thread of its own while
requests for the model wait (up to ``--load-timeout``); a file that fails to load leaves its entry ``failed``, with
the reason every request for it gets, and the other models serving. With one model and no config file, the
request's ``model`` is not read (any name is that model), as before several models were served.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import threading
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import msgspec
from leat.errors import LeatError

from leat_server.errors import APIError

log = logging.getLogger("leat_server")
POLL_SECONDS = 0.05  # between looks at a loading model by the requests that wait for it
# the options a config file may set per model, over the server's own
PER_MODEL = (
    *("backend", "precision", "batch_size", "kv", "max_context", "prefill_chunk", "max_queue", "tool_parser"),
    *("mmproj", "prefill_budget"),
)


@dataclass
class ModelSpec:
    """A model the server can serve: its ``name`` (the id clients send), what to load (a path, a pulled name,
    ``pypi:...`` or ``owner/name:quant``), other names it answers to, and its options (``ServeOptions``)."""

    name: str
    model: str
    options: Any
    aliases: list[str] = field(default_factory=list)


class Entry:
    """One model's state: ``unloaded``, ``loading``, ``loaded`` (``service`` set) or ``failed`` (``error`` says why)."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.state = "unloaded"
        self.service: Any = None
        self.error: str | None = None
        self.size: int | None = None  # bytes it holds (estimated: file + KV), known once it has started loading
        self.users = 0  # requests holding a lease on it
        self.waiting = 0  # requests waiting for it to load: once it has, it is not unloaded before they have it
        self.holds_room = False  # counted against the budget: loaded, or loading once room was made for it
        self.last_used = 0.0
        self.loaded_at: float | None = None


class Lease:
    """A request's hold on a loaded model (as a context manager: released at the end of the block, unless
    :meth:`keep` handed the release to a stream)."""

    def __init__(self, models: Models, entry: Entry):
        self.models, self.entry, self.service = models, entry, entry.service
        self._kept = self._released = False

    def keep(self) -> Callable[[], None]:
        self._kept = True
        return self.release

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.models.release(self.entry)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._kept or exc[0] is not None:
            self.release()


class _Named(msgspec.Struct):
    model: str = ""


class Models:
    """The models a server serves, by name. ``load(spec)`` loads one and returns its started
    :class:`~leat_server.service.Service`; ``estimate(spec)`` the bytes it will hold; ``budget`` (bytes, None: no
    limit) what the loaded ones may hold together; ``changed(models)`` is called when a model's state changes."""

    def __init__(
        self,
        specs: list[ModelSpec],
        load: Callable[[ModelSpec], Any],
        estimate: Callable[[ModelSpec], int],
        budget: int | None = None,
        load_timeout: float = 120.0,
        routing: bool = True,
        changed: Callable[[Models], None] = lambda models: None,
    ):
        if not specs:
            raise LeatError("no model to serve")
        self.entries = [Entry(spec) for spec in specs]
        self.by_name: dict[str, Entry] = {}
        for entry in self.entries:
            for name in [entry.spec.name, *entry.spec.aliases]:
                other = self.by_name.setdefault(name, entry)
                if other is not entry:
                    raise LeatError(f"two models are named {name!r} ({other.spec.model} and {entry.spec.model})")
        self.default = self.entries[0]
        self.load, self.estimate, self.budget = load, estimate, budget
        self.load_timeout, self.routing, self.changed = load_timeout, routing, changed
        self._lock = threading.Condition()

    @classmethod
    def single(cls, service: Any, name: str) -> Models:
        """One loaded model; a request's ``model`` is not read."""
        models = cls([ModelSpec(name, name, None)], _no_loading, lambda spec: 0, routing=False)
        models.default.state, models.default.service = "loaded", service
        models.default.loaded_at, models.default.holds_room = time.time(), True
        return models

    # -- finding and leasing ---------------------------------------------------------------------------------
    def route(self, raw: bytes) -> str:
        """The ``model`` a request body names ("" when it names none, or is not a JSON object: its own decoding
        reports that); not read when one model is served."""
        if not self.routing:
            return ""
        try:
            return msgspec.json.decode(raw, type=_Named).model
        except (msgspec.DecodeError, RecursionError):
            return ""

    def find(self, name: str) -> Entry:
        """The model called ``name`` (the first one for ""): 404 listing the known ones when there is none."""
        if not self.routing or not name:
            return self.default
        entry = self.by_name.get(name)
        if entry is None:
            raise APIError(
                404,
                f"model {name!r} is not served here; known models: {', '.join(self.by_name)}",
                param="model",
                code="model_not_found",
            )
        return entry

    def try_lease(self, entry: Entry) -> Lease | None:
        """A lease on ``entry`` if it is loaded; else None, its loading started (an error if it failed to load)."""
        with self._lock:
            if entry.state == "loaded":
                entry.users += 1
                entry.last_used = time.monotonic()
                return Lease(self, entry)
            if entry.state == "failed":
                raise self._failed(entry)
            if entry.state == "unloaded":
                self._start(entry)
        return None

    async def acquire(self, name: str) -> Lease:
        """A lease on the model called ``name``, waiting up to the load timeout while it loads."""
        entry = self.find(name)
        lease = self.try_lease(entry)
        if lease is not None:
            return lease
        with self._lock:
            entry.waiting += 1
        try:
            return await self._wait(entry)
        finally:
            with self._lock:
                entry.waiting -= 1
                self._lock.notify_all()

    async def _wait(self, entry: Entry) -> Lease:
        deadline = time.monotonic() + self.load_timeout
        while True:
            if time.monotonic() > deadline:
                raise APIError(
                    503,
                    f"model {entry.spec.name!r} is still loading after {self.load_timeout:g} s (--load-timeout); "
                    "try again shortly",
                    param="model",
                    type="server_error",
                    code="model_loading",
                    headers={"Retry-After": "5"},
                )
            await asyncio.sleep(POLL_SECONDS)
            lease = self.try_lease(entry)
            if lease is not None:
                return lease

    def release(self, entry: Entry) -> None:
        with self._lock:
            entry.users -= 1
            entry.last_used = time.monotonic()
            self._lock.notify_all()

    def loaded(self) -> list[Any]:
        """The services of the loaded models."""
        with self._lock:
            return [e.service for e in self.entries if e.state == "loaded"]

    # -- loading and unloading -------------------------------------------------------------------------------
    def preload(self) -> None:
        """Start loading the first model (requests for it wait until it has loaded)."""
        with self._lock:
            if self.default.state == "unloaded":
                self._start(self.default)

    async def load_now(self, name: str) -> Entry:
        """Load the model called ``name`` (again, after a failure), and return once it is loaded."""
        entry = self.find(name)
        with self._lock:
            if entry.state == "failed":
                entry.state = "unloaded"
        with await self.acquire(name):
            return entry

    def unload(self, name: str) -> Entry:
        """Unload the model called ``name`` once its requests have ended (blocks; 409 if they last past the load
        timeout, or it is loading)."""
        entry = self.find(name)
        if not self.routing:
            raise APIError(
                400,
                "this server serves one model, which stays loaded; start it with several models (or "
                "--models-config) to load and unload them",
                param="model",
                code="model_pinned",
            )
        deadline = time.monotonic() + self.load_timeout
        with self._lock:
            if entry.state == "loading":
                raise APIError(409, f"model {entry.spec.name!r} is loading; unload it once it has loaded")
            if entry.state == "failed":
                entry.state, entry.error = "unloaded", None
            if entry.state != "loaded":
                return entry
            while entry.users:
                if not self._lock.wait(max(0.0, deadline - time.monotonic())):
                    raise APIError(409, f"model {entry.spec.name!r} is still answering requests; try again")
            if entry.state != "loaded":  # another unload, or making room for a model, took it while this one waited
                return entry
            service = self._take(entry)
        self._stop(entry, service)
        return entry

    def stop(self) -> None:
        """Stop every loaded model's engine (the server is shutting down)."""
        for entry in self.entries:
            with self._lock:
                service = self._take(entry) if entry.state == "loaded" else None
            if service is not None:
                service.engine.stop()

    def _start(self, entry: Entry) -> None:
        entry.state, entry.error = "loading", None
        threading.Thread(target=self._load, args=(entry,), name=f"leat-load-{entry.spec.name}", daemon=True).start()

    def _load(self, entry: Entry) -> None:
        try:
            size = self.estimate(entry.spec)
            with self._lock:
                entry.size = size
            self._make_room(entry)
            self._changed()
            service = self.load(entry.spec)
        except Exception as e:  # noqa: BLE001 - the model is marked failed with the reason; the others serve on
            message = str(e) if isinstance(e, LeatError) else f"{type(e).__name__}: {e}"
            log.error("leat: model %s failed to load: %s", entry.spec.name, message)
            with self._lock:
                entry.state, entry.error, entry.holds_room = "failed", message, False
                self._lock.notify_all()
        else:
            with self._lock:
                entry.service, entry.state = service, "loaded"
                entry.loaded_at, entry.last_used = time.time(), time.monotonic()
                self._lock.notify_all()
        self._changed()

    def _make_room(self, entry: Entry) -> None:
        """Unload the least recently used idle models until ``entry`` fits the budget beside the others."""
        deadline, size = time.monotonic() + self.load_timeout, entry.size or 0
        while True:
            with self._lock:
                # a model still waiting for room holds none: two such loads wait for each other otherwise
                others = [e for e in self.entries if e is not entry and e.holds_room]
                if self.budget is None or sum(e.size or 0 for e in others) + size <= self.budget:
                    entry.holds_room = True
                    return
                if size > self.budget:
                    raise LeatError(
                        f"model {entry.spec.name} needs about {_mib(size)} (file and KV), more than "
                        f"--models-memory {_mib(self.budget)}; raise it, or lower its batch size or context"
                    )
                idle = [e for e in others if e.state == "loaded" and not e.users and not e.waiting]
                idle.sort(key=lambda e: e.last_used)
                if not idle:
                    if time.monotonic() > deadline:
                        raise LeatError(
                            f"model {entry.spec.name} does not fit --models-memory {_mib(self.budget)} beside "
                            f"models that stayed busy for {self.load_timeout:g} s"
                        )
                    self._lock.wait(0.1)
                    continue
                victim = idle[0]
                service = self._take(victim)
            log.info("leat: unloading %s to make room for %s", victim.spec.name, entry.spec.name)
            self._stop(victim, service)

    def _changed(self) -> None:
        """Tell ``changed`` (the ``leat ps`` record) a state changed: its failure is logged, and fails no load."""
        try:
            self.changed(self)
        except Exception as e:  # noqa: BLE001 - bookkeeping for `leat ps`; the models serve on
            log.warning("leat: could not record the models' states: %s: %s", type(e).__name__, e)

    def _take(self, entry: Entry) -> Any:
        """Mark a loaded ``entry`` unloaded (no lease can be had on it from now) and return its service."""
        service, entry.service, entry.state, entry.loaded_at = entry.service, None, "unloaded", None
        entry.holds_room = False
        return service

    def _stop(self, entry: Entry, service: Any) -> None:
        service.engine.stop()
        del service
        gc.collect()  # the weights and KV go now, before the next model is loaded into their room
        self._changed()

    def _failed(self, entry: Entry) -> APIError:
        return APIError(
            503,
            f"model {entry.spec.name!r} failed to load: {entry.error}. Fix it, then POST /models/load "
            f'{{"model": "{entry.spec.name}"}} to try again',
            param="model",
            type="server_error",
            code="model_unavailable",
        )

    # -- what clients and `leat ps` see ----------------------------------------------------------------------
    def card(self, entry: Entry) -> dict[str, Any]:
        with self._lock:
            card: dict[str, Any] = {
                "id": entry.spec.name,
                "object": "model",
                "owned_by": "leat",
                "state": entry.state,
                "aliases": list(entry.spec.aliases),
                "size_bytes": entry.size,
            }
            service = entry.service
            if entry.error:
                card["error"] = entry.error
        if service is not None:
            card |= {
                "created": service.created,
                "context_length": service.max_context,
                "architecture": service.model.file.architecture,
                "backend": service.backend_name,
            }
        return card

    def stats(self) -> dict[str, Any]:
        """The loaded engines' stats, summed (what ``/metrics`` and ``/health`` report)."""
        total: dict[str, Any] = {}
        for service in self.loaded():
            for key, value in service.engine.stats().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
                elif isinstance(value, dict) and key == "allocations":
                    kinds = total.setdefault(key, {})
                    for kind, n in value.items():
                        kinds[kind] = kinds.get(kind, 0) + n
        return total

    def resident(self) -> list[dict[str, Any]]:
        """The loaded and loading models, for ``leat ps``."""
        from leat.pull import resolve

        with self._lock:
            rows = [
                {"model": e.spec.name, "path": e.spec.model, "size": e.size, "state": e.state, "loaded": e.loaded_at}
                for e in self.entries
                if e.state in ("loaded", "loading")
            ]
        for row in rows:
            with contextlib.suppress(LeatError, OSError):
                row["path"] = str(resolve(row["path"], pull=False))
        return rows


def _no_loading(spec: ModelSpec) -> Any:
    raise LeatError(f"{spec.name} cannot be loaded again by this server")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``1.5GiB``, ``123456`` -> bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = body[-1:] if body[-1:] in units else ""
    try:
        value = float(body[: len(body) - len(unit)])
    except ValueError:
        raise ValueError(f"{text!r} is not a size; write e.g. 8G, 512M or a number of bytes") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value * units[unit])


def estimate_bytes(spec: ModelSpec) -> int:
    """What a model will hold: its file, and KV for its batch at its context (the model's own when none is set)."""
    from leat.engine import KV_BYTES
    from leat.model import architecture_class
    from leat.modelfile import ModelFile
    from leat.pull import resolve

    path = resolve(spec.model)
    size = path.stat().st_size
    file = ModelFile(path)
    params = architecture_class(file).checked_params(file)
    layouts = architecture_class(file).kv_layouts(params)
    per_token = sum(layout.bytes_per_token(1) for layout in layouts) * KV_BYTES[spec.options.kv]
    context = spec.options.max_context or int(file.get("{arch}.context_length", 0)) or 4096
    return int(size + per_token * context * spec.options.batch_size)


def specs_from(models: Iterable[str], config: str | None, base: Any) -> list[ModelSpec]:
    """The models ``leat serve`` was given: each ``MODEL`` argument (named by its file's stem, or ``--alias`` for
    a lone one), then each ``[models.NAME]`` table of the TOML ``config`` file (``model`` = what to load,
    ``aliases``, and any of :data:`PER_MODEL` over the server's options)."""
    from leat.cli_models import model_label
    from leat.pull import resolve

    models = list(models)
    if base.alias and (len(models) > 1 or config):
        raise LeatError("--alias names one model; with several, give each its name and aliases in --models-config")
    if base.api_workers:
        raise LeatError("--api-workers serves one model; leave it out to serve several models by name")
    specs = [ModelSpec(base.alias or _label(name, model_label, resolve), name, base) for name in models]
    if config:
        try:
            tables = tomllib.loads(Path(config).expanduser().read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise LeatError(f"--models-config {config}: {e}") from None
        for name, table in (tables.get("models") or {}).items():
            specs.append(_spec(config, name, table, base))
        if not specs:
            raise LeatError(f"--models-config {config} names no model; add a [models.NAME] table with model = ...")
    return specs


def _label(name: str, model_label: Callable[[Any], str], resolve: Callable[..., Path]) -> str:
    try:
        return model_label(resolve(name, pull=False))
    except LeatError:
        return name.rsplit("/", 1)[-1]


def _spec(config: str, name: str, table: Any, base: Any) -> ModelSpec:
    where = f"--models-config {config}: [models.{name}]"
    if not isinstance(table, dict) or not isinstance(table.get("model"), str):
        raise LeatError(f'{where} needs model = "PATH or NAME"')
    unknown = sorted(set(table) - {"model", "aliases", *PER_MODEL})
    if unknown:
        raise LeatError(f"{where}: unknown key {unknown[0]!r}; known: model, aliases, {', '.join(PER_MODEL)}")
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise LeatError(f'{where}: aliases must be a list of names, e.g. aliases = ["small"]')
    options = dataclasses.replace(base, **{k: table[k] for k in PER_MODEL if k in table})
    for key in ("batch_size", "max_context", "prefill_chunk", "prefill_budget"):
        value = getattr(options, key)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise LeatError(f"{where}: {key} must be a positive integer, not {value!r}")
    from leat.engine import KV_BYTES

    if options.kv not in KV_BYTES:
        raise LeatError(f"{where}: kv must be one of {', '.join(KV_BYTES)}, not {options.kv!r}")
    return ModelSpec(name, table["model"], options, aliases)
