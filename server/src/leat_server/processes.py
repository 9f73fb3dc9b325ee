"""``leat serve --api-workers N``: the engine in a process of its own, N API frontend processes, a supervisor.

The supervisor (the process ``leat serve`` started) binds the listening socket, starts the engine process (model,
backend, scheduler: :mod:`leat.engine_process`) and, while it loads, N frontends that share the socket, each
running the Litestar app with a :class:`~leat.engine_process.RemoteEngine` once the engine answers. When every
frontend serves, it prints where the start-up time went (:mod:`leat_server.startup`). It restarts any
that dies: a frontend's requests are cancelled in the engine at its next step; an engine's requests in flight end
with a 503 in their frontends, which reconnect to the new engine. SIGTERM or Ctrl-C stops them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from leat.errors import LeatError

READY_TIMEOUT = 600.0  # a large model's first load (and its kernels' compilation) on a slow disk


class FrontendModel:
    """What a frontend needs of the model, without its weights: the GGUF's metadata, tokenizer and chat template,
    and from the engine process its vocabulary size, context and backend. ``early``: (file, tokenizer and chat
    template) read while the engine process was still loading, used when it is the file the engine loaded."""

    def __init__(self, info: dict[str, Any], early: tuple[Any, Any] | None = None):
        from types import SimpleNamespace

        from leat.model import text_parts
        from leat.modelfile import ModelFile

        if early is not None and str(early[0].path) == str(info["path"]):
            self.file, (self.tokenizer, self.chat_template) = early
        else:
            self.file = ModelFile(info["path"])
            self.tokenizer, self.chat_template = text_parts(self.file)
        self.architecture = SimpleNamespace(vocab_size=info["vocab_size"])
        self.context_length = info["context_length"]
        self.backend = SimpleNamespace(describe=lambda: dict(info["backend"]))


def engine_main(options: Any, loader: Any, address: str, authkey: bytes, ready: Any, listening: Any = None) -> None:
    """The engine process: load the model, start the engine, serve frontends at ``address``. Forked (see
    :class:`Supervisor`), it first lets go of what it inherited: the supervisor's signal handlers and ``listening``,
    the HTTP socket."""
    from leat.engine_process import serve_engine

    from leat_server import build_engine

    marks = {"entered": time.time()}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor stops it (SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if listening is not None:
        listening.close()
    sys.setswitchinterval(0.0005)  # the scheduler gets the lock back quickly from the frontend links' threads
    try:
        model = loader()
        marks["loaded"] = time.time()
        engine = build_engine(options, model)
    except Exception as e:  # noqa: BLE001 - reported by the supervisor as one line
        ready.send(("failed", f"{type(e).__name__}: {e}" if not isinstance(e, LeatError) else str(e)))
        return

    def serving(_: str) -> None:
        marks["ready"] = time.time()
        ready.send(("ready", (engine.plan, marks)))

    serve_engine(engine, address, authkey, ready=serving)


def frontend_main(options: Any, sock: socket.socket, address: str, authkey: bytes, ready: Any = None) -> None:
    """A frontend process: the Litestar app on the shared socket, its engine the engine process. It starts with
    the engine process, not after it: imports and the tokenizer are done while the model loads over there. Its
    steps' times go to ``ready`` once it serves."""
    marks = {"entered": time.time()}
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # forked: not the supervisor's handler
    # the engine link's reader thread gets the interpreter lock back quickly from the event loop, busy with every
    # stream's chunks: each step's events and each answer waited up to the default 5 ms (a submit's round trip
    # beside a busy thread: 11 ms at 5 ms, 1.5 ms at 0.5 ms, on the 2-core machine)
    sys.setswitchinterval(0.0005)
    import uvicorn
    from leat.keys import KeyStore

    import leat_server.app  # noqa: F401 - imported now, while the engine process loads
    from leat_server import build_app
    from leat_server.startup import Server

    early = _read_model_early(options.model)
    _rehearse(options, early)
    marks["prepared"] = time.time()
    engine = _connect(address, authkey)
    marks["connected"] = time.time()
    app = build_app(options, FrontendModel(engine.info, early), engine, KeyStore(options.api_key_file))
    marks["built"] = time.time()
    config = uvicorn.Config(
        app,
        log_level=options.log_level,
        access_log=False,  # leat_server.requestlog logs requests, with timings
        lifespan="on",
        timeout_graceful_shutdown=5,
    )

    def serving() -> None:
        if ready is not None:
            marks["ready"] = time.time()
            ready.send(marks)
            ready.close()

    Server(config, serving).run(sockets=[sock])


def _read_model_early(name: str) -> tuple[Any, Any] | None:
    """The model file, tokenizer and chat template, if ``name`` is already a local file (or pulled)."""
    from leat.model import text_parts
    from leat.modelfile import ModelFile
    from leat.pull import resolve

    try:
        file = ModelFile(resolve(name, pull=False))
        return file, text_parts(file)
    except Exception:  # noqa: BLE001 - only a head start: the engine's own answer (info["path"]) decides
        return None


def _rehearse(options: Any, early: tuple[Any, Any] | None) -> None:
    """Build the app once against the model file alone, before the engine answers: what building it loads the first
    time (Litestar's plugins, the chat formats, the metrics) is then loaded while the model loads, and the app that
    serves is built in a third of the time once the engine has said what it runs (0.08 s instead of 0.2-0.3 s here,
    the llama-bpe vocabulary)."""
    from leat.keys import KeyStore

    from leat_server import build_app

    if early is None:
        return
    info = {"path": str(early[0].path), "vocab_size": 0, "context_length": 0, "backend": {}}
    rehearsal = dataclasses.replace(options, receipts=False, receipt_key=None)  # no signer: it hashes the file
    try:
        build_app(rehearsal, FrontendModel(info, early), None, KeyStore(options.api_key_file), log=lambda _: None)
    except Exception:  # noqa: BLE001 - only a head start: the app that serves is built (and fails) after it
        return


def _connect(address: str, authkey: bytes) -> Any:
    """A RemoteEngine once the engine process answers (it may still be loading)."""
    from leat.engine_process import EngineUnavailable, RemoteEngine

    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            return RemoteEngine(address, authkey)
        except EngineUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Supervisor:
    """Starts, watches and restarts the engine process and the frontends. They are forked where fork is safe to use
    (Linux; the supervisor has no other thread and has not touched a device): each starts with this process's
    imports instead of a fresh interpreter's (~0.3 s here, on the engine's way to the first request)."""

    def __init__(self, options: Any, loader: Any, workers: int):
        self.options, self.loader, self.workers = options, loader, workers
        self.context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        self.folder = tempfile.mkdtemp(prefix="leat-serve-")
        self.address = str(Path(self.folder) / "engine.sock")
        self.authkey = os.urandom(32)
        from leat_server.startup import listening_socket

        self.sock = listening_socket(options.host, options.port)
        self.engine: Any = None
        self.frontends: list[Any] = []
        self.stopping = threading.Event()
        self.engine_marks: dict[str, float] = {}  # the engine process's start-up steps (leat_server.startup)
        self.serving: dict[int, Any] = {}  # frontend -> the pipe it reports on once it serves
        self.served: dict[int, dict[str, float]] = {}  # frontend -> its start-up steps, once it serves

    def start_engine(self, then: Any = None) -> str:
        """Start the engine process (and ``then()`` at once, while it loads); its plan once it is ready (a
        LeatError if it fails to load)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        receive, send = self.context.Pipe(duplex=False)
        forked = self.context.get_start_method() == "fork"
        args = (self.options, self.loader, self.address, self.authkey, send, self.sock if forked else None)
        self.engine = self.context.Process(target=engine_main, args=args, name="leat-engine", daemon=True)
        self.engine.start()
        send.close()
        if then is not None:
            then()
        if not receive.poll(READY_TIMEOUT):
            raise LeatError(f"the engine process did not get ready within {READY_TIMEOUT:.0f} s")
        try:
            state, detail = receive.recv()
        except EOFError:
            raise LeatError(f"the engine process exited with {self.engine.exitcode} while loading") from None
        if state != "ready":
            raise LeatError(detail)
        plan, self.engine_marks = detail
        return plan

    def start_frontend(self, i: int) -> Any:
        self.serving[i], send = self.context.Pipe(duplex=False)
        args = (self.options, self.sock, self.address, self.authkey, send)
        process = self.context.Process(target=frontend_main, args=args, name=f"leat-api-{i}", daemon=True)
        process.start()
        send.close()
        return process

    def run(self, announce: Any = print, ready: Any = None) -> None:
        """Serve until SIGTERM or Ctrl-C: ``announce(plan)`` once the engine is ready, ``ready(line)`` once every
        frontend serves (the line says where the time went: :mod:`leat_server.startup`)."""

        def start_frontends() -> None:
            self.frontends = [self.start_frontend(i) for i in range(self.workers)]

        start = time.time()  # where /proc does not say when this process started
        try:
            plan = self.start_engine(then=start_frontends)
        except BaseException:
            self.stop()
            raise
        announce(plan)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        told = False
        try:
            while not self.stopping.is_set():
                self.hear(0.2)
                if not told and len(self.served) == self.workers:
                    from leat_server.startup import process_start, processes_line

                    line = processes_line(process_start(start), self.engine_marks, list(self.served.values()))
                    (ready or functools.partial(print, flush=True))(line)
                    told = True
                self.watch()
        finally:
            self.stop()

    def hear(self, timeout: float) -> None:
        """Wait up to ``timeout`` for frontends that report they serve."""
        if not self.serving:
            self.stopping.wait(timeout)
            return
        for conn in multiprocessing.connection.wait(list(self.serving.values()), timeout):
            i = next(i for i, c in self.serving.items() if c is conn)
            del self.serving[i]
            with contextlib.suppress(EOFError):  # it exited first: watch() starts it again, with a new pipe
                self.served[i] = conn.recv()
            conn.close()

    def watch(self) -> None:
        if not self.engine.is_alive():
            print(f"leat: the engine process exited ({self.engine.exitcode}); restarting it", flush=True)
            self.start_engine()
        for i, process in enumerate(self.frontends):
            if not process.is_alive():
                print(f"leat: API worker {i} exited ({process.exitcode}); restarting it", flush=True)
                self.frontends[i] = self.start_frontend(i)

    def stop(self) -> None:
        for process in [*self.frontends, self.engine]:
            if process is not None and process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 8
        for process in [*self.frontends, self.engine]:
            if process is not None:
                process.join(max(0.1, deadline - time.monotonic()))
                if process.is_alive():
                    process.kill()
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
            os.rmdir(self.folder)
