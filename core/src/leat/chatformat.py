"""Chat formats: how a model family writes tool calls and reasoning in its output.

An architecture plugin brings its family's conventions through :func:`leat.hookspecs.register_chat_formats`: an
:class:`OutputParser` subclass that says when a model speaks it (:meth:`OutputParser.detect`, from the chat template
and special tokens) and splits the streamed output into content, reasoning and tool calls. This module holds what
every format shares: the deltas, a marker-delimited parser, JSON call bodies, and the ``<think>`` splitter that goes in
front of any format without a reasoning channel of its own. Core names no format; the server asks the plugins.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from leat import plugins
from leat.errors import PluginError
from leat.textstream import find_first, held_prefix

SPECIAL_TAIL = 4096  # added and special tokens sit at the end of a vocabulary


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or "call_" + secrets.token_hex(12)


@dataclass
class Delta:
    kind: str  # "content" | "reasoning" | "tool_call"
    text: str = ""
    call: ToolCall | None = None


# --- tool-call bodies ----------------------------------------------------------------------------------------


def call_from_object(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments": {...} or "{...}"}`` (or OpenAI's ``{"function": {...}}``), else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def json_calls(body: str, args_keys: Sequence[str] = ("arguments", "parameters")) -> list[ToolCall] | None:
    """Calls from a JSON object, a JSON list of objects, or objects separated by ``;``; None if it is not that."""
    body = body.strip()
    if not body:
        return None
    try:
        values = [json.loads(body)]
    except json.JSONDecodeError:
        values = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                value, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return None
            values.append(value)
            while i < len(body) and body[i] in " \t\r\n;,":
                i += 1
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = [call for v in values if (call := call_from_object(v, args_keys)) is not None]
    return calls if calls and len(calls) == len(values) else None


# --- parsers -------------------------------------------------------------------------------------------------


class OutputParser:
    """A chat format's output parser; this base reads everything as content (no format, or no tools).

    A format subclasses it (directly, or :class:`MarkerParser` for calls between two markers) and is registered with
    :func:`leat.hookspecs.register_chat_formats`. ``feed`` gets the output as it is decoded and returns
    :class:`Delta` items; text that might be the start of a marker is held until it is clear; ``finish`` flushes
    what was held. A body that does not parse as a call is given back as content, never dropped.
    """

    #: The output always carries this format's structure, tools or not (gpt-oss's channels): it is parsed for every
    #: request, and special tokens' text is kept for it.
    always_parsed: ClassVar[bool] = False
    #: The parser splits the reasoning off itself, so no ``<think>`` splitter is put in front of it.
    own_reasoning: ClassVar[bool] = False

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        """How surely a model speaks this format, from its chat template source, its special tokens (the
        vocabulary's last 4096 entries) and its GGUF ``general.architecture``: the highest number among the
        installed formats wins (equal ones by name); None when it does not. Give the format's own markers a
        number between 10 and 100; 1 means "when nothing else matches"."""
        return None

    def feed(self, text: str) -> list[Delta]:
        return [Delta("content", text)] if text else []

    def finish(self) -> list[Delta]:
        return []


class MarkerParser(OutputParser):
    """Content with tool calls between ``start`` and ``end`` markers (``end`` None: to the end of the output)."""

    start: tuple[str, ...] = ()
    end: str | None = None

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False

    def parse(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while self.buffer:
            if not self.in_call:
                at, marker = find_first(self.buffer, self.start)
                if at < 0:
                    keep = held_prefix(self.buffer, self.start)
                    add_content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                add_content(out, self.buffer[:at])
                self.buffer = self.buffer[at + len(marker) :]
                self.in_call = True
                self.marker = marker
            else:
                if self.end is None:  # the call runs to the end of the output
                    break
                at = self.buffer.find(self.end)
                if at < 0:
                    break
                body, self.buffer = self.buffer[:at], self.buffer[at + len(self.end) :]
                self.in_call = False
                out += self._calls(body, self.marker + body + self.end)
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.in_call:
            out += self._calls(self.buffer, self.marker + self.buffer)
        else:
            add_content(out, self.buffer)
        self.buffer, self.in_call = "", False
        return out

    def _calls(self, body: str, raw: str) -> list[Delta]:
        calls = self.parse(body)
        if calls is None:
            return [Delta("content", raw)]
        return [Delta("tool_call", call=c) for c in calls]


def add_content(out: list[Delta], text: str) -> None:
    """Append ``text`` as content, joined to the last delta when that is content too."""
    if text:
        if out and out[-1].kind == "content":
            out[-1].text += text
        else:
            out.append(Delta("content", text))


class ReasoningSplitter:
    """Splits ``<think>...</think>`` off as reasoning, then hands the rest to ``inner``.

    ``open_at_start``: the prompt ended inside ``<think>`` (templates that open it themselves).
    """

    OPEN, CLOSE = "<think>", "</think>"

    def __init__(self, inner: OutputParser, open_at_start: bool = False):
        self.inner = inner
        self.buffer = ""
        self.thinking = open_at_start
        self.started = open_at_start  # seen the opening tag (or the template wrote it)
        self.done = False  # reasoning is over: the rest is content
        self.strip_lead = open_at_start
        self.lead_pending = False  # drop the newlines that follow </think>

    def feed(self, text: str) -> list[Delta]:
        if self.done:
            return self._content(text)
        self.buffer += text
        out: list[Delta] = []
        while self.buffer and not self.done:
            if not self.thinking:
                head = self.buffer.lstrip()
                if not head:
                    return out
                if self.OPEN.startswith(head) and head != self.OPEN:
                    return out  # may be the opening tag, still arriving
                if head.startswith(self.OPEN):
                    self.buffer = head[len(self.OPEN) :]
                    self.thinking = self.strip_lead = True
                    continue
                self.done = True  # no reasoning in this answer
                rest, self.buffer = self.buffer, ""
                return out + self._content(rest)
            if self.strip_lead:
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer:
                    return out
                self.strip_lead = False
            at = self.buffer.find(self.CLOSE)
            if at < 0:
                keep = held_prefix(self.buffer, (self.CLOSE,))
                piece = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                if piece:
                    out.append(Delta("reasoning", piece))
                return out
            if at:
                out.append(Delta("reasoning", self.buffer[:at]))
            rest = self.buffer[at + len(self.CLOSE) :].lstrip("\n")
            self.buffer, self.thinking, self.done = "", False, True
            self.lead_pending = not rest
            out += self._content(rest)
        return out

    def _content(self, text: str) -> list[Delta]:
        if self.lead_pending:
            text = text.lstrip("\n")
            if not text:
                return []
            self.lead_pending = False
        return self.inner.feed(text)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.buffer:
            if self.thinking:
                out.append(Delta("reasoning", self.buffer))
            else:
                out += self.inner.feed(self.buffer)
        self.buffer = ""
        return out + self.inner.finish()


def special_tokens(vocab: Sequence[str]) -> set[str]:
    return set(vocab[-SPECIAL_TAIL:]) if vocab else set()


def formats(host: plugins.PluginHost | None = None) -> dict[str, type[OutputParser]]:
    """The chat formats the loaded plugins register, by name."""
    host = host or plugins.host()
    found = {}
    for name, entry in host.registry["chat_formats"].items():
        cls = entry.load()
        if not (isinstance(cls, type) and issubclass(cls, OutputParser)):
            raise PluginError(f"plugin {entry.plugin}: chat format {name!r} ({entry.ref}) is not an OutputParser")
        found[name] = cls
    return found


def choose(
    template: str, vocab: Sequence[str], architecture: str = "", host: plugins.PluginHost | None = None
) -> str | None:
    """The name of the format a model speaks (the surest :meth:`OutputParser.detect`), or None when none matches."""
    special = special_tokens(vocab)
    scored = [
        (score, name) for name, cls in formats(host).items() if (score := cls.detect(template, special, architecture))
    ]
    return min(scored, key=lambda pair: (-pair[0], pair[1]))[1] if scored else None


def has_reasoning(template: str, vocab: Sequence[str]) -> bool:
    """The model writes ``<think>...</think>`` reasoning (its template or special tokens have the tag)."""
    return ReasoningSplitter.OPEN in template or ReasoningSplitter.OPEN in special_tokens(vocab)


def opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside an unclosed ``<think>`` (the model continues its reasoning)."""
    return prompt_text.rstrip().endswith(ReasoningSplitter.OPEN)


def build_parser(
    fmt: type[OutputParser] | None, reasoning: bool, prompt_text: str = ""
) -> OutputParser | ReasoningSplitter:
    """``fmt``'s parser (plain content when None), behind a ``<think>`` splitter when the model reasons and the
    format has no reasoning channel of its own."""
    inner = fmt() if fmt else OutputParser()
    if reasoning and not inner.own_reasoning:
        return ReasoningSplitter(inner, open_at_start=opens_thinking(prompt_text))
    return inner
