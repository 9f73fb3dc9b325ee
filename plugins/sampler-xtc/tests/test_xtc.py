"""XTC against a plain-Python reference written from llama.cpp's definition (llama_sampler_xtc_apply), in the chain
the host builds from the stages' declarations."""

from __future__ import annotations

import math

import numpy as np
import pytest
from leat.plugins import PluginHost
from leat.sampling import Sampler, SamplingParams, fields, stages

RNG_SEEDS = range(12)


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost(only=["leat-sampler-xtc", "leat-samplers"])


class Always:
    """A random generator whose draws are all ``value``: decides whether XTC acts without touching its logic."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


def ref_xtc(logits: list[float], threshold: float) -> list[float]:
    """llama.cpp's XTC once it has decided to act: softmax over the candidates sorted by logit (equal ones by lower
    id), ``pos_last`` the last index whose probability is >= threshold, the first ``pos_last`` candidates removed
    when ``pos_last > 0``."""
    candidates = sorted((i for i, x in enumerate(logits) if x != -math.inf), key=lambda i: (-logits[i], i))
    if threshold > 0.5 or len(candidates) < 2:
        return list(logits)
    top = logits[candidates[0]]
    weights = [math.exp(logits[i] - top) for i in candidates]
    probs = [w / sum(weights) for w in weights]
    pos_last = 0
    for i, p in enumerate(probs):
        if p >= threshold:
            pos_last = i
        else:
            break
    out = list(logits)
    if pos_last > 0:
        for i in candidates[:pos_last]:
            out[i] = -math.inf
    return out


def random_logits(seed: int, size: int = 48) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = np.round(rng.normal(0, 2.5, size), 1)  # rounded so that equal logits occur
    logits[rng.choice(size, size // 6, replace=False)] = -np.inf
    return logits


def xtc(host, rng=None, **params):
    cls = host.registry["samplers"]["xtc"].load()
    return cls(SamplingParams(host, **params), rng)


@pytest.mark.parametrize("seed", RNG_SEEDS)
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.1, 0.2, 0.35, 0.5])
def test_xtc_matches_the_reference_when_it_acts(host, seed, threshold):
    logits = random_logits(seed)
    stage = xtc(host, Always(0.0), xtc_probability=0.5, xtc_threshold=threshold)
    assert stage.apply(logits.copy(), []).tolist() == ref_xtc(logits.tolist(), threshold)


def test_xtc_removes_all_top_choices_but_the_least_likely():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    got = xtc(PluginHost(only=["leat-sampler-xtc"]), Always(0.0), xtc_probability=1.0, xtc_threshold=0.15)
    assert got.apply(logits.copy(), []).tolist() == [-math.inf, -math.inf, logits[2], logits[3]]


def test_xtc_leaves_the_row_when_the_draw_is_above_the_probability(host):
    logits = random_logits(3)
    stage = xtc(host, Always(0.31), xtc_probability=0.3, xtc_threshold=0.05)
    assert stage.apply(logits.copy(), []).tolist() == logits.tolist()


def test_xtc_acts_on_about_the_given_share_of_tokens(host):
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    stage = xtc(host, np.random.default_rng(7), xtc_probability=0.3, xtc_threshold=0.2)
    n = 4000
    acted = sum(stage.apply(logits.copy(), [])[0] == -np.inf for _ in range(n))
    assert abs(acted - 0.3 * n) < 4 * math.sqrt(n * 0.3 * 0.7)  # four standard deviations of a binomial


def test_xtc_is_off_at_its_neutral_values(host):
    assert not xtc(host, xtc_probability=0.0).enabled()
    assert not xtc(host, xtc_probability=1.0, xtc_threshold=0.6).enabled()
    assert xtc(host, xtc_probability=1.0, xtc_threshold=0.5).enabled()


def test_xtc_declares_its_fields_and_takes_its_place_after_min_p(host):
    table = fields(host)
    assert {"xtc_probability", "xtc_threshold", "top_k", "temperature"} <= set(table)
    assert table["xtc_threshold"].default == 0.1 and table["xtc_probability"].default == 0.0
    names = [cls.name for cls in stages(host)]
    assert names == ["penalties", "top_k", "top_p", "min_p", "xtc", "temperature"]
    sampler = Sampler.build(SamplingParams(host, xtc_probability=0.5, repeat_penalty=1.1), host)
    assert [s.name for s in sampler.stages] == names


def test_xtc_runs_at_temperature_zero_as_in_llama_cpp(host):
    """llama.cpp's chain runs XTC before the temperature stage, which at 0 keeps the highest remaining logit."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler.build(SamplingParams(host, temperature=0, xtc_probability=1.0, xtc_threshold=0.15), host)
    assert [s.name for s in sampler.stages] == ["xtc"]
    assert sampler.sample(logits, []) == 2


@pytest.mark.parametrize("field, value", [("xtc_probability", 1.5), ("xtc_threshold", -0.1), ("xtc_probability", "x")])
def test_bad_values_name_the_field(host, field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams.resolve({field: value}, {}, host)


def test_without_the_plugin_its_fields_are_unknown():
    with pytest.raises(ValueError, match="^xtc_probability is not a sampling field"):
        SamplingParams(PluginHost(only=["leat-samplers"]), xtc_probability=0.5)
