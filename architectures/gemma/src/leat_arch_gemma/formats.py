"""Gemma's tool-call conventions.

* ``gemma``: Python-call style, ``\u0060\u0060\u0060tool_code\\nname(arg="v")\\n\u0060\u0060\u0060``
* ``functiongemma``: ``<start_function_call>call:NAME{key:<escape>value<escape>}<end_function_call>``
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from leat.chatformat import MarkerParser, ToolCall, json_calls


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


class GemmaParser(MarkerParser):
    start = ("```tool_code",)
    end = "```"

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        return 10 if "tool_code" in template or architecture.startswith("gemma") else None

    def parse(self, body: str) -> list[ToolCall] | None:
        return python_calls(body) or json_calls(body)


class FunctionGemmaParser(MarkerParser):
    start = ("<start_function_call>",)
    end = "<end_function_call>"

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        return 50 if "start_function_call" in template or "<start_function_call>" in special else None

    def parse(self, body: str) -> list[ToolCall] | None:
        return functiongemma_calls(body)
