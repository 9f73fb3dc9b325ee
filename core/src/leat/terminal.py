"""``leat run``: one answer for a prompt, or a terminal chat."""

from __future__ import annotations

import sys
from typing import Any

import click

HELP = """commands:
  /help            this help
  /system TEXT     set the system message (and start over)
  /reset           forget the conversation
  /image PATH      attach an image to the next message (needs --mmproj)
  /exit            quit (also /bye, /quit, exit, quit, or Ctrl-D)
  \"\"\"              start or end a multi-line message
keys: arrows recall earlier messages (kept in LEAT_HOME/history); Ctrl-C clears the line or stops an answer"""
QUIT = ("/bye", "/exit", "/quit", "exit", "quit")
HISTORY_LINES = 1000


def _stream(
    model, messages: list[dict[str, Any]], max_tokens: int, sampling: dict, verbose: bool, images: tuple = ()
) -> str:
    if images:  # the whole conversation each turn: images do not go into sessions yet
        text = model.chat_template.render(messages, add_generation_prompt=True)
        ids, spans = model.image_prompt(text, images, add_special=False)
        tokens = model.generate(ids, max_tokens=max_tokens, sampling=sampling, images=spans)
    else:  # one session for the whole chat: each turn prefills only the new messages
        tokens = model.generate(model.chat_prompt(messages), max_tokens, sampling, session="terminal")
    parts = []
    for token in tokens:
        parts.append(token.text)
        click.echo(token.text, nl=False)
        sys.stdout.flush()
    click.echo()
    if verbose:
        t = model.last_timings.as_dict()
        click.echo(
            f"[prompt {t['prompt_tokens']} tokens, {t['prompt_tokens_per_second']} tok/s; "
            f"generated {t['generated_tokens']} tokens, {t['generate_tokens_per_second']} tok/s]",
            err=True,
        )
    return "".join(parts)


def _image(model, path: str) -> bytes | None:
    """The bytes of the image at ``path`` for the next message; None (and why, said) when it cannot be."""
    if model.vision is None:
        click.echo("this model has no vision projector: start leat run with --mmproj FILE", err=True)
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        click.echo(f"cannot read {path}: {e.strerror}", err=True)
        return None


def _start(system: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}] if system else []


def answer_once(model, prompt: str, system: str | None, max_tokens: int, sampling: dict, verbose: bool) -> None:
    _stream(model, _start(system) + [{"role": "user", "content": prompt.strip()}], max_tokens, sampling, verbose)


def _line(prompt: str) -> str | None:
    """One line read with editing and history (readline); Ctrl-C clears it and asks again; None at end of input."""
    while True:
        try:
            return input(prompt)
        except EOFError:
            return None
        except KeyboardInterrupt:
            click.echo("^C", err=True)


def _read_message() -> str | None:
    line = _line(">>> ")
    if line is None or line.strip() != '"""':
        return line
    lines = []
    while (line := _line("... ")) is not None and line.strip() != '"""':
        lines.append(line)
    return "\n".join(lines)


def _history() -> Any:
    """Turn on line editing and load the history file; returns a function that saves it."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input()
        return lambda: None
    from leat.pull import cache_dir

    path = cache_dir() / "history"
    readline.set_history_length(HISTORY_LINES)
    try:
        readline.read_history_file(path)
    except OSError:  # none yet
        pass

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError as e:
            click.echo(f"note: history not saved ({e})", err=True)

    return save


def chat_loop(model, system: str | None, max_tokens: int, sampling: dict, verbose: bool) -> None:
    from leat.cli_models import model_label

    click.echo(f"leat: chatting with {model_label(model.file.path)} on {model.backend.name}; /help", err=True)
    save_history = _history()
    try:
        _converse(model, system, max_tokens, sampling, verbose)
    finally:
        save_history()


def _converse(model, system: str | None, max_tokens: int, sampling: dict, verbose: bool) -> None:
    messages, images, pending = _start(system), [], []
    while True:
        text = _read_message()
        if text is None or text.strip() in QUIT:
            click.echo(err=True)
            return
        command, _, rest = text.strip().partition(" ")
        if command == "/help":
            click.echo(HELP)
        elif command == "/reset":
            messages, images, pending = _start(system), [], []
            click.echo("conversation cleared", err=True)
        elif command == "/system":
            system = rest.strip() or None
            messages = _start(system)
            click.echo("system message set; conversation cleared", err=True)
        elif command == "/image":
            picture = _image(model, rest.strip())
            if picture is not None:
                pending.append(picture)
                click.echo(f"{len(pending)} image(s) attached to your next message", err=True)
        elif command.startswith("/"):
            click.echo(f"unknown command {command}; /help lists them", err=True)
        elif text.strip():
            from leat.vision import MARKER

            messages.append({"role": "user", "content": MARKER * len(pending) + text})
            try:
                answer = _stream(model, messages, max_tokens, sampling, verbose, tuple(images + pending))
            except KeyboardInterrupt:
                click.echo("\n(interrupted)", err=True)
                messages.pop()
                continue
            images, pending = images + pending, []
            messages.append({"role": "assistant", "content": answer})
