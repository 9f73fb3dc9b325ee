"""Every `leat` command answers --help, and a bad value for any of its options or arguments with one line naming
what was wrong (after any progress lines): never a traceback, never click's three-line usage block.

Bad values are derived from each parameter's type (a word where a number goes, a number below a range, a choice
that is not offered, a path that does not exist or is of the wrong kind), so a new option is covered as soon as it
is added; a parameter whose type accepts any text must be listed in FREE_TEXT (with why no value is bad) or in
CASES (a value that is bad, and what the error must say).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import click
import pytest
from leat import cli as leat_cli

pytest.importorskip("leat_server")

MISSING = "/nonexistent/leat-test/missing.gguf"

# (command path, parameter name): why any text is a good value
FREE_TEXT = {
    ("run", "prompt"): "the message",
    ("run", "system"): "the system message",
    ("generate", "prompt"): "the text to continue",
    ("serve", "alias"): "any model id",
    ("serve", "allow_origins"): "an origin is matched as written",
    ("serve", "api_keys"): "any text is a key",
    ("ray serve", "address"): "Ray's own address forms (auto, ray://HOST:PORT), read by ray.init",
}

# (command path, parameter name): (bad value, extra arguments, text the error must contain)
CASES = {
    "model_arg": (MISSING, [], "missing.gguf"),
    "model_opt": (MISSING, [], "missing.gguf"),
    "plugin_names": ("no-such-plugin", [], "no-such-plugin"),
    ("pull", "name"): ("no such model", [], "no such model"),
    ("rm", "names"): ("no-such-model", [], "no-such-model"),
    ("serve", "host"): ("0.0.0.0", ["TINY"], "API keys"),
    ("serve", "draft"): (MISSING, ["TINY"], "missing.gguf"),
    ("serve", "more_models"): (MISSING, ["TINY"], "missing.gguf"),
    ("run", "draft"): (MISSING, ["TINY"], "missing.gguf"),
    ("generate", "draft"): (MISSING, ["TINY"], "missing.gguf"),
    ("bench", "draft"): (MISSING, ["TINY"], "missing.gguf"),
    ("keys add", "name"): ("no spaces allowed", [], "key name"),
    ("keys remove", "name"): ("nobody", [], "no key named nobody"),
}


def commands() -> list[tuple[str, click.Command]]:
    """Every command, subcommands of groups by their path ('keys add')."""
    found = []
    ctx = click.Context(leat_cli.cli)
    for name in leat_cli.cli.list_commands(ctx):
        command = leat_cli.cli.get_command(ctx, name)
        if isinstance(command, click.Group):
            found += [(f"{name} {sub}", command.commands[sub]) for sub in command.commands]
        else:
            found.append((name, command))
    return found


def bad_values(param: click.Parameter, tmp_path: Path) -> list[str]:
    """Values click itself must refuse for ``param``'s type."""
    kind = param.type
    if isinstance(kind, click.Choice):
        return ["not-a-choice"]
    if isinstance(kind, click.IntRange | click.FloatRange):
        out = ["not-a-number"]
        if kind.min is not None:
            out.append(str(kind.min if kind.min_open else kind.min - 1))
        if kind.max is not None:
            out.append(str(kind.max + 1))
        return out
    if kind in (click.INT, click.FLOAT):
        return ["not-a-number"]
    if isinstance(kind, click.Path):
        if kind.exists:
            return [str(tmp_path / "missing")]
        if not kind.dir_okay:
            return [str(tmp_path)]  # a directory where a file goes
        if not kind.file_okay:
            return [str(tmp_path / "a-file")]
    if param.callback is not None:
        return ["no-such-thing"]
    return []


def run_leat(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["leat", *args])
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello"))  # `leat run` reads a prompt from a pipe
    code = 0
    try:
        leat_cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, wanted: str, args: list[str]) -> None:
    assert code != 0, f"leat {' '.join(args)} succeeded"
    # progress lines ("leat: loading ...") may come first; the error is the last line, and the only one
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:], f"leat {' '.join(args)}:\n{err}"
    assert "Traceback" not in err and "Usage:" not in err
    assert wanted.lower() in lines[-1].lower(), f"leat {' '.join(args)}: {lines[-1]!r} does not mention {wanted!r}"


@pytest.fixture
def tiny(tmp_path):
    from leat.testing import write_tiny_gguf

    llama = pytest.importorskip("leat_arch_llama.llama")
    return write_tiny_gguf(llama.Llama, tmp_path / "tiny.gguf")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAT_HOME", str(tmp_path / "home"))
    (tmp_path / "a-file").write_text("x")


@pytest.mark.parametrize("path", [path for path, _ in commands()])
def test_help(path, monkeypatch, capsys):
    code, out, err = run_leat([*path.split(), "--help"], monkeypatch, capsys)
    assert code == 0 and out.startswith(f"Usage: leat {path}"), out + err


@pytest.mark.parametrize("path,command", commands(), ids=[path for path, _ in commands()])
def test_every_bad_value_is_one_line(path, command, tmp_path, tiny, monkeypatch, capsys):
    checked = 0
    for param in command.params:
        if param.name is None or getattr(param, "is_flag", False) or param.name == "help":
            continue
        case = CASES.get((path, param.name)) or CASES.get(param.name)
        values = [(value, [], param.name) for value in bad_values(param, tmp_path)]
        if case:
            value, extra, wanted = case
            values.append((value, [str(tiny) if arg == "TINY" else arg for arg in extra], wanted))
        if not values:
            assert (path, param.name) in FREE_TEXT, f"leat {path}: {param.name} takes any text; list it or a bad value"
            continue
        for value, extra, wanted in values:
            if isinstance(param, click.Option):
                args = [*path.split(), *extra, param.opts[0], value]
                # an option's error names it (click: "Invalid value for '--kv'")
                wanted = param.opts[0] if wanted == param.name else wanted
            else:
                args = [*path.split(), value, *extra]
            args += _required(path, param.name, tmp_path)
            code, _, err = run_leat(args, monkeypatch, capsys)
            assert_one_line_error(code, err, wanted, args)
            checked += 1
    takes_values = [p for p in command.params if not getattr(p, "is_flag", False) and p.name != "help"]
    free = [p for p in takes_values if (path, p.name) in FREE_TEXT]
    assert checked or len(free) == len(takes_values), f"leat {path}: nothing checked"


def _required(path: str, name: str, tmp_path: Path) -> list[str]:
    """What a command needs besides the value under test, so that value is what fails."""
    if path == "generate" and name not in ("prompt", "prompt_file"):
        return ["-p", "hello"]
    if path == "perplexity" and name not in ("text_file", "kl_base"):
        return ["--text", str(tmp_path / "a-file")]
    if path == "receipts verify" and name != "public_key":
        return ["--public-key", str(tmp_path / "a-file")] if name == "receipt" else []
    if path == "receipts verify" and name == "public_key":
        return [str(tmp_path / "a-file")]
    return []


def test_a_real_process_prints_one_line(tmp_path):
    """The installed entry point, not only leat.cli.main in this process."""
    result = subprocess.run(
        [sys.executable, "-m", "leat", "bench", str(tmp_path / "x.gguf"), "--kv", "q4_0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "'--kv'" in result.stderr and "q4_0" in result.stderr
