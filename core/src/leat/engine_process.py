"""An engine in a process of its own, and the client that API frontends use to reach it.

The engine process owns the model, the backend and the scheduler; frontends (one or several processes) own
HTTP, templates, tokenizing and text. They talk over a local socket (``multiprocessing.connection``, with an
authentication key) in msgspec-encoded messages:

* frontend -> engine: :class:`Submit` (token ids, sampling parameters, processor specs, the images' encoded
  bytes as :class:`Image`), :class:`Cancel`, and :class:`Call` (stats, sessions, embeddings).
* engine -> frontend: :class:`Accepted` (or why not: overloaded, too long, invalid), :class:`Outputs` (every
  event of one step for this frontend's requests: one message per step per frontend, never one per token), and
  :class:`Reply`.

Logits processors are functions and do not cross processes: a processor that should carries a ``spec``, a
``(kind, payload)`` pair that :func:`build_processor` turns back into a processor in the engine process.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import msgspec
import numpy as np

from leat.engine import Engine, Event, GenerationRequest, Overloaded, RequestHandle, TooLong, deliver
from leat.errors import LeatError
from leat.sampling import SamplingParams
from leat.sessions import SessionInUse

ProcessorSpec = tuple[str, Any]


class Image(msgspec.Struct):
    """A prompt's image on its way to the engine process, which decodes and encodes it (keyed by digest)."""

    start: int
    length: int
    data: bytes


class Submit(msgspec.Struct, tag=True):
    rid: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict[str, Any]
    session: str | None = None
    client: str | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    processors: list[tuple[str, Any, str]] = []  # (kind, payload, label)
    images: list[Image] = []


class Cancel(msgspec.Struct, tag=True):
    rid: int


class Call(msgspec.Struct, tag=True):
    cid: int
    method: str
    args: list[Any] = []


class Accepted(msgspec.Struct, tag=True):
    rid: int
    refused: str | None = None  # None: accepted; "overloaded", "too_long" or "invalid"
    message: str = ""
    retry_after: float = 1.0
    limit: int = 0


class Outputs(msgspec.Struct, tag=True):
    events: list[tuple[int, Event]]


class Reply(msgspec.Struct, tag=True):
    cid: int
    result: Any = None
    error: str | None = None
    refused: str | None = None  # with error: "overloaded" (retry after retry_after) or "session_in_use"
    retry_after: float = 1.0


ToEngine = Submit | Cancel | Call
ToFrontend = Accepted | Outputs | Reply
# the calls a frontend may make, by name: (engine, *args) -> a msgspec-encodable result
CALLS: dict[str, Callable[..., Any]] = {
    "stats": lambda engine: engine.stats(),
    "describe": lambda engine: describe(engine),
    "list_sessions": lambda engine: engine.list_sessions(),
    "drop_session": lambda engine, name: engine.drop_session(name),
    "fork_session": lambda engine, source, target: engine.fork_session(source, target),
    "hibernate": lambda engine, name: engine.hibernate(name),
    "create_session": lambda engine, name: engine.create_session(name),
    "restore_session": lambda engine, name: engine.restore_session(name),
    "embed": lambda engine, prompts: engine.embed(prompts),
    "rank": lambda engine, prompts: engine.rank(prompts),
    "stale_sessions": lambda engine: engine.stale_sessions(),
}


def describe(engine: Engine) -> dict[str, Any]:
    """What a frontend needs to know of the engine and its model beyond the GGUF file."""
    model = engine.model
    return {
        "path": str(model.file.path),
        "vocab_size": int(model.architecture.vocab_size),
        "context_length": int(model.context_length),
        "max_context": int(engine.max_context),
        "batch_size": int(engine.batch_size),
        "plan": engine.plan,
        "backend": model.backend.describe(),
        "vision": model.vision.layout() if getattr(model, "vision", None) is not None else None,
    }


class LogitBias:
    """A logits processor that adds ``table[id]`` to each listed token's logit; it carries its spec, so an engine
    in another process rebuilds it with :func:`build_processor`."""

    def __init__(self, table: dict[int, float]):
        self.ids, self.values = list(table), list(table.values())
        self.label = "logit_bias"  # names it in the error if it fails
        self.spec = ("logit_bias", {str(k): float(v) for k, v in table.items()})

    def __call__(self, logits: np.ndarray, history: Any) -> np.ndarray:
        logits[self.ids] += self.values
        return logits


def logit_bias(table: dict[int, float]) -> LogitBias:
    """The :class:`LogitBias` processor of ``table`` ({token id: bias})."""
    return LogitBias(table)


def build_processor(spec: tuple[str, Any, str], model: Any) -> Callable[[np.ndarray, Any], np.ndarray]:
    """A logits processor from its spec ``(kind, payload, label)``, in the engine process.

    ``kind`` is ``"logit_bias"`` (payload ``{token id: bias}``, built in) or a lazy ``"module:function"`` reference:
    the engine process imports it and calls ``function(payload, model)`` for the processor (e.g. the server's
    JSON-schema constraint, ``"leat_server.constrained:rebuild"``; the frontend checked the payload already). Core
    names no such module itself, so it never imports the frontend's code or its dependencies."""
    kind, payload, label = spec
    if kind == "logit_bias":
        processor: Any = logit_bias({int(k): float(v) for k, v in payload.items()})
    elif ":" in kind:
        module_name, _, attr = kind.partition(":")
        try:
            function: Any = importlib.import_module(module_name)  # then the attribute path in it
            for part in attr.split("."):
                function = getattr(function, part)
        except Exception as e:
            raise LeatError(f"processor kind {kind!r}: cannot import it ({type(e).__name__}: {e})") from e
        processor = function(payload, model)
    else:
        raise LeatError(f"unknown processor kind {kind!r} (not 'logit_bias' nor a 'module:function' reference)")
    processor.label = label
    return processor


# -- the engine process's side -----------------------------------------------------------------------------
class _Frontend:
    """One connected frontend: its requests' handles, and one message per step with all their events."""

    def __init__(self, host: EngineHost, conn: Connection):
        self.host, self.conn = host, conn
        self.handles: dict[int, RequestHandle] = {}
        self.send_lock = threading.Lock()
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, message: ToFrontend) -> None:
        data = self.encoder.encode(message)
        with self.send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                pass  # the frontend is gone: its reader cancels its requests

    def sink(self, events: list[tuple[RequestHandle, Event]]) -> None:
        self.send(Outputs([(handle.remote_id, event) for handle, event in events]))
        for handle, event in events:
            if event.kind in ("done", "error"):
                self.handles.pop(handle.remote_id, None)

    def serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(ToEngine)
        try:
            while True:
                self.handle(decoder.decode(self.conn.recv_bytes()))
        except (EOFError, OSError):
            pass
        finally:  # a frontend that dies frees what its requests held at the engine's next step
            for handle in list(self.handles.values()):
                handle.cancel()
            self.conn.close()

    def handle(self, message: ToEngine) -> None:
        if isinstance(message, Submit):
            self.send(self.submit(message))
        elif isinstance(message, Cancel):
            handle = self.handles.get(message.rid)
            if handle is not None:
                handle.cancel()
        else:
            try:
                result = CALLS[message.method](self.host.engine, *message.args)
                self.send(Reply(message.cid, result))
            except Overloaded as e:
                self.send(Reply(message.cid, error=str(e), refused="overloaded", retry_after=e.retry_after))
            except SessionInUse as e:
                self.send(Reply(message.cid, error=str(e), refused="session_in_use"))
            except Exception as e:  # noqa: BLE001 - the caller gets the error
                self.send(
                    Reply(message.cid, error=f"{type(e).__name__}: {e}" if not isinstance(e, LeatError) else str(e))
                )

    def submit(self, message: Submit) -> Accepted:
        engine = self.host.engine
        try:
            processors = [build_processor(spec, engine.model) for spec in message.processors]
            if message.images and getattr(engine.model, "vision", None) is None:
                raise LeatError("this model has no vision projector for the prompt's images: load one with --mmproj")
            request = GenerationRequest(
                message.prompt_ids,
                message.max_tokens,
                SamplingParams(**message.sampling),
                session=message.session,
                client=message.client,
                logprobs=message.logprobs,
                ignore_eos=message.ignore_eos,
                processors=processors,
                images=[engine.model.vision.span(i.start, i.data) for i in message.images],
            )
            handle = engine.submit(request)
        except Overloaded as e:
            return Accepted(message.rid, "overloaded", str(e), retry_after=e.retry_after)
        except TooLong as e:
            return Accepted(message.rid, "too_long", str(e), limit=e.limit)
        except Exception as e:  # noqa: BLE001 - a bad request is refused, never the engine's end
            return Accepted(message.rid, "invalid", str(e) if isinstance(e, LeatError) else f"{type(e).__name__}: {e}")
        self.handles[message.rid] = handle
        handle.attach(self.sink, message.rid)
        return Accepted(message.rid)


class EngineHost:
    """Serves a started :class:`Engine` to frontends that connect to ``address``."""

    def __init__(self, engine: Engine, address: str, authkey: bytes):
        self.engine = engine
        self.listener = Listener(address, family="AF_UNIX", authkey=authkey)
        self.address = self.listener.address
        self.frontends: list[_Frontend] = []

    def serve_forever(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):
                return  # closed
            except Exception:  # noqa: BLE001, S112 - a client that failed the handshake is dropped
                continue
            frontend = _Frontend(self, conn)
            self.frontends = [f for f in self.frontends if not f.conn.closed] + [frontend]
            threading.Thread(target=frontend.serve, name="leat-frontend-link", daemon=True).start()

    def close(self) -> None:
        """Stop listening and drop every frontend's connection (their requests are cancelled)."""
        self.listener.close()
        for frontend in self.frontends:
            hang_up(frontend.conn)


def hang_up(conn: Connection) -> None:
    """End a connection for both ends, also waking a thread blocked reading it (close alone would not)."""
    with (
        contextlib.suppress(OSError, ValueError),
        socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s,
    ):
        s.shutdown(socket.SHUT_RDWR)


# -- the frontend's side -----------------------------------------------------------------------------------
class RemoteHandle(RequestHandle):
    """A request in the engine process, read like a local one; ``cancel()`` tells the engine."""

    def __init__(self, request_id: int, engine: RemoteEngine):
        super().__init__(request_id)
        self._engine = engine

    def cancel(self) -> None:
        if not self.cancelled.is_set():
            super().cancel()
            with contextlib.suppress(EngineUnavailable):  # an engine that went away holds nothing of it
                self._engine._send(Cancel(self.id))


class EngineUnavailable(LeatError):
    """The engine process is not there (it died, or is restarting): HTTP 503."""


class RemoteEngine:
    """The engine process as a frontend sees it: ``submit`` (raising ``Overloaded`` / ``TooLong`` / ``LeatError``
    as :meth:`Engine.submit` does), ``stats`` and the session calls. If the engine process goes away, every
    request in flight ends with an error event (``fault="unavailable"``) and calls raise
    :class:`EngineUnavailable` until it is back (the next call reconnects)."""

    def __init__(self, address: str, authkey: bytes, timeout: float = 60.0):
        self.address, self.authkey, self.timeout = address, authkey, timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._handles: dict[int, RemoteHandle] = {}
        self._waiting: dict[int, list[Any]] = {}  # rid or cid -> [threading.Event, answer]
        self._encoder = msgspec.msgpack.Encoder()
        self.info: dict[str, Any] = self.call("describe")

    @property
    def max_context(self) -> int:
        return int(self.info["max_context"])

    @property
    def plan(self) -> str:
        return str(self.info["plan"])

    def start(self) -> RemoteEngine:
        return self

    def stop(self) -> None:
        with self._lock:
            if self._conn is not None:
                hang_up(self._conn)

    def submit(self, request: GenerationRequest, **_: Any) -> RemoteHandle:
        rid = next(self._ids)
        handle = RemoteHandle(rid, self)
        self._handles[rid] = handle
        answer = self._ask(rid, self._submit_message(rid, request))
        if answer.refused is None:
            return handle
        self._handles.pop(rid, None)
        if answer.refused == "overloaded":
            raise Overloaded(answer.message, retry_after=answer.retry_after)
        if answer.refused == "too_long":
            raise TooLong(answer.message, limit=answer.limit)
        raise LeatError(answer.message)

    def call(self, method: str, *args: Any) -> Any:
        cid = -next(self._ids)  # negative: never a request's id
        reply = self._ask(cid, Call(cid, method, list(args)))
        if reply.refused == "overloaded":
            raise Overloaded(reply.error or "", retry_after=reply.retry_after)
        if reply.refused == "session_in_use":
            raise SessionInUse(reply.error or "")
        if reply.error is not None:
            raise LeatError(reply.error)
        return reply.result

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def list_sessions(self) -> list[dict[str, Any]]:
        return self.call("list_sessions")

    def drop_session(self, name: str) -> None:
        self.call("drop_session", name)

    def fork_session(self, source: str, target: str) -> None:
        self.call("fork_session", source, target)

    def hibernate(self, name: str) -> None:
        self.call("hibernate", name)

    def create_session(self, name: str) -> None:
        self.call("create_session", name)

    def restore_session(self, name: str) -> None:
        self.call("restore_session", name)

    def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        return self.call("embed", prompts)

    def rank(self, prompts: list[list[int]]) -> list[list[float]]:
        return self.call("rank", prompts)

    def stale_sessions(self) -> list[str]:
        return self.call("stale_sessions")

    # -- plumbing ----------------------------------------------------------------------------------------
    @staticmethod
    def _submit_message(rid: int, request: GenerationRequest) -> Submit:
        specs = []
        for processor in request.processors:
            spec = getattr(processor, "spec", None)
            if spec is None:
                raise LeatError(f"the logits processor {processor!r} has no spec and cannot reach the engine process")
            specs.append((spec[0], spec[1], str(getattr(processor, "label", spec[0]))))
        sampling = request.sampling
        if not isinstance(sampling, SamplingParams):
            raise LeatError("a request to the engine process carries resolved SamplingParams")
        return Submit(
            rid,
            [int(t) for t in request.prompt_ids],
            int(request.max_tokens),
            sampling.as_dict(),
            request.session,
            request.client,
            request.logprobs,
            request.ignore_eos,
            specs,
            list(request.images),  # type: ignore[arg-type]  # Image structs: a frontend's spans (leat_server.service)
        )

    def _connection(self) -> Connection:
        with self._lock:
            if self._conn is None or self._conn.closed:
                try:
                    self._conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
                except (OSError, EOFError) as e:
                    raise EngineUnavailable(f"the engine process is not reachable ({e}); retry shortly") from None
                threading.Thread(target=self._read, args=(self._conn,), name="leat-engine-link", daemon=True).start()
            return self._conn

    def _send(self, message: ToEngine) -> None:
        data = self._encoder.encode(message)
        conn = self._connection()
        with self._lock:
            try:
                conn.send_bytes(data)
            except OSError as e:
                raise EngineUnavailable(f"the engine process went away ({e}); retry shortly") from None

    def _ask(self, key: int, message: ToEngine) -> Any:
        waiter = self._waiting[key] = [threading.Event(), None]
        try:
            self._send(message)
            if not waiter[0].wait(self.timeout):
                raise EngineUnavailable(f"the engine process did not answer within {self.timeout:.0f} s")
        finally:
            self._waiting.pop(key, None)
        if waiter[1] is None:
            raise EngineUnavailable("the engine process went away before it answered; retry shortly")
        return waiter[1]

    def _read(self, conn: Connection) -> None:
        decoder = msgspec.msgpack.Decoder(ToFrontend)
        try:
            while True:
                message = decoder.decode(conn.recv_bytes())
                if isinstance(message, Outputs):
                    self._deliver(message.events)
                else:
                    key = message.rid if isinstance(message, Accepted) else message.cid
                    waiter = self._waiting.get(key)
                    if waiter is not None:
                        waiter[1] = message
                        waiter[0].set()
        except (EOFError, OSError):
            pass
        self._lost(conn)

    def _deliver(self, events: list[tuple[int, Event]]) -> None:
        out = []
        for rid, event in events:
            handle = self._handles.get(rid)
            if handle is not None:
                out.append((handle, event))
                if event.kind in ("done", "error"):
                    del self._handles[rid]
        deliver(out)

    def _lost(self, conn: Connection) -> None:
        """The engine process went away: every request in flight ends with an error, every waiting call too."""
        with self._lock:
            if self._conn is conn:
                self._conn = None
        handles, self._handles = self._handles, {}
        message = "the engine process stopped; the request was not finished (retry it)"
        deliver([(h, Event("error", error=message, fault="unavailable")) for h in handles.values()])
        for waiter in list(self._waiting.values()):
            waiter[0].set()


def serve_engine(engine: Engine, address: str, authkey: bytes, ready: Callable[[str], None] | None = None) -> None:
    """Run ``engine`` (started here) for frontends at ``address`` until the process ends."""
    engine.start()
    host = EngineHost(engine, address, authkey)
    if ready is not None:
        ready(host.address)
    try:
        host.serve_forever()
    finally:
        engine.stop()
