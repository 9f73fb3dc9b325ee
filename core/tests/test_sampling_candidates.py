"""Sampled requests served by top-k candidates (Backend.top_k) draw exactly the tokens the whole logit rows give,
and rows that need whole rows (penalties, no top_k, processors, logprobs, a top_k past 64) fetch them."""

import contextlib

import leat
import numpy as np
import pytest
from leat.backend import Backend
from leat.engine import Engine, GenerationRequest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(Llama, tmp_path_factory.mktemp("candidates") / "tiny.gguf", params=Llama.tiny(context=256))
    return leat.load(str(path), backend="cpu", precision="f32")


@contextlib.contextmanager
def fetches(backend):
    """Counts what the engine asks the backend for: "top_k", "argmax", and "rows" (whole logit rows)."""
    counts = {"top_k": 0, "argmax": 0, "rows": 0}
    inside = []

    def counted(name, real):
        def op(*args):
            counts[name] += 1
            inside.append(True)  # the defaults of top_k and argmax call to_host themselves
            try:
                return real(*args)
            finally:
                inside.pop()

        return op

    def to_host(x, real=backend.to_host):
        counts["rows"] += not inside
        return real(x)

    top_k = counted("top_k", lambda x, k: Backend.top_k(backend, x, k))  # the contract's default: numpy
    argmax = counted("argmax", backend.argmax)

    backend.top_k, backend.to_host, backend.argmax = top_k, to_host, argmax
    try:
        yield counts
    finally:
        del backend.top_k, backend.to_host, backend.argmax


def generate(model, requests, candidates):
    """Every request's tokens, all submitted before the engine starts (the same batches both ways)."""
    engine = Engine(model, batch_size=len(requests), max_context=128, prefill_chunk=16, top_k_candidates=candidates)
    handles = [engine.submit(r) for r in requests]
    engine.start()
    try:
        out = []
        for handle in handles:
            events = list(handle)
            assert events[-1].kind == "done", events[-1]
            out.append([t for e in events for t in e.ids])
        return out
    finally:
        engine.stop()


def prompt(seed, n=21):
    return np.random.default_rng(seed).integers(0, 290, n).tolist()


SETTINGS = [
    {"top_k": 1},
    {},  # the defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8
    {"top_k": 64, "top_p": 0.9, "min_p": 0.0, "temperature": 1.5},
    {"top_k": 40, "top_p": 1.0, "min_p": 0.1, "temperature": 0.5},
    {"top_k": 64, "top_p": 0.5, "min_p": 0.0, "temperature": 3.0},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults")
def test_candidates_draw_the_same_tokens_as_whole_rows(model, settings):
    requests = [GenerationRequest(prompt(s), 20, settings | {"seed": s}, ignore_eos=True) for s in (1, 2, 3)]
    with fetches(model.backend) as fast:
        got = generate(model, requests, candidates=True)
    with fetches(model.backend) as full:
        want = generate(model, requests, candidates=False)
    assert got == want
    assert fast["top_k"] > 0 and fast["rows"] == 0, fast
    assert full["top_k"] == 0 and full["rows"] > 0, full


def test_greedy_rows_among_sampled_ones_take_the_first_candidate(model):
    requests = [
        GenerationRequest(prompt(4), 16, {"temperature": 0}, ignore_eos=True),
        GenerationRequest(prompt(5), 16, {"top_k": 8, "seed": 5}, ignore_eos=True),
    ]
    with fetches(model.backend) as fast:
        got = generate(model, requests, candidates=True)
    assert fast["top_k"] > 0 and fast["rows"] == 0, fast
    assert got == generate(model, requests, candidates=False)


@pytest.mark.parametrize(
    "request_options",
    [
        {"sampling": {"repeat_penalty": 1.3, "seed": 1}},
        {"sampling": {"top_k": 0, "seed": 1}},
        {"sampling": {"top_k": 65, "seed": 1}},
        {"sampling": {"seed": 1}, "processors": [lambda logits, ids: logits]},
        {"sampling": {"seed": 1}, "logprobs": 2},
    ],
    ids=["penalties", "top_k 0", "top_k 65", "processors", "logprobs"],
)
def test_rows_that_read_more_than_the_top_k_fetch_whole_rows(model, request_options):
    requests = [GenerationRequest(prompt(6), 8, **request_options, ignore_eos=True)]
    with fetches(model.backend) as counts:
        got = generate(model, requests, candidates=True)
    assert counts["top_k"] == 0 and counts["rows"] > 0, counts
    assert got == generate(model, requests, candidates=False)
    # beside a row that candidates would serve, the step still fetches whole rows
    requests.append(GenerationRequest(prompt(7), 8, {"seed": 2}, ignore_eos=True))
    with fetches(model.backend) as counts:
        got = generate(model, requests, candidates=True)
    assert counts["rows"] >= 8, counts
    assert got == generate(model, requests, candidates=False)


def test_greedy_alone_still_fetches_only_ids(model):
    with fetches(model.backend) as counts:
        generate(model, [GenerationRequest(prompt(8), 8, {"temperature": 0})], candidates=True)
    assert counts["argmax"] > 0 and counts["top_k"] == 0 and counts["rows"] == 0, counts


def test_default_top_k_matches_a_stable_sort():
    class Host(Backend):
        def to_host(self, x):
            return np.asarray(x)

    rng = np.random.default_rng(0)
    x = (rng.integers(-6, 6, (5, 300)) / 2).astype(np.float32)  # many ties
    x[rng.random(x.shape) < 0.3] = -np.inf
    x[1] = -np.inf
    for k in (1, 7, 64, 400):
        values, ids = Host().top_k(x, k)
        order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, order)
        np.testing.assert_array_equal(values, np.take_along_axis(x, order, -1))
        assert values.dtype == np.float32 and ids.dtype == np.int64
