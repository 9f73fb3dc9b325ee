"""The commands leat-server adds to ``leat`` (through the ``register_commands`` hook): ``serve`` and ``receipts``.

``serve`` takes llama-server's and vLLM's names for the options they share (``-c/--ctx-size``,
``--max-model-len``, ``-np/--parallel``, ``--max-num-seqs``, ``-ctk/-ctv``, ``--kv-cache-dtype``, ``--api-key``,
``-t/--threads``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from leat.cli import _load, _mmproj, _select_plugins, _speculate, _threads
from leat.cli_options import (
    _registered,
    backend_option,
    default_kv,
    kv_option,
    mmproj_options,
    model_argument,
    plugins_option,
    precision_option,
    speculate_options,
    tensor_parallel_option,
    threads_option,
)
from leat.cli_progress import say
from leat.errors import LeatError

from leat_server import ServeOptions

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    from leat_server.models import parse_size

    try:
        return None if value is None else parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command()
@model_argument()
@click.argument("more_models", nargs=-1, metavar="[MODEL...]")
@click.option(
    "--host", default=ServeOptions.host, show_default=True, help="address to listen on (non-loopback needs API keys)"
)
@click.option("--port", default=ServeOptions.port, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    metavar="KEY",
    help="a key clients must send (repeatable; llama-server's --api-key). `leat keys add` makes named ones",
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="keys file: one key per line (llama-server's format) or the file `leat keys` writes "
    "[default: LEAT_HOME/keys.json, if it has keys]",
)
@click.option(
    "--allow-origin", "allow_origins", multiple=True, help="a browser origin allowed to call the server (* = any)"
)
@click.option(
    "--batch-size",
    "-np",
    "--parallel",
    "--max-num-seqs",
    "batch_size",
    default=ServeOptions.batch_size,
    show_default=True,
    type=click.IntRange(1),
    help="requests decoded together",
)
@click.option(
    "--max-context",
    "-c",
    "--ctx-size",
    "--max-model-len",
    "max_context",
    default=ServeOptions.max_context,
    type=click.IntRange(1),
    help="tokens per request (default: what fits, up to the model's)",
)
@kv_option
@click.option(
    "--kv-full-windows",
    "--swa-full",
    "kv_full_windows",
    is_flag=True,
    help="sliding-window layers keep KV for the whole context, not just their window",
)
@click.option(
    "--max-queue",
    default=ServeOptions.max_queue,
    show_default=True,
    type=click.IntRange(0),
    help="requests waiting beyond the free batch slots, then 429",
)
@click.option(
    "--prefill-chunk",
    default=ServeOptions.prefill_chunk,
    show_default=True,
    type=click.IntRange(1),
    help="the most tokens of one prompt in a scheduler step",
)
@click.option(
    "--prefill-budget",
    "--max-num-batched-tokens",
    "prefill_budget",
    default=None,
    type=click.IntRange(1),
    help="the most prompt tokens of a step over all prompts (several short prompts share a step); "
    "default: the backend's (2048 on cuda, 512 on cpu)",
)
@click.option(
    "--step-log",
    default=None,
    type=click.Path(dir_okay=False),
    help="append a JSON line per engine step to this file (when it began, its rows, tokens and prompt tokens, "
    "and where its time went: see docs/serving.md)",
)
@click.option(
    "--session-store",
    default=ServeOptions.session_store,
    type=click.Path(file_okay=False),
    help="directory where sessions are hibernated and kept across restarts",
)
@click.option(
    "--max-sessions",
    default=ServeOptions.max_sessions,
    show_default=True,
    type=click.IntRange(0),
    help="sessions kept; the least recently used go first",
)
@click.option(
    "--session-ttl",
    default=ServeOptions.session_ttl,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    metavar="SEC",
    help="an unused session is dropped",
)
@click.option(
    "--session-store-mb",
    default=ServeOptions.session_store_mb,
    show_default=True,
    type=click.IntRange(0),
    metavar="MB",
    help="session files kept in --session-store (least recently used removed)",
)
@click.option(
    "--template-timeout",
    default=ServeOptions.template_timeout,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    metavar="SEC",
    help="most a chat template may take to render one prompt",
)
@click.option("--receipts", is_flag=True, help="sign a receipt for every response (key in LEAT_HOME/receipts)")
@click.option(
    "--receipt-key",
    default=None,
    type=click.Path(dir_okay=False),
    help="Ed25519 private key file for receipts (made if missing)",
)
@click.option("--alias", default=None, help="model id clients see (default: the GGUF file's stem)")
@click.option(
    "--tool-parser",
    default=None,
    callback=_registered("chat_formats", "tool-call format"),
    help="tool-call format: a chat format a loaded plugin registers (leat plugins lists them)",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    default=ServeOptions.log_level,
    show_default=True,
    help="info logs each request with its timings",
)
@click.option(
    "--api-workers",
    default=None,
    type=click.IntRange(0, 64),
    help="API processes (HTTP, templates, tokenizing) beside an engine process of its own; 0: one process "
    "[default: 0 below 8 cores or with several models, else one per 8 cores up to 4]",
)
@click.option(
    "--models-config",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="a TOML file of models by name: [models.NAME] model = PATH, aliases, backend, batch_size, kv, max_context",
)
@click.option(
    "--models-memory",
    default=None,
    callback=_size,
    metavar="SIZE",
    help="most the loaded models may hold together (file + KV; e.g. 8G): the least recently used are unloaded",
)
@click.option(
    "--load-timeout",
    default=ServeOptions.load_timeout,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    metavar="SEC",
    help="how long a request waits for its model to load, then 503",
)
@mmproj_options
@backend_option
@precision_option
@threads_option
@tensor_parallel_option
@plugins_option
@speculate_options
def serve(
    model_name,
    more_models,
    backend,
    precision,
    threads,
    tensor_parallel,
    plugin_names,
    speculate,
    draft,
    api_keys,
    **options,
) -> None:
    """Serve MODEL over HTTP: OpenAI, Anthropic and Ollama APIs (see docs/api.md). Several MODELs, or --models-config,
    serve each by name: loaded when a request names it, unloaded when --models-memory is exceeded."""
    from leat.cli_models import model_label, running_server
    from leat.cli_progress import transfer
    from leat.pull import resolve

    from leat_server import open_keys
    from leat_server import serve as run_server

    if api_keys and options["api_key_file"]:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    _select_plugins(plugin_names)
    _threads(threads)
    options["allow_origins"] = list(options["allow_origins"])
    options["kv"] = options["kv"] or default_kv(precision)
    no_mmproj = options.pop("no_mmproj")
    opts = ServeOptions(model=model_name, backend=backend, precision=precision, **options)
    if more_models or opts.models_config:
        if opts.mmproj:
            raise click.UsageError("--mmproj is one model's projector; with several, set mmproj = PATH in its table")
        params = click.get_current_context().params
        given = [model_name] if params.get("model_arg") or params.get("model_opt") or not opts.models_config else []
        with _key_file(api_keys) as key_file:
            opts.api_key_file = key_file or opts.api_key_file
            serve_several(
                opts, [*given, *more_models], threads, speculate, draft, plugin_names, tensor_parallel, no_mmproj
            )
        return
    with _key_file(api_keys) as key_file:
        opts.api_key_file = key_file or opts.api_key_file
        open_keys(opts)  # before a pull: a server that would be refused should not fetch its model first
        path = resolve(model_name, progress=transfer())
        where = f"http://{'[' + opts.host + ']' if ':' in opts.host else opts.host}:{opts.port}"
        record = {"model": opts.alias or model_label(path), "path": str(path), "address": where}
        with running_server(record | {"size": path.stat().st_size}):
            # a function the engine process can run too (--api-workers: forked on Linux, elsewhere started afresh,
            # where it crosses as a pickle)
            load = functools.partial(
                load_model,
                model_name,
                backend,
                precision,
                threads,
                speculate,
                draft,
                plugin_names,
                opts.mmproj or (False if no_mmproj else None),
                tensor_parallel,
            )
            run_server(opts, load)


def serve_several(
    opts: ServeOptions, names: list[str], threads, speculate, draft, plugin_names, tensor_parallel=1, no_mmproj=False
) -> None:
    """``leat serve A B ...`` / ``--models-config``: each model by name, each its own engine (leat_server.models)."""
    from leat.cli_models import running_server
    from leat.cli_progress import transfer
    from leat.pull import resolve

    from leat_server import open_keys, serve_models
    from leat_server.models import specs_from

    open_keys(opts)
    specs = specs_from(names, opts.models_config, opts)
    for spec in specs:  # pulled now, as one model would be: a missing one is an error before the server starts
        resolve(spec.model, progress=transfer())
    where = f"http://{'[' + opts.host + ']' if ':' in opts.host else opts.host}:{opts.port}"
    record = {"model": ", ".join(s.name for s in specs), "path": "", "address": where, "size": 0, "models": []}
    with running_server(record) as update:

        def load(spec: Any) -> Any:
            o = spec.options
            mmproj = o.mmproj or (False if no_mmproj else None)
            return load_model(
                spec.model, o.backend, o.precision, threads, speculate, draft, plugin_names, mmproj, tensor_parallel
            )

        serve_models(opts, specs, load, changed=lambda models: update({"models": models.resident()}))


def load_model(
    model_name, backend, precision, threads, speculate, draft, plugin_names, mmproj=None, tensor_parallel=1
) -> Any:
    """Load a model to serve; ``mmproj``: its projector's path, None for the one pulled with it, False for none."""
    from leat.cli_models import model_label

    _select_plugins(plugin_names)
    _threads(threads)
    start = time.perf_counter()
    say(f"leat: loading {model_name}")
    model = _load(model_name, backend, precision, threads, tensor_parallel)
    _speculate(model, speculate, draft)
    _mmproj(model, mmproj or None, mmproj is not False)
    described = model.backend.describe()
    say(
        f"leat: loaded {model_label(model.file.path)} on {described['backend']} ({described['precision']}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return model


@contextlib.contextmanager
def _key_file(keys: tuple[str, ...]) -> Iterator[str | None]:
    """``--api-key`` values in a private file of llama-server's format (one key per line) while the server runs,
    so the engine and API processes read them as they read ``--api-key-file``."""
    if not keys:
        yield None
        return
    fd, path = tempfile.mkstemp(prefix="leat-keys-", suffix=".txt")  # created 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(keys) + "\n")
        yield path
    finally:
        Path(path).unlink(missing_ok=True)


@click.group()
def receipts() -> None:
    """Signed receipts of `leat serve --receipts` responses."""


@receipts.command("verify")
@click.argument("receipt", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option(
    "--public-key", required=True, type=click.Path(exists=True, dir_okay=False), help="the server's public key"
)
@click.option(
    "--text",
    "text_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="a file with the output text the receipt covers (streamed responses)",
)
def receipts_verify(receipt: str, public_key: str, text_file: str | None) -> None:
    """Check RECEIPT (a receipt, or a response body carrying one) against the server's public key."""
    from leat_server.receipts import load_public_key, verify

    with click.open_file(receipt, "r") as f:
        try:
            document = json.load(f)
        except ValueError as e:
            raise LeatError(f"{receipt} is not JSON: {e}") from None
    text = Path(text_file).read_text(encoding="utf-8") if text_file else None
    claims = verify(document, load_public_key(public_key), text)
    click.echo(json.dumps({"valid": True, "claims": claims}, indent=2))
