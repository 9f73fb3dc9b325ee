"""The engine behind a socket: a frontend's RemoteEngine against an EngineHost serving a real Engine (here on a
thread of the test process; `leat serve --api-workers` runs it in a process of its own)."""

import asyncio
import socket
import threading
import time

import leat
import numpy as np
import pytest
from leat.engine import Engine, GenerationRequest, Overloaded, TooLong
from leat.engine_process import EngineHost, EngineUnavailable, RemoteEngine, _Frontend
from leat.errors import LeatError
from leat.sampling import SamplingParams
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

GREEDY = SamplingParams(temperature=0.0)
KEY = b"test-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(Llama, tmp_path_factory.mktemp("remote") / "tiny.gguf", params=Llama.tiny(context=512))
    return leat.load(str(path), backend="cpu", precision="f32")


@pytest.fixture
def served(model, tmp_path):
    engine = Engine(model, batch_size=4, max_context=128, max_queue=2).start()
    host = EngineHost(engine, str(tmp_path / "engine.sock"), KEY)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    remote = RemoteEngine(host.address, KEY, timeout=10)
    yield engine, host, remote
    remote.stop()
    host.close()
    engine.stop()


def ids(handle):
    events = list(handle)
    return [t for e in events for t in e.ids], events[-1]


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 290, length).tolist() for length in (7, 30, 12, 3, 21, 9)[:n]]


def test_remote_requests_equal_local_ones(model, served):
    engine, _, remote = served
    batch = prompts(4)
    local = [ids(engine.submit(GenerationRequest(p, 12, GREEDY)))[0] for p in batch]
    handles = [remote.submit(GenerationRequest(p, 12, GREEDY, logprobs=2)) for p in batch]
    results = [ids(h) for h in handles]
    assert [r[0] for r in results] == local
    assert all(r[1].kind == "done" and r[1].usage["completion_tokens"] == len(r[0]) for r in results)
    assert remote.max_context == engine.max_context and remote.info["vocab_size"] == model.architecture.vocab_size
    assert remote.stats()["kv_pages_used"] == engine.stats()["kv_pages_used"]


def test_a_submit_from_an_event_loop_leaves_the_loop_running(model, served, monkeypatch):
    """Before: an API process's event loop stopped for each request's round trip to the engine, so a burst's
    requests reached the engine one answer after another and every stream of that process stalled meanwhile."""
    engine, _, remote = served
    answer = _Frontend.submit
    monkeypatch.setattr(_Frontend, "submit", lambda self, message: (time.sleep(0.3), answer(self, message))[1])
    batch = prompts(3)

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        handles = await asyncio.gather(*(remote.submit_async(GenerationRequest(p, 8, GREEDY)) for p in batch))
        with pytest.raises(TooLong):
            await remote.submit_async(GenerationRequest([1, 2, 3], 1000, GREEDY))
        ticker.cancel()
        return handles, ticks

    handles, ticks = asyncio.run(main())
    assert ticks >= 40  # four answers 0.3 s apart: the loop ran through them (a blocking submit: 0 ticks)
    assert [ids(h)[0] for h in handles] == [ids(engine.submit(GenerationRequest(p, 8, GREEDY)))[0] for p in batch]


def test_refusals_cross_as_the_engines_errors(served):
    _, _, remote = served
    with pytest.raises(TooLong):
        remote.submit(GenerationRequest([1, 2, 3], 1000, GREEDY))
    with pytest.raises(LeatError, match="out of range"):
        remote.submit(GenerationRequest([10**6], 4, GREEDY))
    held = [remote.submit(GenerationRequest(p, 90, GREEDY)) for p in prompts(6)]  # 4 slots + a queue of 2
    with pytest.raises(Overloaded):
        remote.submit(GenerationRequest([1, 2], 4, GREEDY))
    for handle in held:
        handle.cancel()
        assert list(handle)[-1].kind == "done"


def test_processors_cross_by_spec(model, served):
    _, _, remote = served
    target = 42

    def bias(logits, history):
        logits[target] += 1000.0
        return logits

    bias.spec = ("logit_bias", {str(target): 1000.0})
    got, _ = ids(remote.submit(GenerationRequest([5, 6, 7], 4, GREEDY, processors=[bias])))
    assert got == [target] * 4
    with pytest.raises(LeatError, match="no spec"):
        remote.submit(GenerationRequest([5, 6, 7], 4, GREEDY, processors=[lambda logits, history: logits]))


def test_a_frontend_that_goes_away_frees_its_requests(model, served, tmp_path):
    engine, host, _ = served
    other = RemoteEngine(host.address, KEY, timeout=10)
    for p in prompts(3):
        other.submit(GenerationRequest(p, 90, GREEDY))
    other.stop()  # the frontend process died
    for _ in range(200):
        if not engine.running and not engine.waiting:
            break
        threading.Event().wait(0.02)
    assert not engine.running and engine.pool.reserved == 0


def test_an_engine_that_goes_away_ends_requests_in_flight_with_an_error(model, served, tmp_path):
    engine, host, remote = served
    handles = [remote.submit(GenerationRequest(p, 90, GREEDY)) for p in prompts(3)]
    host.close()  # the engine process died
    for handle in handles:
        last = list(handle)[-1]
        assert last.kind == "error" and last.fault == "unavailable", last
    with pytest.raises(EngineUnavailable):
        remote.submit(GenerationRequest([1, 2, 3], 4, GREEDY))
    # a restarted engine at the same address: the next call reconnects
    for _ in range(200):
        if not engine.running:
            break
        threading.Event().wait(0.02)
    again = EngineHost(engine, host.address, KEY)
    threading.Thread(target=again.serve_forever, daemon=True).start()
    try:
        got, last = ids(remote.submit(GenerationRequest([1, 2, 3], 4, GREEDY)))
        assert last.kind == "done" and len(got) == last.usage["completion_tokens"]
    finally:
        again.close()


def test_frames_arrive_whole_and_a_burst_is_read_at_once():
    """A reader that took one message per system call gave up the interpreter lock for each and waited to get it
    back while another thread ran Python: a burst of submits crossed one per wait."""
    from multiprocessing.connection import Connection

    from leat.engine_process import Frames

    one, two = (Frames(Connection(s.detach())) for s in socket.socketpair())
    burst = [bytes([i]) * (i * 37) for i in range(64)]  # an empty message too
    one.send(*burst)
    assert two.read() == burst  # all 64, in one read
    big = b"x" * (3 << 20)  # over several reads of 1 MiB
    threading.Thread(target=one.send, args=(big, b"after")).start()  # more than the socket holds: sent meanwhile
    got: list[bytes] = []
    while len(got) < 2:
        got += two.read()
    assert got == [big, b"after"]
    header = Frames.HEADER.pack(5)
    one.sock.sendall(header + b"ab")  # half a message: read waits for the rest
    threading.Timer(0.1, lambda: one.sock.sendall(b"cde")).start()
    assert two.read() == [b"abcde"]
    one.hang_up()
    with pytest.raises(EOFError):
        two.read()


def test_a_call_that_waits_holds_up_no_submit_from_its_frontend(model, served, monkeypatch):
    # a frontend's calls run off its link's reader: a session call waiting for the scheduler (or an embedding)
    # held up every submit the frontend sent behind it (on the H200 ~1.7 s, until a burst of requests ended)
    from leat import engine_process

    _, _, remote = served
    release, entered = threading.Event(), threading.Event()
    monkeypatch.setitem(engine_process.CALLS, "slow", lambda engine: entered.set() or release.wait(10) and "done")
    answer = []
    caller = threading.Thread(target=lambda: answer.append(remote.call("slow")))
    caller.start()
    try:
        assert entered.wait(10)
        started = time.perf_counter()
        tokens, last = ids(remote.submit(GenerationRequest(prompts(1)[0], 6, GREEDY)))
        assert last.kind == "done" and len(tokens) == 6 and time.perf_counter() - started < 5
        assert not answer  # the call still waits
    finally:
        release.set()
        caller.join(10)
    assert answer == ["done"]
