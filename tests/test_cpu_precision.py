"""The float32 CPU path agrees with the float64 oracle (computed live; llama.cpp is not involved).

Same measures as the llama.cpp agreement tests (:mod:`leat.compare`), with the float64 oracle as the
reference: top-1 agreement where the oracle's top-2 gap >= 1e-3, mean KL(f64 || f32) over the oracle's
top-64 tokens. The design's bars are top-1 >= 99% and mean KL < 1e-3; what is measured is far below
(KL ~1e-9 on the tiny files, ~1e-7 on SmolLM2: prompts' products round activations to int16 per 32
values), so each case also has a bar a bit above its measurement, to catch a regression long before it
would cross the design's.

Token ids are the ones recorded with the llama.cpp references (tests/references/), so these tests do
not depend on leat's tokenizer either.

Greedy decoding: SmolLM2's greedy continuation (up to 40 tokens) must be the same token for token in f32 and
f64, up to the first step where the oracle's own top-2 gap is below 1e-3 (there either token is a right
answer, so the comparison stops there and says so). The f64 continuation must also be what the f64
oracle's teacher-forced logits pick over the same steps (the one-token decode path with its KV cache
agrees with the batched prefill path).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import leat
import numpy as np
import pytest
from leat.compare import DEFAULT_MIN_GAP, combine, compare, first_near_tie, top2_gap

REFERENCES = Path(__file__).parent / "references"
MANIFEST = json.loads((REFERENCES / "llamacpp.json").read_text())


def _tiny_models():
    spec = importlib.util.spec_from_file_location("leat_tests_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_models = _tiny_models()

DESIGN_BARS = {"top1": 0.99, "kl": 1e-3}
TINY_BARS = {"top1": 0.99, "kl": 5e-8}  # measured: top-1 100%, mean KL <= 7.2e-9 (Q6_K; 2e-9 the others)
SMOLLM2_BARS = {"top1": 0.99, "kl": 5e-7}  # measured: top-1 100%, mean KL 7.7e-8 (per prompt <= 9.4e-8)
GREEDY_PROMPTS = ["p3", "p4"]  # a chat question (ending in an open assistant turn) and prose
# p3's continuation ends with an end-of-generation token after 37 (the 'stop' branch below), p4's runs to the limit
# ('length'); each token is a one-token forward in float64 and again in float32
GREEDY_TOKENS = 40


@pytest.fixture(scope="module")
def tokens():
    with np.load(REFERENCES / "llamacpp_tiny.npz") as tiny, np.load(REFERENCES / "llamacpp_smollm2.npz") as smol:
        out = {name: tiny[f"{name}/tokens"] for name in MANIFEST["tiny"]}
        out |= {p["key"]: smol[f"{p['key']}/tokens"] for p in MANIFEST["smollm2"]["prompts"]}
    return {k: [int(t) for t in v] for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(tiny_models.CONFIGS))
def test_tiny_f32_matches_f64(name, tokens, tmp_path):
    path = str(tiny_models.build(name, tmp_path / f"tiny-{name}.gguf"))
    ids = tokens[name] if name in tokens else list(range(1, 65))
    f64 = leat.load(path, backend="cpu", precision="f64").logits(ids, native=True)
    f32 = leat.load(path, backend="cpu", precision="f32").logits(ids, native=True)
    assert f32.dtype == np.float32, "the f32 path should compute in float32"
    agreement = compare(f64, f32, label=f"{name}: f32 vs f64")
    print(agreement)
    problems = agreement.failures(**DESIGN_BARS) + agreement.failures(**TINY_BARS)
    assert not problems, "; ".join(problems) + f"\n{agreement}"


@pytest.fixture(scope="module")
def smollm2(smollm2_f64):
    return smollm2_f64, leat.load("default", backend="cpu", precision="f32")


@pytest.mark.slow
def test_smollm2_f32_matches_f64(smollm2, smollm2_oracle, tokens):
    _, f32 = smollm2
    parts = []
    for prompt in MANIFEST["smollm2"]["prompts"]:
        ids, f64_logits = smollm2_oracle[prompt["key"]]
        assert ids == tokens[prompt["key"]]
        parts.append(compare(f64_logits, f32.logits(ids, native=True), label=f"{prompt['key']}: f32 vs f64"))
    pooled = combine(parts, label="SmolLM2 f32 vs f64, all prompts")
    report = "\n".join(map(str, [pooled, *parts]))
    print(report)
    problems = pooled.failures(**DESIGN_BARS) + pooled.failures(**SMOLLM2_BARS)
    for part in parts:
        problems += [f"{part.label}: {p}" for p in part.failures(**DESIGN_BARS)]
    assert not problems, "; ".join(problems) + "\n" + report


def greedy(model, ids: list[int]) -> tuple[list[int], str]:
    """The tokens greedy decoding yields after ``ids`` and why it finished ("stop": an end-of-generation token)."""
    out = [t.id for t in model.generate(ids, max_tokens=GREEDY_TOKENS, sampling={"temperature": 0}) if t.id >= 0]
    return out, model.last_timings.finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("key", GREEDY_PROMPTS)
def test_smollm2_greedy_f32_matches_f64(smollm2, tokens, key):
    f64, f32 = smollm2
    prompt = tokens[key]
    (want, want_end), (got, got_end) = greedy(f64, prompt), greedy(f32, prompt)
    # The f64 oracle's logits at each step of its own continuation (teacher-forced, one batch); the last
    # row is the step after it, which chose the end-of-generation token if the continuation stopped.
    steps = f64.logits(prompt + want, native=True)[len(prompt) - 1 :]
    picks = [int(t) for t in np.argmax(steps, axis=-1)]
    if want_end != "stop":
        steps, picks = steps[:-1], picks[:-1]
    gaps = top2_gap(steps)
    tie = first_near_tie(gaps, DEFAULT_MIN_GAP)
    n = len(steps) if tie is None else tie
    note = (
        f"{key}: compared all {len(steps)} steps (finish: {want_end})"
        if tie is None
        else f"{key}: compared the first {n} of {len(steps)} steps; at step {tie} the f64 oracle's top-2 gap is "
        f"{gaps[tie]:.2g} < {DEFAULT_MIN_GAP:g}, so either token is right from there on"
    )
    print(note, f"(smallest top-2 gap compared: {gaps[:n].min():.3g})" if n else "")
    if want_end == "stop":
        assert f64.tokenizer.is_eog(picks[-1]), f"{note}\nf64 decoding stopped, but its batched logits pick {picks[-1]}"
    decoded = want + ([picks[-1]] if want_end == "stop" else [])
    assert picks[:n] == decoded[:n], (
        f"{note}\nthe f64 one-token decode path and its batched logits disagree:\n{decoded[:n]}\n{picks[:n]}"
    )
    if tie is None:
        assert (got, got_end) == (want, want_end), f"{note}\nf64 ({want_end}): {want}\nf32 ({got_end}): {got}"
    else:
        assert got[:n] == want[:n], f"{note}\nf64: {want[:n]}\nf32: {got[:n]}"
