"""``leat run``: one answer for a prompt, or a terminal chat."""

from __future__ import annotations

import sys
from typing import Any

import click

HELP = """commands:
  /help            this help
  /system TEXT     set the system message (and start over)
  /reset           forget the conversation
  /bye             quit (or Ctrl-D)
  \"\"\"              start or end a multi-line message"""


def _stream(model, messages: list[dict[str, Any]], max_tokens: int, sampling: dict, verbose: bool) -> str:
    ids = model.chat_prompt(messages)
    parts = []
    # one session for the whole chat: each turn prefills only the new messages
    for token in model.generate(ids, max_tokens=max_tokens, sampling=sampling, session="terminal"):
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


def _start(system: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}] if system else []


def answer_once(model, prompt: str, system: str | None, max_tokens: int, sampling: dict, verbose: bool) -> None:
    _stream(model, _start(system) + [{"role": "user", "content": prompt.strip()}], max_tokens, sampling, verbose)


def _read_message() -> str | None:
    try:
        line = input(">>> ")
    except EOFError:
        return None
    if line.strip() != '"""':
        return line
    lines = []
    while True:
        try:
            line = input("... ")
        except EOFError:
            break
        if line.strip() == '"""':
            break
        lines.append(line)
    return "\n".join(lines)


def chat_loop(model, system: str | None, max_tokens: int, sampling: dict, verbose: bool) -> None:
    click.echo(f"leat: chatting with {model.file.name} on {model.backend.name}; /help for commands", err=True)
    messages = _start(system)
    while True:
        text = _read_message()
        if text is None or text.strip() in ("/bye", "/exit", "/quit"):
            click.echo(err=True)
            return
        command, _, rest = text.strip().partition(" ")
        if command == "/help":
            click.echo(HELP)
        elif command == "/reset":
            messages = _start(system)
            click.echo("conversation cleared", err=True)
        elif command == "/system":
            system = rest.strip() or None
            messages = _start(system)
            click.echo("system message set; conversation cleared", err=True)
        elif command.startswith("/"):
            click.echo(f"unknown command {command}; /help lists them", err=True)
        elif text.strip():
            messages.append({"role": "user", "content": text})
            try:
                answer = _stream(model, messages, max_tokens, sampling, verbose)
            except KeyboardInterrupt:
                click.echo("\n(interrupted)", err=True)
                messages.pop()
                continue
            messages.append({"role": "assistant", "content": answer})
