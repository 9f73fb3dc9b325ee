"""Sliding-window layers in their own KV page groups: the engine gives their pages back behind the window, and
everything it serves equals the same model with every layer on full-context pages (``window_pages=False``)."""

import leat
import numpy as np
import pytest
from leat.engine import Engine, GenerationRequest
from leat.speculative import Speculation, load_proposer
from leat.testing import write_tiny_gguf

GREEDY = {"temperature": 0}
WINDOW = 8


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def model(request, tmp_path_factory):
    if request.param == "gemma3":
        arch = pytest.importorskip("leat_arch_gemma.gemma").Gemma3
        params = arch.tiny(layers=3, window=WINDOW, pattern=3, context=1024)  # layers 0 and 1 slide
    else:
        arch = pytest.importorskip("leat_arch_gpt_oss.gpt_oss").GptOss
        params = arch.tiny(window=WINDOW, context=1024)  # layer 0 slides
    path = write_tiny_gguf(arch, tmp_path_factory.mktemp("kv-groups") / f"{request.param}.gguf", params=params)
    return leat.load(str(path), backend="cpu", precision="f32")


def engine(model, window_pages=True, **options):
    options = {"batch_size": 3, "max_context": 256, "page_size": 4, "prefill_chunk": 8} | options
    return Engine(model, window_pages=window_pages, **options)


def prompts(count, seed=0, lengths=(5, 30, 17, 45, 3, 26)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 290, lengths[i % len(lengths)]).tolist() for i in range(count)]


def generate(engine, prompt, n=20, **request):
    events = list(engine.submit(GenerationRequest(prompt, n, GREEDY, **request)))
    assert events[-1].kind == "done", events[-1]
    return [t for e in events for t in e.ids], events[-1].usage


def concurrently(engine, batch, n=20, **request):
    handles = [engine.submit(GenerationRequest(p, n, GREEDY, **request)) for p in batch]
    out = []
    for handle in handles:
        events = list(handle)
        assert events[-1].kind == "done", events[-1]
        out.append([t for e in events for t in e.ids])
    return out


def settled(engine):
    """Nothing running, nothing promised, and every page free or held once by the prefix cache, in every group."""
    assert not engine.running and not engine.waiting
    for pool in engine.pools:
        assert pool.reserved == 0
        assert sorted(pool.free + list(pool.cached.values())) == list(range(pool.pages))
        assert all(pool.refs[p] == 1 for p in pool.cached.values())


def test_windowed_layers_get_a_group_of_their_own(model):
    windowed, full = engine(model), engine(model, window_pages=False)
    assert windowed.windows == [None, WINDOW] and full.windows == [None]
    bound = -(-(WINDOW - 1 + 8) // 4) + 1  # the window behind a step's first position, and the step's 8
    assert [pool.pages for pool in windowed.pools] == [3 * 64, 3 * bound]
    assert [pool.pages for pool in full.pools] == [3 * 64]
    assert "window 8" in windowed.plan and "window" not in full.plan
    layers = model.architecture.kv_layouts(model.architecture.params)
    for layer, layout in enumerate(layers):
        assert windowed.kv.layer_pages(layer) == (3 * bound if layout.window else 3 * 64)
        assert full.kv.layer_pages(layer) == 3 * 64


def test_the_same_budget_gives_a_longer_context(model):
    budget, before = 200_000, model.backend.allocations.kv
    windowed = Engine(model, batch_size=2, page_size=16, prefill_chunk=8, kv_budget_bytes=budget)
    assert model.backend.allocations.kv - before <= budget
    full = Engine(model, batch_size=2, page_size=16, prefill_chunk=8, kv_budget_bytes=budget, window_pages=False)
    assert windowed.max_context > full.max_context


@pytest.mark.parametrize("chunk", [4, 32], ids=["chunk-under-window", "chunk-over-window"])
def test_concurrent_greedy_equals_full_pages(model, chunk):
    batch = prompts(6, seed=1)
    results = []
    for window_pages in (True, False):
        e = engine(model, window_pages, prefill_chunk=chunk).start()
        try:
            results.append(concurrently(e, batch, n=24))
        finally:
            e.stop()
        settled(e)
    assert results[0] == results[1]


def test_windowed_pages_stay_bounded_in_a_long_generation(model):
    e = engine(model, batch_size=1)
    peaks = [0, 0]
    step = e.step

    def counting_step():
        step()
        for group, pool in enumerate(e.pools):
            peaks[group] = max(peaks[group], pool.used())

    e.step = counting_step
    e.start()
    try:
        out, _ = generate(e, prompts(1, seed=2, lengths=(30,))[0], n=150, ignore_eos=True)
    finally:
        e.stop()
    assert len(out) == 150
    assert peaks[1] <= e.budget.window_pages(WINDOW) < 6  # about a window's pages, however long the sequence
    assert peaks[0] == -(-(30 + 150 - 1) // 4)  # the full-attention group holds every position
    settled(e)


def test_prefix_reuse_equals_full_pages(model):
    shared = prompts(1, seed=3, lengths=(41,))[0]
    results = []
    for window_pages in (True, False):
        e = engine(model, window_pages).start()
        try:
            first, cold = generate(e, shared, client="a")
            again, warm = generate(e, shared, client="a")
            longer, longer_usage = generate(e, shared[:30] + [5, 6, 7, 8, 9], client="a")
        finally:
            e.stop()
        settled(e)
        assert again == first and cold["cached_tokens"] == 0 and warm["cached_tokens"] == 40
        assert longer_usage["cached_tokens"] == 28  # the 7 whole pages of the shared 30 tokens
        results.append((first, longer))
    assert results[0] == results[1]


def test_reuse_waits_for_the_windowed_pages_too(model):
    # one slot: the windowed group has 5 pages, so a prompt's windowed pages are soon evicted from the prefix cache
    # while the full group's stay; a session regenerated from inside its prompt lacks the windowed pages there
    shared = prompts(1, seed=9, lengths=(41,))[0]
    results = []
    for window_pages in (True, False):
        e = engine(model, window_pages, batch_size=1).start()
        try:
            first, _ = generate(e, shared, client="a")
            again, again_usage = generate(e, shared, client="a")
            generate(e, shared, session="s")
            redo, redo_usage = generate(e, shared[:25] + [1, 2, 3], session="s")
        finally:
            e.stop()
        assert again == first
        results.append((first, redo, again_usage["cached_tokens"], redo_usage["cached_tokens"]))
    assert results[0][:2] == results[1][:2]
    assert results[1][2] == 40 and results[1][3] >= 25 and results[0][2:] == (40, 0)


def chat(model, window_pages, store):
    """A session continued, forked, both sides extended, one hibernated, the engine restarted, and restored."""
    first, second, left, right = prompts(4, seed=4, lengths=(19, 14, 9, 11))
    e = engine(model, window_pages, session_store=store).start()
    replies, usages = [], []

    def turn(engine, prompt, session):
        reply, usage = generate(engine, prompt, n=12, session=session)
        replies.append(reply)
        usages.append(usage["cached_tokens"])
        return prompt + reply

    try:
        a = turn(e, first, "a")
        a = turn(e, a + second, "a")
        e.fork_session("a", "b")
        b = turn(e, a + right, "b")
        a = turn(e, a + left, "a")
        e.hibernate("b")
        assert {s["name"]: s["hibernated"] for s in e.list_sessions()} == {"a": False, "b": True}
    finally:
        e.stop()
    restarted = engine(model, window_pages, session_store=store).start()
    try:
        turn(restarted, b + left, "b")
        restarted.drop_session("b")
    finally:
        restarted.stop()
    settled(restarted)
    return replies, usages


def test_sessions_fork_hibernate_and_restore_equal_full_pages(model, tmp_path):
    windowed, reused = chat(model, True, tmp_path / "windowed")
    full, full_reused = chat(model, False, tmp_path / "full")
    assert windowed == full
    assert reused == full_reused and all(reused[1:]), reused  # every later turn reused its session


def test_windowed_session_keeps_only_its_window(model):
    e = engine(model, batch_size=1).start()
    try:
        generate(e, prompts(1, seed=5, lengths=(40,))[0], n=20, session="s")
        with e._state:
            held = e.sessions.get("s").pages
    finally:
        e.stop()
    assert -1 not in held[0] and len(held[0]) == -(-59 // 4)
    assert sum(p >= 0 for p in held[1]) <= -(-WINDOW // 4) + 1


def test_one_slot_session_continues(model):
    # one slot has room for one window's worth of windowed pages: the session's and the request's must be the same
    first, second = prompts(2, seed=10, lengths=(30, 9))
    results = []
    for window_pages in (True, False):
        e = engine(model, window_pages, batch_size=1).start()
        try:
            reply, _ = generate(e, first, session="s", ignore_eos=True)
            again, usage = generate(e, first + reply + second, session="s", ignore_eos=True)
            third, third_usage = generate(e, first + reply + second + again + [4], session="s", ignore_eos=True)
            e.drop_session("s")
        finally:
            e.stop()
        settled(e)
        results.append((reply, again, third, usage["cached_tokens"], third_usage["cached_tokens"]))
    assert results[0] == results[1] and results[0][3:] == (30 + 19, 30 + 20 + 9 + 19)


def test_ngram_speculation_equals_full_pages(model):
    rng = np.random.default_rng(6)
    batch = [(rng.integers(0, 290, 3 + i).tolist() * 5)[: 12 + 5 * i] for i in range(4)]
    results = []
    for window_pages in (True, False):
        e = engine(model, window_pages, speculation=Speculation(load_proposer("ngram", model))).start()
        try:
            results.append(concurrently(e, batch, n=30))
            assert e.stats()["speculation"]["proposed"] > 0
        finally:
            e.stop()
        settled(e)
    plain = engine(model).start()
    try:
        expected = concurrently(plain, batch, n=30)
    finally:
        plain.stop()
    assert results[0] == results[1] == expected


def test_burst_with_cancellations_returns_every_page(model):
    rng = np.random.default_rng(7)
    e = engine(model, max_queue=40).start()
    try:
        handles = [
            e.submit(GenerationRequest(p, 30, GREEDY, client=f"c{i % 3}")) for i, p in enumerate(prompts(20, seed=8))
        ]
        doomed = set(rng.choice(len(handles), 8, replace=False).tolist())
        for i in sorted(doomed):
            handles[i].cancel()
        reasons = [list(h)[-1].finish_reason for h in handles]
    finally:
        e.stop()
    assert all(reasons[i] in ("stop", "length") for i in range(len(handles)) if i not in doomed)
    settled(e)
    assert sorted(e.free_slots) == list(range(e.batch_size))
