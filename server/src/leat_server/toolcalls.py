"""Split a model's streamed output into content, reasoning and tool calls, per model family.

Every parser is fed text as it is decoded and returns :class:`Delta` items; ``finish()`` flushes
what it held back. Text that might be the start of a marker (``<tool_call>``, ``</think>``) is
held until it is clear, so a marker split across tokens is still found; a tool call is emitted
whole once its closing marker (or the end of the output) arrives. A body that does not parse as a
call is given back as content, never dropped.

Families (``PARSERS``), chosen from the chat template and vocabulary by :func:`choose_parser`:

* ``hermes``: Qwen 2.5/3, Hermes, ChatML models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
* ``llama3``: Llama 3.x JSON tool calling: ``{"name": ..., "parameters": {...}}`` as the whole answer
  (optionally after ``<|python_tag|>``; several separated by ``;``)
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (and v11's ``[TOOL_CALLS]name[ARGS]{...}``)
* ``harmony``: gpt-oss channels: ``<|channel|>commentary to=functions.NAME ... <|message|>{...}<|call|>``;
  the ``analysis`` channel is reasoning
* ``gemma``: Gemma's Python-call style, ``\u0060\u0060\u0060tool_code\\nname(arg="v")\\n\u0060\u0060\u0060``
* ``functiongemma``: ``<start_function_call>call:NAME{key:<escape>value<escape>}<end_function_call>``

Reasoning (``<think>...</think>``) is split off before tool parsing by :class:`ReasoningSplitter`.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leat.textstream import find_first, held_prefix


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


def _call_from_object(obj: Any, args_keys: Sequence[str] = ("arguments", "parameters")) -> ToolCall | None:
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
    calls = [_call_from_object(v, args_keys) for v in values]
    return calls if calls and all(c is not None for c in calls) else None


def python_calls(body: str) -> list[ToolCall] | None:
    """Calls written as Python, ``get_weather(city="Paris")``: keyword arguments with literal values only."""
    try:
        tree = ast.parse(body.strip(), mode="exec")
    except SyntaxError:
        return None
    calls = []
    for statement in tree.body:
        node = statement.value if isinstance(statement, ast.Expr) else None
        if isinstance(node, ast.List):  # [f(a=1), g(b=2)]
            nodes = node.elts
        else:
            nodes = [node]
        for call in nodes:
            if not isinstance(call, ast.Call) or call.args:
                return None
            name = ast.unparse(call.func)
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
            except ValueError:
                return None
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls or None


_FG_TOKEN = re.compile(
    r"\s*(<escape>(?P<s>.*?)<escape>|(?P<lit>[^,{}\[\]:]+)|(?P<open>[{\[])|(?P<close>[}\]])|(?P<sep>[,:]))", re.DOTALL
)


def functiongemma_calls(body: str) -> list[ToolCall] | None:
    """``call:NAME{key:<escape>text<escape>,n:3,nested:{a:true},xs:[1,2]}``."""
    match = re.match(r"\s*call:([\w.:-]+)\s*(\{.*\})\s*$", body, re.DOTALL)
    if not match:
        return None
    tokens = []
    pos = 0
    text = match.group(2)
    while pos < len(text):
        m = _FG_TOKEN.match(text, pos)
        if not m:
            if text[pos:].strip():
                return None
            break
        tokens.append(m)
        pos = m.end()

    def literal(raw: str) -> Any:
        raw = raw.strip()
        for value in (raw, raw.lower()):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                pass
        return raw

    def value(i: int) -> tuple[Any, int]:
        m = tokens[i]
        if m.group("open") == "{":
            obj, i = {}, i + 1
            while tokens[i].group("close") != "}":
                key = tokens[i].group("s") if tokens[i].group("s") is not None else tokens[i].group("lit").strip()
                if tokens[i + 1].group("sep") != ":":
                    raise ValueError("expected ':'")
                obj[key], i = value(i + 2)
                if tokens[i].group("sep") == ",":
                    i += 1
            return obj, i + 1
        if m.group("open") == "[":
            items, i = [], i + 1
            while tokens[i].group("close") != "]":
                item, i = value(i)
                items.append(item)
                if tokens[i].group("sep") == ",":
                    i += 1
            return items, i + 1
        if m.group("s") is not None:
            return m.group("s"), i + 1
        if m.group("lit") is not None:
            return literal(m.group("lit")), i + 1
        raise ValueError("unexpected token")

    try:
        args, end = value(0)
    except (ValueError, IndexError, TypeError):
        return None
    if end != len(tokens) or not isinstance(args, dict):
        return None
    return [ToolCall(match.group(1), json.dumps(args, ensure_ascii=False))]


# --- parsers -------------------------------------------------------------------------------------------------


class OutputParser:
    """Base: everything is content."""

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
                    _content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                _content(out, self.buffer[:at])
                self.buffer = self.buffer[at + len(marker) :]
                self.in_call = True
                self.marker = marker
            else:
                at = self.buffer.find(self.end) if self.end else -1
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
            _content(out, self.buffer)
        self.buffer, self.in_call = "", False
        return out

    def _calls(self, body: str, raw: str) -> list[Delta]:
        calls = self.parse(body)
        if calls is None:
            return [Delta("content", raw)]
        return [Delta("tool_call", call=c) for c in calls]


def _content(out: list[Delta], text: str) -> None:
    if text:
        if out and out[-1].kind == "content":
            out[-1].text += text
        else:
            out.append(Delta("content", text))


class HermesParser(MarkerParser):
    start = ("<tool_call>",)
    end = "</tool_call>"

    def parse(self, body: str) -> list[ToolCall] | None:
        return json_calls(body)


class MistralParser(MarkerParser):
    start = ("[TOOL_CALLS]",)
    end = None

    def parse(self, body: str) -> list[ToolCall] | None:
        calls = json_calls(body)
        if calls is not None:
            return calls
        # v11+: [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
        calls = []
        for part in body.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            call = _call_from_object({"name": name.strip(), "arguments": args}) if sep else None
            if call is None:
                return None
            calls.append(call)
        return calls or None


class FunctionGemmaParser(MarkerParser):
    start = ("<start_function_call>",)
    end = "<end_function_call>"

    def parse(self, body: str) -> list[ToolCall] | None:
        return functiongemma_calls(body)


class GemmaParser(MarkerParser):
    start = ("```tool_code",)
    end = "```"

    def parse(self, body: str) -> list[ToolCall] | None:
        return python_calls(body) or json_calls(body)


class Llama3Parser(OutputParser):
    """A Llama 3 answer is either text or, when it starts with ``{`` or ``<|python_tag|>``, JSON tool calls."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.buffer = ""
        self.mode: str | None = None  # None: undecided; "content"; "call"

    def feed(self, text: str) -> list[Delta]:
        if self.mode == "content":
            return [Delta("content", text)] if text else []
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []
            self.mode = "call" if head.startswith(("{", "[", self.TAG)) else "content"
            if self.mode == "content":
                out, self.buffer = self.buffer, ""
                return [Delta("content", out)]
        return []

    def finish(self) -> list[Delta]:
        if self.mode == "content" or not self.buffer:
            return []
        body = self.buffer.strip().removeprefix(self.TAG)
        calls = json_calls(body, ("parameters", "arguments"))
        if calls is None:
            return [Delta("content", self.buffer)]
        return [Delta("tool_call", call=c) for c in calls]


class HarmonyParser(OutputParser):
    """gpt-oss output: messages ``[<|start|>assistant][ to=R]<|channel|>C[ to=R][ <|constrain|>json]<|message|>BODY``,
    each ended by ``<|end|>``, ``<|call|>``, ``<|return|>`` or the end of the output."""

    HEADER_END = "<|message|>"
    BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    HEADER_START = ("<|start|>", "<|channel|>")

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "between"  # between messages | header | body
        self.header = ""
        self.channel = ""
        self.recipient: str | None = None
        self.body = ""

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while self.buffer:
            if self.state == "between":
                at, marker = find_first(self.buffer, self.HEADER_START)
                if at < 0:
                    keep = held_prefix(self.buffer, self.HEADER_START)
                    # Text outside any message (a model that skipped its header) is content.
                    _content(out, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                _content(out, self.buffer[:at])
                self.buffer = self.buffer[at:]
                self.state, self.header = "header", ""
            elif self.state == "header":
                at = self.buffer.find(self.HEADER_END)
                if at < 0:
                    break
                self._read_header(self.buffer[:at])
                self.buffer = self.buffer[at + len(self.HEADER_END) :]
                self.state, self.body = "body", ""
            else:
                at, marker = find_first(self.buffer, self.BODY_ENDS)
                piece = self.buffer if at < 0 else self.buffer[:at]
                if at < 0:
                    keep = held_prefix(self.buffer, self.BODY_ENDS)
                    piece = self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                else:
                    self.buffer = self.buffer[at + (0 if marker == "<|start|>" else len(marker)) :]
                out += self._body(piece)
                if at < 0:
                    break
                out += self._end_message()
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.state == "body":
            out += self._body(self.buffer)
            out += self._end_message()
        elif self.buffer:
            _content(out, self.buffer if self.state == "between" else "")
        self.buffer = ""
        return out

    def _read_header(self, header: str) -> None:
        header = header.replace("<|start|>", " ").replace("<|channel|>", " <|channel|>")
        recipient = re.search(r"to=([^\s<]+)", header)
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        self.recipient = recipient.group(1) if recipient else None
        self.channel = channel.group(1) if channel else "final"

    def _body(self, piece: str) -> list[Delta]:
        if not piece:
            return []
        if self.recipient:
            self.body += piece
            return []
        return [Delta("reasoning" if self.channel == "analysis" else "content", piece)]

    def _end_message(self) -> list[Delta]:
        self.state = "between"
        if not self.recipient:
            return []
        name = self.recipient.removeprefix("functions.")
        body, self.body, self.recipient = self.body, "", None
        call = _call_from_object({"name": name, "arguments": body.strip() or "{}"})
        return [Delta("tool_call", call=call)] if call else [Delta("content", body)]


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


PARSERS: dict[str, Callable[[], OutputParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "harmony": HarmonyParser,
    "gemma": GemmaParser,
    "functiongemma": FunctionGemmaParser,
}


def choose_parser(template: str, vocab: Sequence[str], architecture: str = "") -> str:
    """The tool-call family a model speaks, judged from its chat template, vocabulary and architecture."""
    tokens = set(vocab[-4096:]) if vocab else set()  # added and special tokens sit at the end
    if "<|channel|>" in template or "<|channel|>" in tokens or architecture == "gpt-oss":
        return "harmony"
    if "start_function_call" in template or "<start_function_call>" in tokens:
        return "functiongemma"
    if "<tool_call>" in template or "<tool_call>" in tokens:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in tokens:
        return "mistral"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template or "<|python_tag|>" in tokens:
        return "llama3"
    if "tool_code" in template or architecture.startswith("gemma"):
        return "gemma"
    return "hermes"


def has_reasoning(template: str, vocab: Sequence[str]) -> bool:
    tokens = set(vocab[-4096:]) if vocab else set()
    return "<think>" in template or "<think>" in tokens


def opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside an unclosed ``<think>`` (the model continues its reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith("<think>")


def build_parser(family: str | None, reasoning: bool, prompt_text: str = "") -> OutputParser | ReasoningSplitter:
    inner = PARSERS[family]() if family else OutputParser()
    if reasoning and family != "harmony":
        return ReasoningSplitter(inner, open_at_start=opens_thinking(prompt_text))
    return inner
