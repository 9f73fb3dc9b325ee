"""Speculative decoding: exact verification (greedy token for token, sampled by distribution) and the controller."""

import itertools
import json

import leat
import numpy as np
import pytest
from click.testing import CliRunner
from leat.cli import cli
from leat.engine import Engine, GenerationRequest
from leat.errors import LeatError
from leat.sampling import Sampler, SamplingParams
from leat.speculative import Controller, Proposer, Speculation, accept_greedy, load_proposer, verify
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

GREEDY = {"temperature": 0}
# chi-square critical values at p = 0.01 for 1, 2, ... degrees of freedom (no scipy here)
CHI2_01 = [6.635, 9.210, 11.345, 13.277, 15.086, 16.812, 18.475, 20.090, 21.666, 23.209, 24.725, 26.217, 27.688]
CHI2_01 += [29.141, 30.578, 32.000, 33.409, 34.805, 36.191, 37.566, 38.932, 40.289, 41.638, 42.980, 44.314]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(Llama, tmp_path_factory.mktemp("spec") / "tiny.gguf", params=Llama.tiny(context=512))
    return leat.load(str(path), backend="cpu", precision="f32")


def prompts(count, seed=0):
    """Half repetitive (a phrase said over), half random, of varied lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        phrase = rng.integers(0, 290, 3 + i % 5).tolist()
        out.append(phrase * (2 + i % 3) if i % 2 == 0 else rng.integers(0, 290, 4 + 7 * i % 40).tolist())
    return out


def run(model, batch, speculation=None, n=24, sampling=GREEDY, batch_size=4, **request):
    engine = Engine(
        model, batch_size=batch_size, max_context=256, page_size=8, prefill_chunk=16, speculation=speculation
    )
    handles = [engine.submit(GenerationRequest(p, n, sampling, **request)) for p in batch]
    engine.start()
    try:
        out = []
        for handle in handles:
            events = list(handle)
            assert events[-1].kind == "done", events[-1]
            out.append([t for e in events for t in e.ids])
        return out, engine
    finally:
        engine.stop()


class Oracle(Proposer):
    """Proposes the target's own greedy continuation, with every ``wrong``-th token replaced: long accepted spans
    and rejections at known places."""

    def __init__(self, model, wrong=3):
        super().__init__(model)
        self.wrong = wrong

    def propose(self, key, tokens, k):
        out = []
        while len(out) < k:
            out.append(int(np.argmax(self.model.logits(list(tokens) + out)[-1])))
        return [(t + 1) % 290 if (i + 1) % self.wrong == 0 else t for i, t in enumerate(out)]


@pytest.mark.parametrize("proposer", ["ngram", "draft-other", "draft-self"])
def test_greedy_equals_plain_decoding_in_a_shared_batch(model, tmp_path, proposer):
    batch = prompts(10)
    expected, plain = run(model, batch)
    if proposer == "ngram":
        spec = load_proposer("ngram", model)
    else:
        other = write_tiny_gguf(Llama, tmp_path / "draft.gguf", params=Llama.tiny(context=512, layers=1), seed=7)
        spec = load_proposer(
            "draft", model, draft=model if proposer == "draft-self" else leat.load(str(other), backend="cpu")
        )
    got, engine = run(model, batch, Speculation(spec))
    assert got == expected
    stats = engine.stats()["speculation"]
    assert stats["proposed"] > 0, stats  # an unrelated random draft is rarely right: acceptance may be 0
    if proposer == "ngram":
        assert stats["accepted"] > 0, stats
    if proposer == "draft-self":
        assert stats["accepted"] == stats["proposed"] and engine.steps < plain.steps / 2
    assert engine.pool.reserved == 0 and not engine.running


def test_accept_greedy_from_ids_equals_verify():
    """The engine verifies plain greedy rows from the backend's argmax ids alone: the same tokens as verify()."""
    rng = np.random.default_rng(3)
    sampler = Sampler.build(SamplingParams(temperature=0))
    for _ in range(200):
        k = int(rng.integers(1, 6))
        logits = rng.standard_normal((k + 1, 12))
        picks = np.argmax(logits, axis=-1)
        draft = [int(picks[i]) if rng.random() < 0.7 else int(rng.integers(0, 12)) for i in range(k)]
        assert accept_greedy(draft, picks) == verify(sampler, [1, 2], draft, logits)


def test_greedy_logprobs_through_verification(model):
    """A speculating greedy request that asks for logprobs still gets one per token (the whole rows come back)."""
    speculation = Speculation(load_proposer("ngram", model))
    engine = Engine(model, batch_size=1, max_context=200, speculation=speculation).start()
    try:
        prompt = list(range(5, 17)) * 4
        handle = engine.submit(GenerationRequest(prompt, 24, {"temperature": 0}, logprobs=0))
        events = [e for e in handle if e.kind == "tokens"]
        logprobs = [lp for e in events for lp in e.logprobs]
        assert len(logprobs) == sum(len(e.ids) for e in events) == 24 and all(lp <= 0 for lp in logprobs)
        assert len(events) < 24  # a verification's accepted tokens come in one event
        assert engine.stats()["speculation"]["verifications"] > 0
    finally:
        engine.stop()


def test_greedy_with_penalties_stops_and_rejections(model):
    batch = prompts(6, seed=3)
    sampling = {"temperature": 0, "repeat_penalty": 1.5, "repeat_last_n": 8}
    expected, _ = run(model, batch, n=20, sampling=sampling)
    got, engine = run(model, batch, Speculation(Oracle(model), max_draft=5), n=20, sampling=sampling)
    assert got == expected
    stats = engine.stats()["speculation"]
    assert 0 < stats["accepted"] < stats["proposed"]
    # a stop string ends the output mid-span exactly where plain decoding ends it
    text = model.detokenize(expected[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    plain_stop = list(model.generate(batch[0], 20, sampling, stop=[stop]))
    try:
        model.speculation = Speculation(Oracle(model))
        spec_stop = list(model.generate(batch[0], 20, sampling, stop=[stop]))
    finally:
        model.speculation = None
    assert spec_stop == plain_stop and len(plain_stop) < 20


def test_other_architectures_greedy(tmp_path):
    host = leat.plugins.host()
    tried = []
    for name, entry in sorted(host.registry["architectures"].items()):
        cls = entry.load()
        if name != cls.names[0] or name == "llama" or cls.drafts_only:
            continue  # one file per class
        try:
            path = write_tiny_gguf(cls, tmp_path / f"{name}.gguf", params=cls.tiny(context=256))
        except (TypeError, ValueError, NotImplementedError):
            continue
        target = leat.load(str(path), backend="cpu")
        batch = [[t % target.architecture.vocab_size for t in p] for p in prompts(4, seed=5)]
        expected, _ = run(target, batch, n=12)
        drafts = [] if target.architecture.recurrent else [load_proposer("draft", target, draft=target)]
        for spec in [load_proposer("ngram", target), *drafts]:  # a recurrent draft model cannot rewind
            got, _ = run(target, batch, Speculation(spec), n=12)
            assert got == expected, name
        tried.append(name)
    assert tried, "no other architecture could build a tiny model"
    print("architectures checked:", tried)


def test_page_budget_covers_drafts(model):
    # 5 pages of 8 tokens: one request of 12 + 28 tokens fits at a time; drafts must stay inside its pages
    engine = Engine(model, batch_size=2, max_context=64, page_size=8, speculation=Speculation(Oracle(model, 99)))
    engine.pool = type(engine.pool)(5, 8)
    handles = [engine.submit(GenerationRequest(list(range(s, s + 12)), 28, GREEDY)) for s in (0, 40)]
    engine.start()
    try:
        for handle in handles:
            assert list(handle)[-1].finish_reason in ("length", "stop")
    finally:
        engine.stop()
    assert engine.pool.reserved == 0


# -- sampled: the output distribution is the target's -------------------------------------------------


VOCAB = 5
CHAIN = SamplingParams(temperature=0.8, top_k=4, top_p=0.97, min_p=0.02, repeat_penalty=1.4, repeat_last_n=4, seed=11)


def target_logits(history):
    """A fixed small-vocabulary 'model': logits that depend on the last two tokens."""
    a, b = ([0, 0] + list(history))[-2:]
    return np.sin(np.arange(VOCAB) * 1.3 + a * 0.7 + b * 1.9) * 2.0


def draft_probabilities(history):
    x = np.cos(np.arange(VOCAB) * 0.9 + history[-1] * 1.1) * 1.5
    e = np.exp(x - x.max())
    return e / e.sum()


def exact(sampler, prompt, length):
    """Every continuation of ``length`` tokens with its probability under the sampler's full chain."""
    table = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        prob, history = 1.0, list(prompt)
        for t in seq:
            prob *= sampler.probabilities(target_logits(history), history)[t]
            history.append(t)
        table[seq] = prob
    return table


def chi_square(counts, table, n):
    stat, df = 0.0, -1
    for seq, prob in table.items():
        if prob * n >= 5:
            stat += (counts.get(seq, 0) - prob * n) ** 2 / (prob * n)
            df += 1
        else:
            assert counts.get(seq, 0) <= max(5, 20 * prob * n), seq  # rare cells stay rare
    return stat, df


@pytest.mark.parametrize("draft", ["point", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    sampler = Sampler.build(CHAIN)
    prompt, length, n = [1, 3], 2, 4000
    rng = np.random.default_rng(4)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        history = list(prompt)
        while len(history) < len(prompt) + length:
            k = min(2, len(prompt) + length - len(history))
            proposal, qs, extended = [], [], list(history)
            for _ in range(k):
                q = draft_probabilities(extended)
                t = int(rng.choice(VOCAB, p=q)) if draft == "distribution" else int(np.argmax(q))
                proposal.append(t)
                qs.append(q)
                extended.append(t)
            logits = np.stack([target_logits(history + proposal[:i]) for i in range(k + 1)])
            history += verify(sampler, history, proposal, logits, np.stack(qs) if draft == "distribution" else None)
        seq = tuple(history[len(prompt) : len(prompt) + length])
        counts[seq] = counts.get(seq, 0) + 1
    stat, df = chi_square(counts, exact(sampler, prompt, length), n)
    assert df >= 8 and stat < CHI2_01[df - 1], (stat, df)


class FixedGuess(Proposer):
    def propose(self, key, tokens, k):
        return [tokens[-1]] * k  # often rejected, sometimes accepted


def test_sampled_engine_output_follows_the_model(model):
    """Tiny llama, top-k 3: the distribution of the 2nd and 3rd tokens with speculation matches the exact one."""
    params = {"temperature": 1.5, "top_k": 3, "top_p": 1.0, "min_p": 0.0}
    prompt, n = [5, 9, 5, 9, 5], 1200
    sampler = Sampler.build(SamplingParams(**params))
    table: dict[tuple, float] = {}
    p1 = sampler.probabilities(model.logits(prompt)[-1], prompt)
    for t1 in np.flatnonzero(p1):
        p2 = sampler.probabilities(model.logits(prompt + [t1])[-1])
        for t2 in np.flatnonzero(p2):
            p3 = sampler.probabilities(model.logits(prompt + [t1, t2])[-1])
            for t3 in np.flatnonzero(p3):
                key = (int(t2), int(t3))
                table[key] = table.get(key, 0.0) + p1[t1] * p2[t2] * p3[t3]
    engine = Engine(
        model, batch_size=16, max_context=32, page_size=8, max_queue=n, speculation=Speculation(FixedGuess(model))
    )
    handles = [engine.submit(GenerationRequest(prompt, 3, {**params, "seed": i})) for i in range(n)]
    engine.start()
    counts: dict[tuple, int] = {}
    try:
        for handle in handles:
            ids = [t for e in handle for t in e.ids]
            counts[tuple(ids[1:3])] = counts.get(tuple(ids[1:3]), 0) + 1
    finally:
        engine.stop()
    assert engine.stats()["speculation"]["verifications"] >= n * 0.9
    stat, df = chi_square(counts, table, n)
    assert df >= 5 and stat < CHI2_01[df - 1], (stat, df, counts)


# -- the controller -----------------------------------------------------------------------------------


def test_controller_lengthens_good_drafts_and_pauses_bad_ones():
    good = Controller(max_draft=8)
    for _ in range(20):
        good.record(good.draft_length(), good.draft_length())
    assert good.draft_length() >= 6
    bad = Controller(max_draft=8, probe_every=4)
    lengths = []
    for _ in range(200):
        k = bad.draft_length()
        lengths.append(k)
        if k:
            bad.record(k, 0)
    assert sum(1 for k in lengths[50:] if k) < 15, "speculation kept running without paying"
    assert any(lengths[100:]), "a paused request never probes again"
    # acceptance returns: the probe succeeds and drafting resumes
    for _ in range(200):
        k = bad.draft_length()
        if k:
            bad.record(k, k)
    assert bad.draft_length() >= 4


@pytest.fixture(scope="module")
def smollm2():
    try:
        return leat.load("default", backend="cpu", pull=False)
    except LeatError as e:
        pytest.skip(f"SmolLM2 is not available offline: {e}")


@pytest.mark.slow
def test_smollm2_greedy_with_prompt_lookup(smollm2):
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    batch = [smollm2.tokenize(text), smollm2.tokenize("Roses are red, violets are blue. Roses are red,")]
    expected, _ = run(smollm2, batch, n=8, batch_size=2)
    got, engine = run(smollm2, batch, Speculation(load_proposer("ngram", smollm2)), n=8, batch_size=2)
    assert got == expected
    assert engine.stats()["speculation"]["accepted"] > 0


def test_cli_generate_speculates_with_the_same_output(model):
    path = str(model.file.path)
    args = ["generate", "-m", path, "-p", "the quick brown fox. the quick brown", "-n", "16", "--temperature", "0"]
    args += ["--backend", "cpu"]
    outputs = []
    for extra in ([], ["--speculate", "ngram"], ["--draft", path], ["--speculate", "off"]):
        result = CliRunner().invoke(cli, [*args, "--json", *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        outputs.append(json.loads(result.stdout)["ids"])
    assert all(ids == outputs[0] for ids in outputs)
    result = CliRunner().invoke(cli, [*args, "--speculate", "draft"])
    assert result.exit_code != 0 and "--draft" in result.output


def test_measured_step_costs_steer_the_draft_length():
    speculation = Speculation(Proposer(None), max_draft=8)
    controller = speculation.controller(Sampler.build(SamplingParams(temperature=0)))
    controller.acceptance = 0.95
    cost = lambda k: speculation.cost(1, k)
    assert controller.draft_length(cost) == 8  # nothing measured: the prior prices drafts cheaply
    for tokens, seconds in ((1, 0.3), (5, 0.6), (8, 0.7), (9, 10.0)):
        speculation.observe(tokens, 100.0)  # the first step of each size (a capture, a compile) is not counted
        assert tokens not in speculation.step_seconds
        speculation.observe(tokens, seconds)
    assert controller.draft_length(cost) == 7  # a 9-token step was measured slow: stay below it
    for tokens in range(2, 9):
        speculation.observe(tokens, 3.0)
        speculation.observe(tokens, 3.0)
    controller.acceptance = 0.3
    assert controller.draft_length(cost) == 1  # every draft costs ten plain steps: none pays, only probes
    controller.record(1, 0)
    assert controller.draft_length(cost) == 0


class FailsFor(Oracle):
    """The oracle's drafts, but its second proposal for request ``key`` raises."""

    def __init__(self, model, key):
        super().__init__(model)
        self.key, self.calls = key, 0

    def propose(self, key, tokens, k):
        if key == self.key:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("draft model gone")
        return super().propose(key, tokens, k)


def test_a_failing_proposal_ends_only_its_request(model):
    batch = prompts(3, seed=5)
    expected, _ = run(model, batch, n=16)
    engine = Engine(model, batch_size=4, max_context=256, page_size=8, speculation=Speculation(FailsFor(model, 2)))
    handles = [engine.submit(GenerationRequest(p, 16, GREEDY)) for p in batch]
    assert handles[1].id == 2
    engine.start()
    try:
        got = [list(h) for h in handles]
    finally:
        engine.stop()
    error = got[1][-1]
    assert error.kind == "error" and error.fault == "request"
    assert error.error == "drafting (FailsFor) failed: RuntimeError: draft model gone"
    assert [[t for e in got[i] for t in e.ids] for i in (0, 2)] == [expected[0], expected[2]]
    assert [t for e in got[1] for t in e.ids] == expected[1][: len([t for e in got[1] for t in e.ids])]
    assert engine.pool.reserved == 0 and not engine.running and engine.stats()["speculation"]["accepted"] > 0
