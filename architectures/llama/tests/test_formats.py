"""Llama's and Mistral's tool-call formats: registered through the plugin's entry point, fed the output in pieces."""

from __future__ import annotations

import pytest
from leat.testing import parse_with
from leat.testing import tool_call as call

PLUGIN = "leat-arch-llama"
CASES = [
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [call("get_weather", city="Paris")]),
    (
        "llama3",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        [call("a", x=1), call("b")],
    ),
    ("llama3", "The answer is {42}.", [("content", "The answer is {42}.")]),
    ("llama3", "{not a call}", [("content", "{not a call}")]),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', [("content", "Sure "), call("f", a=1)]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', [call("f", a=1), call("g")]),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_parsers(name, text, expected, step):
    assert parse_with(PLUGIN, name, text, step) == expected
