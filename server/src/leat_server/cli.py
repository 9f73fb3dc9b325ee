"""The commands leat-server adds to ``leat`` (through the ``register_commands`` hook): ``serve`` and ``receipts``."""

from __future__ import annotations

import functools
import json
from typing import Any

import click
from leat.cli import (
    _load,
    _select_plugins,
    _speculate,
    backend_option,
    plugins_option,
    precision_option,
    speculate_options,
)
from leat.errors import LeatError

from leat_server import ServeOptions


@click.command()
@click.argument("model_name", metavar="MODEL", default="default")
@click.option(
    "--host", default=ServeOptions.host, show_default=True, help="address to listen on (non-loopback needs API keys)"
)
@click.option("--port", default=ServeOptions.port, show_default=True, type=int)
@click.option("--api-key-file", default=None, help="keys file (default: the one `leat keys` writes, if it has keys)")
@click.option(
    "--allow-origin", "allow_origins", multiple=True, help="a browser origin allowed to call the server (* = any)"
)
@click.option(
    "--batch-size", default=ServeOptions.batch_size, show_default=True, type=int, help="requests decoded together"
)
@click.option(
    "--max-context",
    default=ServeOptions.max_context,
    type=int,
    help="tokens per request (default: what fits, up to the model's)",
)
@click.option("--kv", default=ServeOptions.kv, show_default=True, help="KV cache storage: f32, f16, q8_0")
@click.option(
    "--kv-full-windows",
    is_flag=True,
    help="sliding-window layers keep KV for the whole context, not just their window (llama.cpp's --swa-full)",
)
@click.option(
    "--max-queue",
    default=ServeOptions.max_queue,
    show_default=True,
    type=int,
    help="requests waiting beyond the free batch slots, then 429",
)
@click.option(
    "--prefill-chunk",
    default=ServeOptions.prefill_chunk,
    show_default=True,
    type=int,
    help="prompt tokens per scheduler step",
)
@click.option(
    "--session-store",
    default=ServeOptions.session_store,
    help="directory where sessions are hibernated and kept across restarts",
)
@click.option(
    "--max-sessions",
    default=ServeOptions.max_sessions,
    show_default=True,
    type=int,
    help="sessions kept; the least recently used go first",
)
@click.option(
    "--session-ttl",
    default=ServeOptions.session_ttl,
    show_default=True,
    type=float,
    metavar="SEC",
    help="an unused session is dropped",
)
@click.option(
    "--session-store-mb",
    default=ServeOptions.session_store_mb,
    show_default=True,
    type=int,
    metavar="MB",
    help="session files kept in --session-store (least recently used removed)",
)
@click.option(
    "--template-timeout",
    default=ServeOptions.template_timeout,
    show_default=True,
    type=float,
    metavar="SEC",
    help="most a chat template may take to render one prompt",
)
@click.option("--receipts", is_flag=True, help="sign a receipt for every response (key in LEAT_HOME/receipts)")
@click.option("--receipt-key", default=None, help="Ed25519 private key file for receipts (made if missing)")
@click.option("--alias", default=None, help="model id clients see (default: the GGUF file name)")
@click.option(
    "--tool-parser",
    default=None,
    help="tool-call format: a chat format a loaded plugin registers (leat plugins lists them)",
)
@click.option("--log-level", default=ServeOptions.log_level, show_default=True, help="uvicorn log level")
@click.option(
    "--api-workers",
    default=ServeOptions.api_workers,
    show_default=True,
    type=click.IntRange(0, 64),
    help="API processes (HTTP, templates, tokenizing) beside an engine process of its own; 0: one process",
)
@backend_option
@precision_option
@plugins_option
@speculate_options
def serve(model_name, backend, precision, plugin_names, speculate, draft, **options) -> None:
    """Serve MODEL over HTTP: OpenAI and Anthropic APIs (see docs/api.md)."""
    from leat_server import serve as run_server

    _select_plugins(plugin_names)
    options["allow_origins"] = list(options["allow_origins"])
    opts = ServeOptions(model=model_name, backend=backend, precision=precision, **options)
    # a function the engine process can run too (--api-workers: it is started afresh, not forked)
    run_server(opts, functools.partial(load_model, model_name, backend, precision, speculate, draft, plugin_names))


def load_model(model_name, backend, precision, speculate, draft, plugin_names) -> Any:
    _select_plugins(plugin_names)
    model = _load(model_name, backend, precision)
    _speculate(model, speculate, draft)
    return model


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
    from pathlib import Path

    from leat_server.receipts import load_public_key, verify

    with click.open_file(receipt, "r") as f:
        try:
            document = json.load(f)
        except ValueError as e:
            raise LeatError(f"{receipt} is not JSON: {e}") from None
    text = Path(text_file).read_text(encoding="utf-8") if text_file else None
    claims = verify(document, load_public_key(public_key), text)
    click.echo(json.dumps({"valid": True, "claims": claims}, indent=2))
