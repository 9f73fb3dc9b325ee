"""``leat serve``: an OpenAI- and Anthropic-compatible HTTP server (Litestar under uvicorn) on the engine.

Modules: :mod:`~leat_server.app` (routes), :mod:`~leat_server.schemas` (msgspec request bodies),
:mod:`~leat_server.service` (prompts, jobs, output streams), :mod:`~leat_server.openai_api`,
:mod:`~leat_server.anthropic_api`, :mod:`~leat_server.responses_api` (each API's shapes),
:mod:`~leat_server.toolcalls` (tool-call and reasoning parsers), :mod:`~leat_server.constrained`
(JSON-schema constrained decoding), :mod:`~leat_server.security` (Host/Origin checks, API keys),
:mod:`~leat_server.metrics` (Prometheus). The endpoints and fields are documented in docs/api.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leat.errors import LeatError
from leat.options import EngineOptions


@dataclass
class ServeOptions:
    """What ``leat serve`` was asked for; the engine's options default as :class:`~leat.options.EngineOptions`."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    backend: str | None = None
    precision: str = "f32"
    api_key_file: str | None = None
    allow_origins: list[str] = field(default_factory=list)
    batch_size: int = EngineOptions.batch_size
    max_context: int | None = EngineOptions.max_context
    kv: str = EngineOptions.kv
    kv_full_windows: bool = not EngineOptions.window_pages
    max_queue: int = EngineOptions.max_queue
    prefill_chunk: int = EngineOptions.prefill_chunk
    prefill_budget: int | None = EngineOptions.prefill_budget  # None: the backend's prompt tokens per step
    session_store: str | None = EngineOptions.session_store
    max_sessions: int = 256
    session_ttl: float = 24 * 3600.0
    session_store_mb: int = 1024
    template_timeout: float = 5.0
    speculate: str | None = None
    draft: str | None = None
    receipts: bool = False
    receipt_key: str | None = None
    alias: str | None = None
    tool_parser: str | None = None
    log_level: str = "info"  # info: a line per request with its timings (leat_server.requestlog)
    api_workers: int | None = None  # 0: HTTP and the engine in one process; N: an engine process and N API processes;
    # None: default_api_workers()
    models_config: str | None = None  # a TOML file of models by name (leat_server.models)
    models_memory: int | None = None  # bytes the loaded models may hold together; None: no limit
    load_timeout: float = 120.0  # how long a request waits for its model to load
    mmproj: str | None = None  # the model's vision projector (an mmproj GGUF): image parts in prompts
    step_log: str | None = None  # a JSON line per engine step goes to this file (leat_server.steplog)

    def engine_options(self) -> EngineOptions:
        """The engine's options these set, the rest at their defaults."""
        return EngineOptions(
            batch_size=self.batch_size,
            max_context=self.max_context,
            kv=self.kv,
            window_pages=not self.kv_full_windows,
            max_queue=self.max_queue,
            prefill_chunk=self.prefill_chunk,
            prefill_budget=self.prefill_budget,
            session_store=self.session_store,
            profile=self.step_log is not None,
        )


def check_bind(host: str, keys: Any) -> None:
    from leat_server.security import is_loopback

    if not is_loopback(host) and not keys:
        raise LeatError(
            f"refusing to serve on {host} without API keys: anyone who can reach it could use it. "
            "Add a key with `leat keys add NAME` (or give --api-key-file FILE), or serve on 127.0.0.1"
        )


def build_engine(options: ServeOptions, model: Any) -> Any:
    """The engine (not started) for a loaded ``model``, its session store within the options' limits."""
    from leat.engine import Engine
    from leat.sessions import StoreLimits

    engine = Engine(model, options.engine_options(), speculation=getattr(model, "speculation", None))
    engine.sessions.limits = StoreLimits(options.max_sessions, options.session_ttl, options.session_store_mb << 20)
    engine.sessions.trim_disk()
    if options.step_log is not None:
        from leat_server.steplog import StepLog

        StepLog(engine, options.step_log).start()
    return engine


def build_service(options: ServeOptions, model: Any, engine: Any, metrics: Any, name: str, log: Any = print) -> Any:
    """The :class:`~leat_server.service.Service` the endpoints see for one loaded ``model`` and its ``engine``."""
    from leat.chat import RenderLimits

    from leat_server.service import Service

    backend = model.backend.describe().get("backend", "")
    receipts = None
    if options.receipts or options.receipt_key:
        from leat_server.receipts import Signer, default_key_path, load_or_create_key, public_key_path

        key_path = Path(options.receipt_key).expanduser() if options.receipt_key else default_key_path()
        receipts = Signer(load_or_create_key(key_path), model.file, backend)
        log(f"leat: signing receipts; public key {public_key_path(key_path)}")
    return Service(
        model,
        engine,
        name,
        metrics=metrics,
        receipts=receipts,
        tool_parser=options.tool_parser,
        backend_name=backend,
        template_limits=RenderLimits(seconds=options.template_timeout),
    )


def build_app(options: ServeOptions, model: Any, engine: Any, keys: Any, log: Any = print) -> Any:
    """The ASGI app over ``engine``: an :class:`~leat.engine.Engine` in this process, or a
    :class:`~leat.engine_process.RemoteEngine` (``model`` then holds only the file, tokenizer and template)."""
    from leat_server.app import create_app
    from leat_server.metrics import Metrics
    from leat_server.models import Models

    name = options.alias or Path(model.file.path).stem
    metrics = Metrics(engine)
    models = Models.single(build_service(options, model, engine, metrics, name, log), name)
    return create_app(models, metrics, keys, options.host, options.port, options.allow_origins)


def build(options: ServeOptions, model: Any, keys: Any, log: Any = print) -> tuple[Any, Any]:
    """The ASGI app and its engine (not started), both in this process, for a loaded ``model``."""
    engine = build_engine(options, model)
    return build_app(options, model, engine, keys, log), engine


def open_keys(options: ServeOptions) -> Any:
    """The keys the server will check; refuses a missing --api-key-file, and a remote bind without keys."""
    from leat.keys import KeyStore

    if options.api_key_file and not Path(options.api_key_file).expanduser().exists():
        raise LeatError(
            f"--api-key-file {options.api_key_file} does not exist; make it with "
            f"`leat keys add NAME --file {options.api_key_file}`"
        )
    keys = KeyStore(options.api_key_file)
    check_bind(options.host, keys)
    return keys


def default_api_workers(cores: int | None = None) -> int:
    """API processes when ``--api-workers`` is not given: none (one process) below 8 cores, where the frontends'
    work would take cores from the engine's threads; else one per 8 cores, up to 4. On the H200's 16-core host two
    frontends served 4,421 tok/s at 64 streams where one process served 4,183 (TTFT p50 183 / 227 ms; one device
    call, docs/benchmarks.md): the HTTP thread no longer shares the scheduler's interpreter lock."""
    cores = cores or os.cpu_count() or 1
    return 0 if cores < 8 else min(4, cores // 8)


def serve(options: ServeOptions, load_model: Any) -> None:
    keys = open_keys(options)
    where = f"http://{'[' + options.host + ']' if ':' in options.host else options.host}:{options.port}"
    if options.api_workers is None:
        options = dataclasses.replace(options, api_workers=default_api_workers())
    if options.api_workers:
        serve_processes(options, load_model, where, keys)
        return
    from leat_server.startup import listening_socket, one_process_line, process_start

    marks = {"loading": time.time()}  # also when this process started, where /proc does not say
    sock = listening_socket(options.host, options.port, listen=False)
    model = load_model()
    marks["loaded"] = time.time()
    app, engine = build(options, model, keys)
    # The scheduler thread needs the interpreter lock for ~1 ms of host work between two device steps; the HTTP
    # thread, busy with every stream's chunks, would otherwise keep it for up to the default 5 ms switch interval
    # while the device idles (an engine process of its own would remove the contention).
    sys.setswitchinterval(0.0005)
    engine.start()
    marks["built"] = time.time()
    print(
        f"leat: serving {Path(model.file.path).stem} on {where} ({engine.plan}; keys {'on' if keys else 'off'})",
        flush=True,
    )

    def ready() -> None:
        print(one_process_line(process_start(marks["loading"]), marks | {"ready": time.time()}), flush=True)

    try:
        _run(app, options, sock, ready)
    finally:
        engine.stop()


def _run(app: Any, options: ServeOptions, sock: Any, ready: Any = lambda: None) -> None:
    import uvicorn

    from leat_server.startup import Server

    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        access_log=False,  # leat_server.requestlog logs requests, with timings
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    Server(config, ready).run(sockets=[sock])


def serve_models(options: ServeOptions, specs: list[Any], load_model: Any, changed: Any = None) -> None:
    """Several models by name (leat_server.models): the first loaded now, the others when a request names them.
    ``load_model(spec)`` loads one model; ``changed(models)`` hears of every load and unload."""
    from leat_server.app import create_app
    from leat_server.metrics import Metrics
    from leat_server.models import Models, estimate_bytes
    from leat_server.startup import listening_socket

    keys = open_keys(options)
    where = f"http://{'[' + options.host + ']' if ':' in options.host else options.host}:{options.port}"
    metrics: Any = None

    def load(spec: Any) -> Any:
        model = load_model(spec)
        engine = build_engine(spec.options, model)
        service = build_service(spec.options, model, engine, metrics, spec.name)
        engine.start()
        print(f"leat: {spec.name} ready ({engine.plan})", flush=True)
        return service

    models = Models(
        specs, load, estimate_bytes, options.models_memory, options.load_timeout, changed=changed or (lambda m: None)
    )
    metrics = Metrics(models)
    app = create_app(models, metrics, keys, options.host, options.port, options.allow_origins)
    sys.setswitchinterval(0.0005)  # as serve() does, for each model's scheduler thread
    sock = listening_socket(options.host, options.port, listen=False)
    models.preload()
    names = ", ".join(spec.name for spec in specs)
    budget = f"; up to {options.models_memory / 2**30:.2f} GiB loaded" if options.models_memory else ""
    print(f"leat: serving {names} on {where} (keys {'on' if keys else 'off'}{budget})", flush=True)
    try:
        _run(app, options, sock)
    finally:
        models.stop()


def serve_processes(options: ServeOptions, load_model: Any, where: str, keys: Any) -> None:
    """``--api-workers N``: the engine in a process of its own, N API frontend processes (leat_server.processes)."""
    from leat.pull import resolve

    from leat_server.processes import Supervisor

    supervisor = Supervisor(options, load_model, options.api_workers)
    name = options.alias or resolve(options.model, pull=False).stem

    def announce(plan: str) -> None:
        workers = ", ".join(str(p.pid) for p in supervisor.frontends)
        print(
            f"leat: serving {name} on {where} ({plan}; keys {'on' if keys else 'off'}; "
            f"engine process {supervisor.engine.pid}, API workers {workers})",
            flush=True,
        )

    supervisor.run(announce)
