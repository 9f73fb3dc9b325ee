"""What every chat format shares: the <think> splitter in front of a format, JSON call bodies, and choosing a format
from what the plugins register (fake formats here; the real ones are tested in their architecture plugins)."""

from __future__ import annotations

import importlib

import pytest
from leat.chatformat import MarkerParser, OutputParser, build_parser, choose, formats, json_calls
from leat.errors import PluginError
from leat.plugins import PluginHost
from leat.testing import parse_in_pieces
from leat.testing import tool_call as call

FORMATS = """
from leat import hookimpl
from leat.chatformat import MarkerParser, OutputParser, json_calls


class Tagged(MarkerParser):
    start, end = ("<call>",), "</call>"

    @classmethod
    def detect(cls, template, special, architecture):
        return 40 if "<call>" in template or "<call>" in special else 1

    def parse(self, body):
        return json_calls(body)


class Channels(OutputParser):
    always_parsed = own_reasoning = True

    @classmethod
    def detect(cls, template, special, architecture):
        return 60 if architecture == "chan" else None


class NotAFormat:
    pass


@hookimpl
def register_chat_formats(register):
    register("tagged", "leat_fake_formats:Tagged")
    register("channels", "leat_fake_formats:Channels")
"""


class Tagged(MarkerParser):
    start, end = ("<call>",), "</call>"

    def parse(self, body):
        return json_calls(body)


@pytest.fixture
def host(tmp_path, monkeypatch) -> PluginHost:
    (tmp_path / "leat_fake_formats.py").write_text(FORMATS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return PluginHost([], extra={"leat-fake": importlib.import_module("leat_fake_formats")})


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_reasoning_is_split_off_before_the_format(step):
    text = '<think>\nThe user wants weather.\n</think>\n\n<call>{"name": "w", "arguments": {}}</call>'
    assert parse_in_pieces(build_parser(Tagged, reasoning=True), text, step) == [
        ("reasoning", "The user wants weather.\n"),
        call("w"),
    ]
    # A template that opened <think> itself: the output starts inside the reasoning.
    parser = build_parser(None, reasoning=True, prompt_text="<|im_start|>assistant\n<think>\n")
    assert parse_in_pieces(parser, "plan</think>Answer", step) == [("reasoning", "plan"), ("content", "Answer")]
    plain = build_parser(None, reasoning=True)
    assert parse_in_pieces(plain, "No thinking here", step) == [("content", "No thinking here")]


def test_a_format_with_its_own_reasoning_gets_no_splitter(host):
    parser = build_parser(formats(host)["channels"], reasoning=True)
    assert type(parser).__name__ == "Channels"
    assert parse_in_pieces(parser, "<think>x</think>", 1000) == [("content", "<think>x</think>")]


def test_json_calls():
    assert json_calls('{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": "{}"}')[1].name == "b"
    assert json_calls('[{"function": {"name": "f", "arguments": "{\\"y\\": 2}"}}]')[0].arguments == '{"y": 2}'
    assert json_calls("{not json}") is None
    assert json_calls('{"arguments": {}}') is None


def test_the_surest_registered_format_is_chosen(host):
    assert choose("{{ '<call>' }}", [], "x", host) == "tagged"
    assert choose("", ["a", "<call>"], "x", host) == "tagged"
    assert choose("<call>", [], "chan", host) == "channels"
    assert choose("", [], "x", host) == "tagged"  # its fallback, 1
    assert choose("", [], "x", PluginHost([])) is None


def test_a_registered_format_must_be_an_output_parser(tmp_path, monkeypatch):
    (tmp_path / "leat_bad_format.py").write_text(
        FORMATS.replace("leat_fake_formats:Channels", "leat_bad_format:NotAFormat")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost([], extra={"leat-bad": importlib.import_module("leat_bad_format")})
    with pytest.raises(PluginError, match="plugin leat-bad: chat format 'channels' .* is not an OutputParser"):
        formats(host)


def test_base_parser_is_all_content():
    assert parse_in_pieces(OutputParser(), "a <call> b", 3) == [("content", "a <call> b")]
