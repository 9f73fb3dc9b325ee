"""An engine in a process of its own, and the client that API frontends use to reach it.

The engine process owns the model, the backend and the scheduler; frontends (one or several processes) own
HTTP, templates, tokenizing and text. They talk over a local socket (``multiprocessing.connection``'s handshake with
an authentication key, then :class:`Frames`) in msgspec-encoded messages:

* frontend -> engine: :class:`Submit` (token ids, sampling parameters, processor specs, the images' encoded
  bytes as :class:`Image`), :class:`Cancel`, and :class:`Call` (stats, sessions, embeddings).
* engine -> frontend: :class:`Accepted` (or why not: overloaded, too long, invalid), :class:`Outputs` (every
  event of one step for this frontend's requests: one message per step per frontend, never one per token), and
  :class:`Reply`.

Logits processors are functions and do not cross processes: a processor that should carries a ``spec``, a
``(kind, payload)`` pair that :func:`build_processor` turns back into a processor in the engine process.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    "score": lambda engine, prompts, top: engine.score(prompts, top),
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


# -- the link: length-prefixed frames on a socket -------------------------------------------------------------
class Frames:
    """Messages on a connected socket, each an 8-byte length and its bytes. :meth:`read` returns every message that
    has arrived, taking them in one system call where they fit, and :meth:`send` writes several in one: a thread
    that reads one message at a time gives the interpreter lock up and waits to take it back (up to
    ``sys.getswitchinterval()``, 5 ms) for each, while another thread runs Python (the scheduler, an event loop),
    so a burst of requests crossed one per wait (64 small frames: 94 ms frame by frame, 5 ms at once, with one
    busy thread beside on the 2-core machine)."""

    HEADER = struct.Struct("!Q")

    def __init__(self, conn: Connection):  # its handshake done: the socket is the link's, conn is closed
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=socket.dup(conn.fileno()))
        conn.close()
        self.buffer, self.chunk = bytearray(), bytearray(1 << 20)  # received bytes; a read's, reused (no allocation)
        self.lock = threading.Lock()  # one writer at a time

    def read(self) -> list[bytes]:
        """The messages that have arrived, at least one (blocks until one has); EOFError once the peer is gone."""
        messages: list[bytes] = []
        while not messages:
            got = self.sock.recv_into(self.chunk)
            if not got:
                raise EOFError
            self.buffer += memoryview(self.chunk)[:got]
            at, size = 0, self.HEADER.size
            while len(self.buffer) - at >= size:
                (length,) = self.HEADER.unpack_from(self.buffer, at)
                if len(self.buffer) - at - size < length:
                    break
                messages.append(bytes(self.buffer[at + size : at + size + length]))
                at += size + length
            del self.buffer[:at]
        return messages

    def send(self, *messages: bytes) -> None:
        data = b"".join(self.HEADER.pack(len(m)) + m for m in messages)
        with self.lock:
            self.sock.sendall(data)

    def hang_up(self) -> None:
        """End the link for both ends, also waking a thread blocked reading it (close alone would not)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()


# -- the engine process's side -----------------------------------------------------------------------------
class _Frontend:
    """One connected frontend: its requests' handles, and one message per step with all their events."""

    def __init__(self, host: EngineHost, link: Frames):
        self.host, self.link = host, link
        self.handles: dict[int, RequestHandle] = {}
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, *messages: ToFrontend) -> None:
        try:
            self.link.send(*(self.encoder.encode(m) for m in messages))
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
                messages = [decoder.decode(data) for data in self.link.read()]
                accepted = [self.submit(m) for m in messages if isinstance(m, Submit)]
                if accepted:
                    self.send(*accepted)  # a burst's answers in one write
                for message in messages:
                    if isinstance(message, Cancel):
                        self.handle(message)
                    elif isinstance(message, Call):  # off this thread: a call that waits (a session's, an
                        self.host.calls.submit(self.handle, message)  # embedding) holds up no submit behind it
        except (EOFError, OSError):
            pass
        finally:  # a frontend that dies frees what its requests held at the engine's next step
            for handle in list(self.handles.values()):
                handle.cancel()
            self.link.close()

    def handle(self, message: Cancel | Call) -> None:
        if isinstance(message, Cancel):
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
                images=[engine.model.vision.span(i.start, i.data, i.length) for i in message.images],
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
        self.calls = ThreadPoolExecutor(4, thread_name_prefix="leat-engine-call")  # the frontends' Calls

    def serve_forever(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except (OSError, EOFError):
                return  # closed
            except Exception:  # noqa: BLE001, S112 - a client that failed the handshake is dropped
                continue
            frontend = _Frontend(self, Frames(conn))
            self.frontends = [f for f in self.frontends if f.link.sock.fileno() != -1] + [frontend]
            threading.Thread(target=frontend.serve, name="leat-frontend-link", daemon=True).start()

    def close(self) -> None:
        """Stop listening and drop every frontend's connection (their requests are cancelled)."""
        self.listener.close()
        for frontend in self.frontends:
            frontend.link.hang_up()
        self.calls.shutdown(wait=False, cancel_futures=True)  # a call still waiting keeps no process alive


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
        self._link: Frames | None = None
        self._handles: dict[int, RemoteHandle] = {}
        # rid or cid -> what takes its answer (None: lost): a function called on the link's thread, or the future
        # of a caller in an event loop (loop, future)
        self._waiting: dict[int, Callable[[Any], None] | tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
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
            if self._link is not None:
                self._link.hang_up()

    def submit(self, request: GenerationRequest, **_: Any) -> RemoteHandle:
        rid = next(self._ids)
        handle = self._handles[rid] = RemoteHandle(rid, self)
        return self._accepted(handle, self._ask(rid, self._submit_message(rid, request)))

    async def submit_async(self, request: GenerationRequest) -> RemoteHandle:
        """:meth:`submit` from an event loop, which goes on while the engine answers: a burst's requests reach
        the engine together rather than one round trip after another. A caller cancelled before the answer
        cancels the request."""
        rid = next(self._ids)
        handle = self._handles[rid] = RemoteHandle(rid, self)
        try:
            answer = await self._ask_async(rid, self._submit_message(rid, request))
        except asyncio.CancelledError:  # nobody reads it: the engine drops it (its last event goes nowhere)
            handle.cancel()
            self._handles.pop(rid, None)
            raise
        return self._accepted(handle, answer)

    def _accepted(self, handle: RemoteHandle, answer: Accepted) -> RemoteHandle:
        if answer.refused is None:
            return handle
        self._handles.pop(handle.id, None)
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

    def score(self, prompts: list[list[int]], top: int) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        return self.call("score", prompts, top)

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

    def _connection(self) -> Frames:
        with self._lock:
            if self._link is None:
                try:
                    self._link = Frames(Client(self.address, family="AF_UNIX", authkey=self.authkey))
                except (OSError, EOFError) as e:
                    raise EngineUnavailable(f"the engine process is not reachable ({e}); retry shortly") from None
                threading.Thread(target=self._read, args=(self._link,), name="leat-engine-link", daemon=True).start()
            return self._link

    def _send(self, message: ToEngine) -> None:
        data = self._encoder.encode(message)
        try:
            self._connection().send(data)
        except OSError as e:
            raise EngineUnavailable(f"the engine process went away ({e}); retry shortly") from None

    def _ask(self, key: int, message: ToEngine) -> Any:
        answered, box = threading.Event(), [None]

        def take(answer: Any) -> None:
            box[0] = answer
            answered.set()

        self._waiting[key] = take
        try:
            self._send(message)
            if not answered.wait(self.timeout):
                raise EngineUnavailable(f"the engine process did not answer within {self.timeout:.0f} s")
        finally:
            self._waiting.pop(key, None)
        return _answered(box[0])

    async def _ask_async(self, key: int, message: ToEngine) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._waiting[key] = (loop, future)
        try:
            self._send(message)
            return _answered(await asyncio.wait_for(future, self.timeout))
        except TimeoutError:
            raise EngineUnavailable(f"the engine process did not answer within {self.timeout:.0f} s") from None
        finally:
            self._waiting.pop(key, None)

    def _read(self, link: Frames) -> None:
        decoder = msgspec.msgpack.Decoder(ToFrontend)
        try:
            while True:
                events, answers = [], []
                for message in map(decoder.decode, link.read()):
                    if isinstance(message, Outputs):
                        events += message.events
                    else:
                        answers.append((message.rid if isinstance(message, Accepted) else message.cid, message))
                self._deliver(events)
                self._answer(answers)
        except (EOFError, OSError):
            pass
        self._lost(link)

    def _answer(self, answers: list[tuple[int, Any]]) -> None:
        """Give each waiting caller its answer; those in an event loop with one wake-up of each loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for key, answer in answers:
            waiter = self._waiting.get(key)
            if isinstance(waiter, tuple):
                by_loop.setdefault(waiter[0], []).append((waiter[1], answer))
            elif waiter is not None:
                waiter(answer)
        for loop, settle in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle_all, settle)

    def _deliver(self, events: list[tuple[int, Event]]) -> None:
        out = []
        for rid, event in events:
            handle = self._handles.get(rid)
            if handle is not None:
                out.append((handle, event))
                if event.kind in ("done", "error"):
                    del self._handles[rid]
        deliver(out)

    def _lost(self, link: Frames) -> None:
        """The engine process went away: every request in flight ends with an error, every waiting call too."""
        with self._lock:
            if self._link is link:
                self._link = None
        link.close()
        handles, self._handles = self._handles, {}
        message = "the engine process stopped; the request was not finished (retry it)"
        deliver([(h, Event("error", error=message, fault="unavailable")) for h in handles.values()])
        self._answer([(key, None) for key in list(self._waiting)])


def _answered(answer: Any) -> Any:
    if answer is None:
        raise EngineUnavailable("the engine process went away before it answered; retry shortly")
    return answer


def _settle_all(settle: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, answer in settle:
        if not future.done():
            future.set_result(answer)


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
