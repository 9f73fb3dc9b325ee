import threading
import time

import leat
import msgspec
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare
from leat.engine import Engine, Event, GenerationRequest, Overloaded, TooLong
from leat.sessions import SessionInUse
from leat.testing import FailsOnCall, write_tiny_gguf
from leat_arch_llama.llama import Llama

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(Llama, tmp_path_factory.mktemp("engine") / "tiny.gguf", params=Llama.tiny(context=512))
    return leat.load(str(path), backend="cpu", precision="f32")


def prompts(count, seed=0, lengths=(5, 40, 17, 3, 64, 9, 33, 2)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 290, lengths[i % len(lengths)]).tolist() for i in range(count)]


def tokens(handle):
    events = list(handle)
    assert events[-1].kind == "done", events[-1]
    return [t for e in events for t in e.ids], events[-1]


def alone(model, prompt, n=24, **request):
    engine = Engine(model, batch_size=1, max_context=256).start()
    try:
        return tokens(engine.submit(GenerationRequest(prompt, n, GREEDY, **request)))[0]
    finally:
        engine.stop()


def test_concurrent_greedy_equals_one_at_a_time(model):
    batch = prompts(8)
    expected = [alone(model, p) for p in batch]
    engine = Engine(model, batch_size=4, prefill_chunk=16, page_size=8, max_context=256).start()
    try:
        handles = [engine.submit(GenerationRequest(p, 24, GREEDY)) for p in batch]
        got = [tokens(h)[0] for h in handles]
        assert engine.steps < sum(len(p) // 16 + 24 for p in batch), "rows were not batched together"
    finally:
        engine.stop()
    assert got == expected


def test_short_prompts_arriving_together_prefill_in_one_step(model):
    # the step's prefill budget takes several prompts' chunks, not one prompt's
    batch = prompts(4, seed=3, lengths=(5, 9, 3, 12))  # 29 tokens: one step of 32
    expected = [alone(model, p, n=6) for p in batch]
    engine = Engine(model, batch_size=4, prefill_chunk=32, page_size=8, max_context=256)
    handles = [engine.submit(GenerationRequest(p, 6, GREEDY)) for p in batch]  # queued before the loop runs
    engine.start()
    try:
        got = [tokens(h)[0] for h in handles]
        assert engine.steps == 6, engine.steps  # one step prefills all four (their first tokens), five decode
    finally:
        engine.stop()
    assert got == expected
    # a prompt whose next chunk does not fit what is left waits for the next step: chunks stay as when alone
    long = prompts(2, seed=4, lengths=(20, 20))
    expected = [alone(model, p, n=4) for p in long]
    engine = Engine(model, batch_size=2, prefill_chunk=32, prefill_budget=32, page_size=8, max_context=256)
    handles = [engine.submit(GenerationRequest(p, 4, GREEDY)) for p in long]
    engine.start()
    try:
        got = [tokens(h)[0] for h in handles]
        assert engine.steps == 5, engine.steps  # the second prompt's 20 tokens wait one step
    finally:
        engine.stop()
    assert got == expected


def test_submissions_from_many_threads(model):
    batch = prompts(6, seed=1)
    expected = [alone(model, p, n=10) for p in batch]
    engine = Engine(model, batch_size=3, prefill_chunk=8, max_context=256).start()
    results = [None] * len(batch)

    def worker(i):
        results[i] = tokens(engine.submit(GenerationRequest(batch[i], 10, GREEDY)))[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    engine.stop()
    assert results == expected


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_reduced_kv_storage_keeps_top1(tmp_path, kv):
    path = write_tiny_gguf(Llama, tmp_path / "hd32.gguf", params=Llama.tiny(head_dim=32, context=512), seed=3)
    model = leat.load(str(path), backend="cpu", precision="f32")
    arch, backend = model.architecture, model.backend
    ids = np.random.default_rng(2).integers(0, 290, 200)
    outs = {}
    for dtype in ("f32", kv):
        cache = backend.allocate_kv(arch.kv_layouts(arch.params), 1, 256, dtype=dtype)
        outs[dtype] = backend.to_host(arch.forward(Batch([Row(0, 0, ids, all_logits=True)]), cache))
    agreement = compare(outs["f32"], outs[kv], label=f"{kv} KV vs f32 KV")
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)
    assert not np.array_equal(outs["f32"], outs[kv]), "the reduced storage was not used"


def test_too_long_is_refused_before_anything_is_allocated(model):
    engine = Engine(model, batch_size=2, max_context=64)
    with pytest.raises(TooLong, match="exceeds the context of 64 tokens") as info:
        engine.submit(GenerationRequest(list(range(60)), 10))
    assert info.value.limit == 64
    assert engine.pool.used() == 0 and not engine.waiting


def test_overload_refuses_when_queue_is_full_and_admitted_all_complete(model):
    """The queue counts requests beyond the free batch slots: 2 slots and a queue of 3 take 5 before a 429."""
    engine = Engine(model, batch_size=2, max_context=128, max_queue=3)
    accepted = [engine.submit(GenerationRequest(p, 8, GREEDY)) for p in prompts(5)]
    with pytest.raises(Overloaded) as info:
        engine.submit(GenerationRequest([1, 2, 3], 8))
    assert info.value.retry_after > 0
    engine.start()
    try:
        for handle in accepted:
            assert tokens(handle)[1].finish_reason in ("length", "stop")
    finally:
        engine.stop()
    assert engine.pool.reserved == 0 and not engine.running
    assert engine.pool.used() == len(engine.pool.cached)  # only reusable prefix pages stay


def test_admission_waits_for_pages_instead_of_running_out(model):
    # 6 pages of 16 tokens: each request reserves ceil((40 + 20) / 16) = 4 pages, so only one runs at a time
    engine = Engine(model, batch_size=4, max_context=96, page_size=16)
    engine.pool = type(engine.pool)(6, 16)
    handles = [engine.submit(GenerationRequest(p, 20, GREEDY)) for p in prompts(3, lengths=(40,))]
    engine.start()
    try:
        for handle in handles:
            assert tokens(handle)[1].usage["completion_tokens"] >= 1
    finally:
        engine.stop()


def test_cancel_frees_pages_at_once(model):
    engine = Engine(model, batch_size=2, max_context=256).start()
    try:
        handle = engine.submit(GenerationRequest(list(range(1, 50)), 200, GREEDY))
        first = next(iter(handle))
        assert first.kind == "tokens"
        handle.cancel()
        rest = list(handle)
        assert rest[-1].finish_reason == "cancelled"
        assert engine.pool.reserved == 0 and not engine.running
        assert engine.pool.used() == len(engine.pool.cached)
    finally:
        engine.stop()


def test_prefix_pages_are_reused_per_client(model):
    shared = prompts(1, seed=5, lengths=(50,))[0]
    engine = Engine(model, batch_size=2, max_context=256, page_size=8, prefill_chunk=8).start()
    try:
        first, _ = tokens(engine.submit(GenerationRequest(shared + [7], 5, GREEDY, client="alice")))
        assert engine.steps == 7 + 4  # 51 prompt tokens in chunks of 8, then 4 more decodes
        cached = len(engine.pool.cached)
        assert cached == 6  # the 51-token prompt fills 6 pages of 8
        steps = engine.steps
        again, _ = tokens(engine.submit(GenerationRequest(shared + [7], 5, GREEDY, client="alice")))
        assert again == first
        assert engine.steps - steps == 5  # prefill of the 3 uncached tokens took one step, then 4 decodes
        steps = engine.steps
        other, _ = tokens(engine.submit(GenerationRequest(shared + [7], 5, GREEDY, client="bob")))
        assert other == first and engine.steps - steps == 11  # bob does not see alice's pages
    finally:
        engine.stop()


def test_stop_strings_end_generation_and_are_not_sent(model):
    prompt = prompts(1, seed=7)[0]
    whole = list(model.generate(prompt, 30, GREEDY))
    text = "".join(t.text for t in whole)
    stop = text[10:13]
    assert len(stop) == 3 and model.detokenize([t.id for t in whole if t.id >= 0], skip_special=True) == text
    cut = list(model.generate(prompt, 30, GREEDY, stop=[stop]))
    assert "".join(t.text for t in cut) == text[: text.find(stop)]
    assert model.last_timings.finish_reason == "stop" and model.last_timings.generated_tokens == len(cut)
    assert [t.id for t in cut] == [t.id for t in whole[: len(cut)]]  # the last one completes the stop string


def test_logprobs_match_the_models_logits(model):
    prompt = prompts(1, seed=8)[0]
    engine = Engine(model, batch_size=1, max_context=256).start()
    try:
        events = [e for e in engine.submit(GenerationRequest(prompt, 4, GREEDY, logprobs=3)) if e.kind == "tokens"]
    finally:
        engine.stop()
    ids = [t for e in events for t in e.ids]
    chosen = [lp for e in events for lp in e.logprobs]
    tops = [top for e in events for top in e.top_logprobs]
    assert len(ids) == len(chosen) == len(tops) == 4 and len(events) == 4  # one event per step
    logits = model.logits(prompt + ids).astype(np.float64)
    for i, token in enumerate(ids):
        row = logits[len(prompt) - 1 + i]
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert chosen[i] == pytest.approx(logp[token], abs=1e-4)
        assert [t for t, _ in tops[i]] == list(np.argsort(-logp)[:3])


def test_a_prompts_scores_are_what_generating_it_scored(model, monkeypatch):
    """Engine.score (an echoed prompt's logprobs): each token after the first, scored after those before it, in
    prefill chunks; a greedy continuation, scored as part of a prompt, gets the logprobs and top tokens its decode
    steps gave it (another path through the model), and the prompt's own tokens those of the float64 logits."""
    monkeypatch.setattr("leat.model.PREFILL_CHUNK", 5)  # several chunks, one of them split by the continuation
    prompt = prompts(1, seed=10)[0]
    engine = Engine(model, batch_size=1, max_context=256).start()
    try:
        events = [e for e in engine.submit(GenerationRequest(prompt, 6, GREEDY, logprobs=3)) if e.kind == "tokens"]
        ids = [t for e in events for t in e.ids]
        scores = engine.score([prompt + ids], 3)[0]
    finally:
        engine.stop()
    assert len(scores) == len(prompt) + len(ids) - 1
    chosen = [lp for e in events for lp in e.logprobs]
    tops = [top for e in events for top in e.top_logprobs]
    for i, (logprob, top) in enumerate(scores[len(prompt) - 1 :]):
        assert logprob == pytest.approx(chosen[i], abs=1e-4) and [t for t, _ in top] == [t for t, _ in tops[i]]
    logits = model.logits(prompt + ids).astype(np.float64)
    for position, (logprob, top) in enumerate(scores):
        row = logits[position]
        logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert logprob == pytest.approx(logp[(prompt + ids)[position + 1]], abs=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-logp)[:3])


def test_events_cross_a_process_boundary_as_msgpack(model):
    engine = Engine(model, batch_size=1, max_context=256).start()
    try:
        events = list(engine.submit(GenerationRequest(prompts(1, seed=9)[0], 3, GREEDY, logprobs=2)))
    finally:
        engine.stop()
    wire = [msgspec.msgpack.encode(e) for e in events]
    assert [msgspec.msgpack.decode(w, type=Event) for w in wire] == events
    assert [e.kind for e in events] == ["tokens"] * 3 + ["done"]


def run(engine, prompt, n=6, **request):
    before = engine.steps
    out, _ = tokens(engine.submit(GenerationRequest(prompt, n, GREEDY, **request)))
    return out, engine.steps - before


def test_session_continues_without_reprefill(model):
    first_turn, second_turn = prompts(2, seed=11, lengths=(40, 20))
    engine = Engine(model, batch_size=2, max_context=256, page_size=8, prefill_chunk=8).start()
    try:
        reply, _ = run(engine, first_turn, session="chat")
        conversation = first_turn + reply + second_turn
        fresh, fresh_steps = run(engine, conversation, client="nobody-else")
        again, steps = run(engine, conversation, session="chat")
        assert again == fresh
        # the session holds 40 + 5 tokens (the last reply token is not in KV yet): 21 + 1 remain to prefill
        assert steps == 3 + 5 < fresh_steps
        assert engine.list_sessions() == [
            {"name": "chat", "tokens": len(conversation) + 5, "pages": 9, "hibernated": False}
        ]
    finally:
        engine.stop()


def test_fork_shares_pages_until_they_diverge(model):
    base, left, right = prompts(3, seed=12, lengths=(43, 7, 9))
    engine = Engine(model, batch_size=2, max_context=256, page_size=8, prefill_chunk=64).start()
    try:
        reply, _ = run(engine, base, n=1, session="a")
        engine.fork_session("a", "b")
        used = engine.pool.used()
        want_left, _ = run(engine, base + reply + left, client="x")
        want_right, _ = run(engine, base + reply + right, client="y")
        got_left, _ = run(engine, base + reply + left, session="a")
        got_right, _ = run(engine, base + reply + right, session="b")
        assert (got_left, got_right) == (want_left, want_right)
        sessions = {s["name"]: s for s in engine.list_sessions()}
        assert sessions["a"]["tokens"] == sessions["b"]["tokens"] - 2
    finally:
        engine.stop()
    assert used < 2 * 6 + len(engine.pool.cached)  # the fork took no pages of its own


def test_hibernate_and_restore_across_restart(model, tmp_path):
    first_turn, second_turn = prompts(2, seed=13, lengths=(30, 10))
    engine = Engine(model, batch_size=1, max_context=256, page_size=8, prefill_chunk=8, session_store=tmp_path).start()
    try:
        reply, _ = run(engine, first_turn, session="s1")
        conversation = first_turn + reply + second_turn
        expected, _ = run(engine, conversation, client="fresh")
        engine.hibernate("s1")
        assert engine.list_sessions()[0]["hibernated"] and (tmp_path / "s1.npz").exists()
    finally:
        engine.stop()
    restarted = Engine(
        model, batch_size=1, max_context=256, page_size=8, prefill_chunk=8, session_store=tmp_path
    ).start()
    try:
        assert restarted.list_sessions() == [{"name": "s1", "tokens": 35, "pages": 0, "hibernated": True}]
        got, steps = run(restarted, conversation, session="s1")
        assert got == expected and steps == 2 + 5
    finally:
        restarted.stop()


def test_idle_sessions_make_room_under_memory_pressure(model, tmp_path):
    engine = Engine(model, batch_size=2, max_context=96, page_size=16, session_store=tmp_path)
    engine.pool = type(engine.pool)(8, 16)
    engine.start()
    try:
        for name, prompt in zip(("a", "b", "c"), prompts(3, seed=14, lengths=(40,))):
            run(engine, prompt, n=10, session=name)  # each needs 4 pages: only two fit at once
        states = {s["name"]: s["hibernated"] for s in engine.list_sessions()}
        assert states["c"] is False and sum(states.values()) >= 1
    finally:
        engine.stop()


def test_a_session_being_extended_cannot_be_forked_hibernated_or_restored(model, tmp_path):
    engine = Engine(model, batch_size=1, max_context=128, page_size=8, session_store=tmp_path)
    engine.create_session("a")
    assert engine.list_sessions() == [{"name": "a", "tokens": 0, "pages": 0, "hibernated": False}]
    engine.submit(GenerationRequest(prompts(1, seed=15, lengths=(20,))[0], 8, GREEDY, session="a"))
    engine._admit()  # as the scheduler does before a step: the request holds the session until it ends
    for call in (lambda: engine.fork_session("a", "b"), lambda: engine.fork_session("b", "a")):
        with pytest.raises(SessionInUse):
            call()
    for call in (engine.hibernate, engine.restore_session, engine.drop_session):
        with pytest.raises(SessionInUse):
            call("a")
    while engine.running:
        engine.step()
    engine.hibernate("a")
    assert {s["name"]: s["hibernated"] for s in engine.list_sessions()}["a"] is True
    engine.restore_session("a")
    assert {s["name"]: s["pages"] > 0 for s in engine.list_sessions()}["a"] is True
    engine.fork_session("a", "b")
    assert (tmp_path / "b.npz").exists()  # a fork is kept across restarts as a continued session is


def test_bad_session_name_is_refused(model):
    engine = Engine(model, batch_size=1, max_context=64)
    with pytest.raises(Exception, match="session name"):
        engine.fork_session("../etc", "x")


def test_burst_with_random_cancellations_returns_every_page(model):
    rng = np.random.default_rng(21)
    engine = Engine(model, batch_size=3, max_context=128, page_size=8, prefill_chunk=8, max_queue=40).start()
    try:
        handles = [
            engine.submit(GenerationRequest(p, 30, GREEDY, client=f"c{i % 3}"))
            for i, p in enumerate(prompts(24, seed=22))
        ]
        doomed = set(rng.choice(len(handles), 10, replace=False).tolist())
        for i in sorted(doomed):
            handles[i].cancel()
        reasons = [list(h)[-1].finish_reason for h in handles]
    finally:
        engine.stop()
    assert all(reasons[i] in ("stop", "length") for i in range(len(handles)) if i not in doomed)
    assert sum(reasons[i] == "cancelled" for i in doomed) >= 5  # most were still waiting or running
    # checked, not assumed: every page not held by the prefix cache is on the free list, once
    assert engine.pool.reserved == 0 and not engine.running and not engine.waiting
    assert sorted(engine.pool.free + list(engine.pool.cached.values())) == list(range(engine.pool.pages))
    assert all(engine.pool.refs[p] == 1 for p in engine.pool.cached.values())
    assert engine.free_slots and sorted(engine.free_slots) == list(range(engine.batch_size))


def test_reused_prompt_tokens_are_reported_as_cached(model):
    shared = prompts(1, seed=23, lengths=(40,))[0]
    engine = Engine(model, batch_size=1, max_context=128, page_size=8).start()
    try:
        cold_tokens, cold = tokens(engine.submit(GenerationRequest(shared + [3], 4, GREEDY)))
        warm_tokens, warm = tokens(engine.submit(GenerationRequest(shared + [3], 4, GREEDY)))
        turn, _ = tokens(engine.submit(GenerationRequest(shared, 4, GREEDY, session="s")))
        second, second_done = tokens(engine.submit(GenerationRequest(shared + turn + [9], 4, GREEDY, session="s")))
        fresh, _ = tokens(engine.submit(GenerationRequest(shared + turn + [9], 4, GREEDY, client="other")))
    finally:
        engine.stop()
    assert cold.usage["cached_tokens"] == 0 and warm.usage["cached_tokens"] == 40 and warm_tokens == cold_tokens
    assert second_done.usage["cached_tokens"] == 40 + 3 and second == fresh


class FailingForward:
    """The backend, but its ``n``-th forward pass raises."""

    def __init__(self, backend, n):
        self.backend, self.n, self.calls = backend, n, 0

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def run(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("device lost")
        return self.backend.run(*args, **kwargs)


def run_together(model, requests, batch_size=4):
    """Every request's events, all submitted before the engine starts; and the stopped engine."""
    engine = Engine(model, batch_size=batch_size, max_context=128, page_size=8, prefill_chunk=16)
    handles = [engine.submit(r) for r in requests]
    engine.start()
    try:
        return [list(h) for h in handles], engine
    finally:
        engine.stop()


def assert_all_pages_back(engine):
    stats = engine.stats()
    assert stats["running"] == 0 and stats["kv_pages_used"] == stats["kv_pages_cached"], stats
    assert engine.pool.reserved == 0 and sorted(engine.free_slots) == list(range(engine.batch_size))


@pytest.mark.parametrize("sampling", [GREEDY, {"temperature": 0.8, "top_k": 20, "seed": 3}])
def test_a_request_whose_processor_fails_ends_alone(model, sampling):
    batch = prompts(3, seed=30)
    clean = [GenerationRequest(p, 12, sampling, ignore_eos=True) for p in batch]
    expected, _ = run_together(model, clean)
    poisoned = GenerationRequest(prompts(1, seed=31)[0], 12, GREEDY, processors=[FailsOnCall(3)])
    got, engine = run_together(model, [clean[0], poisoned, clean[1], clean[2]])
    error = got[1][-1]
    assert error.kind == "error" and error.fault == "request", error
    assert error.error == "test constraint failed: ValueError: poisoned"
    assert sum(len(e.ids) for e in got[1]) == 2  # its two tokens before the third call failed
    others = [got[0], got[2], got[3]]
    assert [e[-1].kind for e in others] == ["done"] * 3
    assert [[t for e in events for t in e.ids] for events in others] == [
        [t for e in events for t in e.ids] for events in expected
    ]
    assert_all_pages_back(engine)


def test_a_failing_sampler_or_logprobs_ends_only_its_request(model, monkeypatch):
    def broken(*args):
        raise FloatingPointError("nan")

    batch = prompts(3, seed=32)
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 1}
    clean = [GenerationRequest(batch[0], 10, GREEDY), GenerationRequest(batch[2], 10, sampled)]
    expected, _ = run_together(model, clean)
    monkeypatch.setattr("leat.engine.log_softmax", broken)
    engine = Engine(model, batch_size=4, max_context=128, page_size=8, prefill_chunk=16)
    requests = [
        clean[0],
        GenerationRequest(batch[1], 10, GREEDY, logprobs=0),
        clean[1],
        GenerationRequest(batch[1], 10, sampled),
    ]
    handles = [engine.submit(r) for r in requests]
    engine.waiting[3].sampler.sample = broken
    engine.start()
    try:
        got = [list(h) for h in handles]
    finally:
        engine.stop()
    assert [events[-1].kind for events in got] == ["done", "error", "done", "error"]
    assert got[1][-1].error == "logprobs failed: FloatingPointError: nan" and got[1][-1].fault == "request"
    assert got[3][-1].error == "sampling failed: FloatingPointError: nan" and got[3][-1].fault == "request"
    assert [[t for e in got[i] for t in e.ids] for i in (0, 2)] == [[t for e in x for t in e.ids] for x in expected]
    assert_all_pages_back(engine)


def test_a_failed_forward_pass_ends_every_running_request_and_the_engine_goes_on(model):
    batch = prompts(3, seed=33)
    engine = Engine(model, batch_size=4, max_context=128, page_size=8, prefill_chunk=16)
    engine.backend = FailingForward(engine.backend, 4)
    handles = [engine.submit(GenerationRequest(p, 10, GREEDY)) for p in batch]
    engine.start()
    try:
        ends = [list(h)[-1] for h in handles]
        assert all(e.kind == "error" and e.fault == "engine" for e in ends), ends
        assert ends[0].error == "engine step failed: RuntimeError: device lost"
        assert_all_pages_back(engine)
        after, _ = tokens(engine.submit(GenerationRequest(batch[0], 10, GREEDY)))
    finally:
        engine.stop()
    assert after == alone(model, batch[0], n=10)


def test_on_an_asynchronous_backend_a_steps_events_go_out_while_the_next_step_runs(model, monkeypatch):
    """A backend whose forward returns before the device finishes gets the last step's events sent after the next
    step is launched (host work beside device work); every event still arrives, in order, and the output is the
    same."""
    import leat.engine as engine_module

    batch = prompts(3, seed=7)
    expected = [alone(model, p, n=10) for p in batch]
    calls = []
    run, deliver = model.backend.run, engine_module.deliver
    monkeypatch.setattr(model.backend, "asynchronous", True, raising=False)
    monkeypatch.setattr(model.backend, "run", lambda *a: calls.append("run") or run(*a))
    monkeypatch.setattr(engine_module, "deliver", lambda events: calls.append("send") or deliver(events))
    engine = Engine(model, batch_size=3, max_context=128)
    handles = [engine.submit(GenerationRequest(p, 10, GREEDY)) for p in batch]
    engine.start()
    try:
        assert [tokens(h)[0] for h in handles] == expected
    finally:
        engine.stop()
    first_run = calls.index("run")
    # after the first step, every step's launch comes before the previous step's events are sent
    assert calls[first_run : first_run + 4] == ["run", "run", "send", "run"], calls[:8]
    assert calls[-1] == "send"


def test_on_an_asynchronous_backend_a_step_with_a_prompt_chunk_sends_the_last_steps_events_first(model, monkeypatch):
    """A step that carries a prompt chunk is slow to launch (an eager forward of many tokens): the running requests'
    tokens of the step before go out before it is launched, not after."""
    import leat.engine as engine_module

    calls = []
    run, deliver = model.backend.run, engine_module.deliver
    monkeypatch.setattr(model.backend, "asynchronous", True, raising=False)

    def recorded_run(forward, batch, kv, *rest):
        calls.append("prompt" if any(len(row.tokens) > 1 for row in batch.rows) else "run")
        return run(forward, batch, kv, *rest)

    monkeypatch.setattr(model.backend, "run", recorded_run)
    monkeypatch.setattr(engine_module, "deliver", lambda events: calls.append("send") or deliver(events))
    first, second = prompts(2, seed=9)
    engine = Engine(model, batch_size=2, max_context=128).start()
    try:
        running = iter(engine.submit(GenerationRequest(first, 30, GREEDY, ignore_eos=True)))
        next(running)  # decoding now
        later = engine.submit(GenerationRequest(second, 4, GREEDY))
        assert tokens(later)[0] == alone(model, second, n=4)
        list(running)
    finally:
        engine.stop()
    launch = calls.index("prompt", 1)  # the second prompt's chunk, launched while the first request decodes
    before = calls[:launch]
    assert before.count("send") == before.count("run") + before.count("prompt"), calls[: launch + 1]


def test_page_tables_are_written_only_when_a_rows_pages_change(model, monkeypatch):
    writes = []
    set_pages = model.backend.set_pages
    monkeypatch.setattr(model.backend, "set_pages", lambda *a, **k: writes.append(a[1]) or set_pages(*a, **k))
    engine = Engine(model, batch_size=1, max_context=128, page_size=8).start()
    try:
        tokens(engine.submit(GenerationRequest(prompts(1, lengths=(5,))[0], 40, GREEDY, ignore_eos=True)))
    finally:
        engine.stop()
    assert len(writes) == -(-(5 + 40) // 8)  # one per page the row grew into, not one per step (45 steps)


def test_profile_records_each_steps_time(model):
    engine = Engine(model, batch_size=2, max_context=128, profile=True).start()
    try:
        for handle in [engine.submit(GenerationRequest(p, 6, GREEDY)) for p in prompts(2)]:
            tokens(handle)
    finally:
        engine.stop()
    assert len(engine.profile) == engine.steps > 0
    assert all(s.rows >= 1 and s.tokens >= s.rows and s.prepare > 0 and s.finish > 0 for s in engine.profile)
    assert all(s.device is None for s in engine.profile)  # the cpu backend cannot tell device time apart
    # the prompts' tokens are counted as prompt chunks once each, in steps that began one after another
    assert sum(s.prompt_tokens for s in engine.profile) == sum(len(p) for p in prompts(2))
    assert all(s.prompt_tokens == 0 for s in engine.profile[-3:])  # the last steps only decode
    assert all(a.at < b.at for a, b in zip(engine.profile, engine.profile[1:]))


def test_start_runs_the_backends_warm_up_steps_then_counts_from_zero(model, monkeypatch):
    """A backend that names warm-up steps (the CUDA backend: cuBLAS loads a size class's kernels on first use) gets
    a step of each size when the engine starts, over prompts of at most a chunk each; the engine's counters start
    after them, their pages come back, and a request after them answers as on an engine without them."""
    expected = alone(model, prompts(1)[0], n=6)
    monkeypatch.setattr(model.backend, "warm_up_steps", (40, 100, 1000), raising=False)
    engine = Engine(model, batch_size=4, prefill_chunk=32, page_size=8, max_context=256, profile=True).start()
    try:
        warm = list(engine.profile)
        # 40 tokens (32 + 8), 100 (32 x 3 + 4), 1000 capped at four slots of a chunk each (128)
        assert [(s.rows, s.prompt_tokens) for s in warm] == [(2, 40), (4, 100), (4, 128)]
        assert engine.steps == engine.prefill_steps == 0 and engine.busy == 0
        stats = engine.stats()
        assert stats["running"] == stats["queue_depth"] == 0 and stats["kv_pages_used"] == 0
        assert tokens(engine.submit(GenerationRequest(prompts(1)[0], 6, GREEDY)))[0] == expected
        assert engine.steps == 6
    finally:
        engine.stop()


class FeedingBackend:
    """The CPU backend made to feed tokens as a device backend does: ``argmax_async`` answers are read later, and
    ``run(..., fed=)`` takes a step's tokens from the last step's answer (counted in ``fed_steps``)."""

    def __init__(self, backend):
        self.argmax, self.backend_run, self.fed_steps = backend.argmax, backend.run, 0

    def argmax_async(self, x):
        ids = self.argmax(x)
        return type("Ids", (), {"result": lambda self: ids})()

    def run(self, forward, batch, kv, fed=None):
        if fed is not None:
            self.fed_steps += 1
            assert all(len(r.tokens) == 1 and r.tokens[0] == 0 for r in batch.rows)  # placeholders
            ids, index = fed
            tokens = ids.result()[index]
            batch = Batch([Row(r.slot, r.start, tokens[i : i + 1]) for i, r in enumerate(batch.rows)])
        return self.backend_run(forward, batch, kv)


def test_a_pipelined_step_takes_its_tokens_from_the_last_steps_argmax(model, monkeypatch):
    """Where the backend feeds tokens, a decode step is queued before the last step's tokens reach the host; the
    output is the same as one request at a time, requests ending (by length, at different steps) or cancelled
    mid-pipeline drop their queued row, and every page comes back."""
    batch = prompts(5, seed=31)
    lengths = [7, 12, 3, 20, 12]
    expected = [alone(model, p, n=n) for p, n in zip(batch, lengths)]
    feeding = FeedingBackend(model.backend)
    monkeypatch.setattr(model.backend, "feeds_tokens", True, raising=False)
    monkeypatch.setattr(model.backend, "argmax_async", feeding.argmax_async)
    monkeypatch.setattr(model.backend, "run", feeding.run)
    engine = Engine(model, batch_size=4, max_context=128, page_size=8)
    handles = [engine.submit(GenerationRequest(p, n, GREEDY)) for p, n in zip(batch, lengths)]
    engine.start()
    try:
        assert [tokens(h)[0] for h in handles] == expected
        assert feeding.fed_steps == engine.steps_ahead > 10
        doomed = engine.submit(GenerationRequest(batch[0], 60, GREEDY, ignore_eos=True))
        kept = engine.submit(GenerationRequest(batch[1], 30, GREEDY, ignore_eos=True))
        next(iter(doomed))
        doomed.cancel()
        assert list(doomed)[-1].finish_reason == "cancelled"
        assert tokens(kept)[0] == alone(model, batch[1], n=30, ignore_eos=True)
    finally:
        engine.stop()
    assert_all_pages_back(engine)
    monkeypatch.undo()
    engine = Engine(model, batch_size=4, max_context=128, page_size=8, pipeline=False).start()
    try:
        assert tokens(engine.submit(GenerationRequest(batch[3], 20, GREEDY)))[0] == expected[3]
    finally:
        engine.stop()
    assert engine.steps_ahead == 0


def test_a_session_call_during_a_busy_run_waits_for_a_step_not_for_the_run(model):
    # the scheduler holds its state through each step and took it back at once: a call from another thread
    # starved until the run ended (895 ms of a 1.15 s run here, ~1.7 s on the H200); now it gets in between steps
    engine = Engine(model, batch_size=4, max_context=512)
    forward = engine._forward

    def device_step(*args, **kwargs):  # a step on a device: the scheduler waits with the interpreter lock released
        time.sleep(0.01)
        return forward(*args, **kwargs)

    engine._forward = device_step
    engine.start()
    try:
        handles = [engine.submit(GenerationRequest(p, 150, GREEDY, ignore_eos=True)) for p in prompts(4)]
        while engine.steps < 5:
            time.sleep(0.005)
        time.sleep(0.2)  # a caller idle a while (as a link's reader is) lost the race to the lock in 2 of 3 runs here
        for call in (engine.list_sessions, engine.stale_sessions):
            started = time.perf_counter()
            call()
            assert time.perf_counter() - started < 1.0
        assert engine.steps < 100  # the run (150 steps) was still going: the calls did not wait it out
        assert all(tokens(h)[1].finish_reason == "length" for h in handles)
    finally:
        engine.stop()
