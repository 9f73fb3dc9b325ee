"""The example sampler stage, chat format and command, as leat finds them through the plugin's entry point."""

import math
import subprocess
import sys

import numpy as np
import pytest
from leat.chatformat import build_parser, choose
from leat.plugins import PluginHost
from leat.sampling import Sampler, SamplingParams, stages
from leat.testing import parse_in_pieces, tool_call

pytest.importorskip("leat_example", reason="the template is tested once installed (tests/test_template_plugin.py)")


@pytest.fixture(scope="module")
def host():
    return PluginHost(None)


def ref_top_a(logits, a):
    """Top-a from its definition, one token at a time: keep p >= a * max(p)^2."""
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    probs = [w / sum(weights) for w in weights]
    bar = a * max(probs) ** 2
    return [x if p >= bar else -math.inf for x, p in zip(logits, probs)]


@pytest.mark.parametrize("a", [0.05, 0.2, 0.9])
def test_top_a_matches_its_definition(host, a):
    logits = np.random.default_rng(1).normal(0, 2, 64)
    stage = host.registry["samplers"]["top_a"].load()(SamplingParams(host, top_a=a))
    assert stage.apply(logits.copy(), []).tolist() == ref_top_a(logits.tolist(), a)


def test_top_a_takes_its_place_after_min_p(host):
    names = [cls.name for cls in stages(host)]
    assert names.index("top_a") == names.index("min_p") + 1
    sampler = Sampler.build(SamplingParams.resolve({"top_a": 0.3, "temperature": 1.0}, {}, host), host)
    assert "top_a" in [s.name for s in sampler.stages]


def test_calls_are_parsed_and_the_format_chosen(host):
    assert choose("", [], "example", host) == "example"
    parser = build_parser(host.registry["chat_formats"]["example"].load(), reasoning=False)
    text = 'Sure.<call>{"name": "f", "arguments": {"x": 1}}</call>'
    assert parse_in_pieces(parser, text, 2) == [("content", "Sure."), tool_call("f", x=1)]


def test_the_command_writes_a_model(tmp_path):
    path = tmp_path / "tiny.gguf"
    command = [sys.executable, "-m", "leat", "example-tiny", str(path)]
    out = subprocess.run(command, check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert path.stat().st_size > 1000
