"""Gemma's tool-call formats: registered through the plugin's entry point, fed the output in pieces."""

from __future__ import annotations

import pytest
from leat.testing import parse_with
from leat.testing import tool_call as call

PLUGIN = "leat-arch-gemma"
CASES = [
    (
        "gemma",
        'Sure.\n```tool_code\nget_weather(city="Paris", days=2)\n```',
        [("content", "Sure.\n"), call("get_weather", city="Paris", days=2)],
    ),
    ("gemma", "```python\nprint(1)\n```", [("content", "```python\nprint(1)\n```")]),
    (
        "functiongemma",
        (
            "<start_function_call>call:get_weather{city:<escape>Paris, FR<escape>,days:2,opts:{metric:true},"
            "tags:[<escape>a<escape>,<escape>b<escape>]}<end_function_call>"
        ),
        [call("get_weather", city="Paris, FR", days=2, opts={"metric": True}, tags=["a", "b"])],
    ),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_parsers(name, text, expected, step):
    assert parse_with(PLUGIN, name, text, step) == expected
