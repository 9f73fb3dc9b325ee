"""The Hermes tool-call format Qwen speaks: registered through the plugin's entry point, fed the output in pieces."""

from __future__ import annotations

import pytest
from leat.testing import parse_with
from leat.testing import tool_call as call

PLUGIN = "leat-arch-qwen3"
CASES = [
    (
        "hermes",
        'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [("content", "Let me check."), call("get_weather", city="Paris")],
    ),
    (
        "hermes",
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
            "</tool_call>"
        ),
        [call("a"), ("content", "\n"), call("b", x=1)],
    ),
    ("hermes", "<tool_call>not json</tool_call> ok", [("content", "<tool_call>not json</tool_call> ok")]),
    ("hermes", "a < b and <tool", [("content", "a < b and <tool")]),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_parsers(name, text, expected, step):
    assert parse_with(PLUGIN, name, text, step) == expected
