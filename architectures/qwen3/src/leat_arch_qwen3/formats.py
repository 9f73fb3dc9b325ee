"""The Hermes / ChatML tool-call convention that Qwen 2.5 and 3 speak:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; it is also the convention assumed when no installed
format recognises a model."""

from __future__ import annotations

from leat.chatformat import MarkerParser, ToolCall, json_calls


class HermesParser(MarkerParser):
    start = ("<tool_call>",)
    end = "</tool_call>"

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        return 40 if "<tool_call>" in template or "<tool_call>" in special else 1

    def parse(self, body: str) -> list[ToolCall] | None:
        return json_calls(body)
