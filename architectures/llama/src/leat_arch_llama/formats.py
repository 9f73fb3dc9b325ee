"""Llama's and Mistral's tool-call conventions (both are ``general.architecture`` llama).

* ``llama3``: Llama 3.x JSON tool calling: ``{"name": ..., "parameters": {...}}`` as the whole answer (optionally
  after ``<|python_tag|>``; several separated by ``;``)
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (and v11's ``[TOOL_CALLS]name[ARGS]{...}``)
"""

from __future__ import annotations

from leat.chatformat import Delta, MarkerParser, OutputParser, ToolCall, call_from_object, json_calls


class Llama3Parser(OutputParser):
    """A Llama 3 answer is either text or, when it starts with ``{`` or ``<|python_tag|>``, JSON tool calls."""

    TAG = "<|python_tag|>"

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        markers = cls.TAG in template or "<|start_header_id|>" in template or cls.TAG in special
        return 20 if markers else None

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


class MistralParser(MarkerParser):
    start = ("[TOOL_CALLS]",)
    end = None

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        return 30 if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in special else None

    def parse(self, body: str) -> list[ToolCall] | None:
        calls = json_calls(body)
        if calls is not None:
            return calls
        # v11+: [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
        calls = []
        for part in body.split("[TOOL_CALLS]"):
            name, sep, args = part.partition("[ARGS]")
            call = call_from_object({"name": name.strip(), "arguments": args}) if sep else None
            if call is None:
                return None
            calls.append(call)
        return calls or None
