"""The default samplers, loaded through the plugin's entry point, against plain float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from leat.errors import PluginError
from leat.plugins import PluginHost
from leat.sampling import Sampler, SamplingParams, Selector, Stage, stages

NAMES = {"penalties", "top_k", "top_p", "min_p", "temperature", "greedy", "categorical"}
OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every filter off; a test turns on the one it checks
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                 9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}  # fmt: skip


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost(only=["leat-samplers"])


def stage(host: PluginHost, name: str, **params) -> Stage:
    return host.registry["samplers"][name].load()(SamplingParams(**params))


def random_logits(seed: int, size: int = 64) -> np.ndarray:
    """Rounded to one decimal so that ties are common, with a few -inf (already masked) entries."""
    rng = np.random.default_rng(seed)
    logits = np.round(rng.normal(0, 2, size), 1)
    logits[rng.choice(size, size // 8, replace=False)] = -np.inf
    return logits


def masked(logits: np.ndarray, keep: set[int]) -> np.ndarray:
    return np.array([x if i in keep else -math.inf for i, x in enumerate(logits)])


def probabilities(logits: np.ndarray) -> list[float]:
    top = max(logits)
    e = [math.exp(x - top) for x in logits]
    return [x / sum(e) for x in e]


# --- references: one token at a time, in plain Python -----------------------------------------------------------


def ref_penalties(logits, history, last_n, repeat, freq, presence):
    window = list(history) if last_n == -1 else list(history)[-last_n:] if last_n > 0 else []
    out = logits.copy()
    for token in set(window):
        x = out[token]
        x = x * repeat if x <= 0 else x / repeat
        out[token] = x - window.count(token) * freq - presence
    return out


def ref_top_k(logits, k):
    ranked = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    return masked(logits, set(ranked[:k]))


def ref_top_p(logits, p):
    probs = probabilities(logits)
    ranked = sorted(range(len(logits)), key=lambda i: (-probs[i], i))
    keep, total = set(), 0.0
    for i in ranked:
        keep.add(i)
        total += probs[i]
        if total >= p:
            break
    return masked(logits, keep)


def ref_min_p(logits, min_p):
    probs = probabilities(logits)
    return masked(logits, {i for i, q in enumerate(probs) if q >= min_p * max(probs)})


def same(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    np.testing.assert_allclose(a[~np.isneginf(a)], b[~np.isneginf(b)], rtol=1e-12)


# --- registration -----------------------------------------------------------------------------------------------


def test_plugin_registers_every_stage_through_its_entry_point(host):
    assert host.plugins["leat-samplers"].status == "loaded"
    assert set(host.plugins["leat-samplers"].provides["samplers"]) == NAMES
    for name, entry in host.registry["samplers"].items():
        assert entry.ref.startswith("leat_samplers.stages:")
        cls = entry.load()
        assert issubclass(cls, Selector if name in ("greedy", "categorical") else Stage)
        assert cls.name == name


def test_listing_the_plugin_does_not_import_the_stages():
    import subprocess
    import sys

    code = "import sys; from leat.plugins import PluginHost; PluginHost(only=['leat-samplers']); "
    code += "print('leat_samplers.stages' in sys.modules, 'leat.sampling' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_default_chain_is_llama_cpp_order(host):
    params = SamplingParams(repeat_penalty=1.1)
    sampler = Sampler.build(params, host)
    assert [s.name for s in sampler.stages] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    assert [cls.name for cls in stages(host)] == ["penalties", "top_k", "top_p", "min_p", "temperature"]
    assert sampler.selector.name == "categorical"


def test_disabled_stages_are_left_out(host):
    sampler = Sampler.build(SamplingParams(temperature=1.0, **OFF), host)
    assert [s.name for s in sampler.stages] == ["temperature"]  # repeat_penalty 1.0 is off by default


def test_greedy_chain_keeps_only_penalties(host):
    sampler = Sampler.build(SamplingParams(temperature=0, repeat_penalty=1.3), host)
    assert [s.name for s in sampler.stages] == ["penalties"]
    assert sampler.selector.name == "greedy"


def test_missing_stage_is_a_plugin_error():
    with pytest.raises(PluginError, match="'categorical' is not registered"):
        Sampler.build(SamplingParams(), PluginHost(only=[]))


# --- each stage against its reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("k", [1, 2, 5, 17, 56, 64, 100])
def test_top_k(host, seed, k):
    logits = random_logits(seed)
    same(stage(host, "top_k", top_k=k).apply(logits.copy(), []), ref_top_k(logits, k))


def test_top_k_tie_goes_to_the_lower_token_id(host):
    logits = np.array([1.0, 3.0, 2.0, 3.0, 3.0])
    out = stage(host, "top_k", top_k=2).apply(logits.copy(), [])
    assert list(np.flatnonzero(out > -np.inf)) == [1, 3]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p(host, seed, p):
    logits = random_logits(seed)
    same(stage(host, "top_p", top_p=p).apply(logits.copy(), []), ref_top_p(logits, p))


def test_top_p_stops_when_the_sum_reaches_p_exactly(host):
    logits = np.zeros(4)  # probabilities 0.25 each, exact in binary
    out = stage(host, "top_p", top_p=0.5).apply(logits.copy(), [])
    assert list(np.flatnonzero(out > -np.inf)) == [0, 1]
    same(out, ref_top_p(logits, 0.5))


def test_top_p_keeps_at_least_one(host):
    out = stage(host, "top_p", top_p=0.0).apply(np.array([0.0, 5.0, 1.0]), [])
    assert list(np.flatnonzero(out > -np.inf)) == [1]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.2, 0.5, 1.0])
def test_min_p(host, seed, min_p):
    logits = random_logits(seed)
    same(stage(host, "min_p", min_p=min_p).apply(logits.copy(), []), ref_min_p(logits, min_p))


@pytest.mark.parametrize("t", [0.1, 0.7, 1.0, 1.5])
def test_temperature(host, t):
    logits = random_logits(3)
    same(stage(host, "temperature", temperature=t).apply(logits.copy(), []), logits / t)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize(
    ("last_n", "repeat", "freq", "presence"),
    [(64, 1.3, 0.0, 0.0), (5, 1.3, 0.0, 0.0), (-1, 0.8, 0.0, 0.0), (8, 1.0, 0.5, 0.0), (8, 1.0, 0.0, 0.7),
     (16, 1.2, 0.3, -0.4)],
)  # fmt: skip
def test_penalties(host, seed, last_n, repeat, freq, presence):
    logits = random_logits(seed)
    history = list(np.random.default_rng(100 + seed).integers(0, logits.size, 40))
    penalties = stage(
        host,
        "penalties",
        repeat_last_n=last_n,
        repeat_penalty=repeat,
        frequency_penalty=freq,
        presence_penalty=presence,
    )
    out = penalties.apply(logits.copy(), history)
    same(out, ref_penalties(logits, history, last_n, repeat, freq, presence))


def test_repeat_penalty_pushes_both_signs_down(host):
    out = stage(host, "penalties", repeat_penalty=2.0).apply(np.array([4.0, -4.0, 1.0]), [0, 1])
    np.testing.assert_array_equal(out, [2.0, -8.0, 1.0])


def test_penalties_off(host):
    assert not stage(host, "penalties").enabled()
    assert not stage(host, "penalties", repeat_penalty=1.5, repeat_last_n=0).enabled()
    assert stage(host, "penalties", presence_penalty=0.1).enabled()


def test_enabled_flags(host):
    assert not stage(host, "top_k", top_k=0).enabled() and not stage(host, "top_k", top_k=-1).enabled()
    assert not stage(host, "top_p", top_p=1.0).enabled()
    assert not stage(host, "min_p", min_p=0.0).enabled()
    assert not stage(host, "temperature", temperature=0.0).enabled()


# --- the whole chain --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_chain_is_the_composition_of_the_references(host, seed):
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repeat_penalty=1.2, repeat_last_n=8)
    logits = random_logits(seed)
    history = [1, 2, 3, 5, 8, 13, 21, 34, 55, 2]
    x = logits.copy()
    for s in Sampler.build(params, host).stages:
        x = s.apply(x, history)
    expected = ref_penalties(logits, history, 8, 1.2, 0.0, 0.0)
    expected = ref_min_p(ref_top_p(ref_top_k(expected, 20), 0.9), 0.05) / 0.7
    same(x, expected)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_is_argmax(host, seed):
    logits = random_logits(seed, 200)
    assert Sampler.build(SamplingParams(temperature=0), host).sample(logits, []) == int(np.argmax(logits))


def test_greedy_applies_penalties(host):
    sampler = Sampler.build(SamplingParams(temperature=0, repeat_penalty=2.0), host)
    assert sampler.sample(np.array([1.0, 3.0, 2.0]), [1]) == 2


@pytest.mark.parametrize("seed", range(30))
def test_top_k_1_is_greedy(host, seed):
    logits = random_logits(seed, 200)
    sampler = Sampler.build(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0), host)
    assert all(sampler.sample(logits, []) == int(np.argmax(logits)) for _ in range(5))


def test_sample_does_not_touch_the_callers_logits(host):
    logits = np.linspace(-1, 1, 50, dtype=np.float32)
    before = logits.copy()
    Sampler.build(SamplingParams(top_k=3, repeat_penalty=1.5), host).sample(logits, [49, 48])
    np.testing.assert_array_equal(logits, before)


def test_sample_wants_one_row(host):
    with pytest.raises(ValueError, match="one row"):
        Sampler.build(SamplingParams(), host).sample(np.zeros((2, 8)), [])


def test_seeded_sampling_is_reproducible(host):
    logits = np.random.default_rng(0).normal(0, 1, 500)

    def draws(seed):
        sampler = Sampler.build(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed), host)
        return [sampler.sample(logits, []) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert draws(None) != draws(None)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 1.0), (1.6, 0.8)])
def test_categorical_follows_the_expected_distribution(host, temperature, top_p):
    logits = np.array([2.0, 1.5, 1.4, 1.0, 0.3, 0.0, -0.5, -1.0, -1.2, -2.0, -np.inf, 0.8])
    # top_p runs before temperature, so the kept set comes from the untempered probabilities
    kept = ref_top_p(logits, top_p)
    expected = np.array(probabilities(kept / temperature))
    params = SamplingParams(temperature=temperature, top_k=0, top_p=top_p, min_p=0.0, seed=1234)
    sampler = Sampler.build(params, host)
    n = 20000
    counts = np.bincount([sampler.sample(logits, []) for _ in range(n)], minlength=logits.size)
    support = expected > 0
    assert counts[~support].sum() == 0
    assert (n * expected[support] >= 5).all()
    chi2 = (((counts - n * expected)[support]) ** 2 / (n * expected[support])).sum()
    assert chi2 < CHI2_CRITICAL[int(support.sum()) - 1]


# --- parameters -------------------------------------------------------------------------------------------------


def test_defaults_are_llama_cpp_defaults():
    assert SamplingParams() == SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64,
        presence_penalty=0.0, frequency_penalty=0.0, seed=None,
    )  # fmt: skip


def test_resolve_request_then_gguf_then_defaults():
    metadata = {
        "general.sampling.temp": 0.6,
        "general.sampling.top_k": 20,
        "general.sampling.top_p": 0.8,
        "general.sampling.penalty_repeat": 1.1,
        "general.sampling.penalty_last_n": 128,
    }
    request = {"temperature": 0.2, "top_p": None, "seed": 5, "max_tokens": 100, "prompt": "hi"}
    p = SamplingParams.resolve(request, metadata)
    assert p == SamplingParams(
        temperature=0.2, top_k=20, top_p=0.8, min_p=0.05, repeat_penalty=1.1, repeat_last_n=128, seed=5
    )
    assert SamplingParams.resolve({}, {}) == SamplingParams()
    assert SamplingParams.resolve({"min_p": 0.0}, {"general.sampling.min_p": 0.1}).min_p == 0.0
    assert SamplingParams.resolve({}, {"general.sampling.min_p": 0.1}).min_p == 0.1


def test_resolve_normalises_numbers():
    p = SamplingParams.resolve({"top_k": np.int32(7), "temperature": 1}, {"general.sampling.top_p": np.float32(0.5)})
    assert (type(p.top_k), type(p.temperature), type(p.top_p)) == (int, float, float)
    assert (p.top_k, p.temperature, p.top_p) == (7, 1.0, 0.5)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")), ("top_k", 2.5), ("top_k", True),
     ("top_p", 1.5), ("top_p", -0.1), ("min_p", 2.0), ("repeat_penalty", 0.0), ("repeat_last_n", -2),
     ("presence_penalty", float("inf")), ("frequency_penalty", None), ("seed", -1), ("seed", 1.5)],
)  # fmt: skip
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})
    if value is not None:
        with pytest.raises(ValueError, match=f"^{field} "):
            SamplingParams.resolve({field: value}, {})


def test_invalid_gguf_value_names_the_key():
    with pytest.raises(
        ValueError, match=r"^top_p must be `float` <= 1.0, got 2.0 \(from the model's general\.sampling\.top_p"
    ):
        SamplingParams.resolve({}, {"general.sampling.top_p": 2.0})
