"""gpt-oss's harmony format: registered through the plugin's entry point, fed the output in pieces."""

from __future__ import annotations

import pytest
from leat.testing import parse_with
from leat.testing import tool_call as call

PLUGIN = "leat-arch-gpt-oss"
CASES = [
    (
        "harmony",
        (
            "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
        ),
        [("reasoning", "Need the weather."), call("get_weather", city="Paris")],
    ),
    (
        "harmony",
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi there",
        [("reasoning", "Think."), ("content", "Hi there")],
    ),
    (
        "harmony",
        '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"q": "x"}<|call|>',
        [call("lookup", q="x")],
    ),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_parsers(name, text, expected, step):
    assert parse_with(PLUGIN, name, text, step) == expected
