"""A client that goes away (streaming or not) frees its batch slot and KV pages within a few scheduler steps.

``leat serve`` runs as a real process; the requests go over raw sockets so a test can close one mid-request, then
read the engine's state from ``GET /metrics``: requests running, KV pages held (``kv_pages_used`` less the pages the
prefix cache keeps, which an idle server holds too) and the step counter.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess

CONTEXT = 8192
LONG = 8000  # tokens a request would generate if nobody cancelled it: many more steps than a cancel may take
SLOTS = 4
# Steps a disconnect may take to free the pages: the engine reaps a cancelled request at its next step, but it steps
# ~2,000 times a second here and the server notices a closed socket on another thread (with --api-workers, in another
# process, the cancel a message after that), so a slack a quarter of LONG. Clean-clone CI runs on the 2-core machine
# under xdist have taken 202 steps (~0.1 s, the api-workers' stalled reader) and 1,064 (~0.5 s, an in-process
# /v1/messages whose event loop waited on the engine thread for the GIL); a request run to its end takes the whole
# remaining LONG (7,000 steps and more after the requests below are seen running).
STEPS = LONG // 4


@pytest.fixture(scope="module", params=["in-process", "api-workers"])
def server(request, leat_home):
    """The engine in the server's process, or (``--api-workers 2``) in one of its own behind two API processes: a
    cancel then travels to it as a message. Each API process counts its own cancels, so only the first checks them."""
    home = leat_home()
    model = write_tiny_gguf(Llama, home / "tiny.gguf", params=Llama.tiny(context=CONTEXT))
    args = ["--backend", "cpu", "--batch-size", str(SLOTS)]
    if request.param == "api-workers":
        args += ["--api-workers", "2"]
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}, timeout=120) as proc:
        proc.counts_cancels = request.param == "in-process"
        yield proc


@pytest.fixture(scope="module")
def http(server):
    # A connection per request: with --api-workers, a response on a kept-alive connection waits ~40 ms for the
    # client's delayed ACK (no TCP_NODELAY on the shared socket), which would blur the step counts read here.
    with httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        yield c


def engine_state(http) -> dict[str, float]:
    text = http.get("/metrics").text
    names = ("running", "queue_depth", "kv_pages_used", "kv_pages_cached", "engine_steps_total")
    values = {}
    for name in names:
        match = re.search(rf"^leat_{name} ([0-9.e+-]+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else 0.0
    values["held"] = values["kv_pages_used"] - values["kv_pages_cached"]
    cancels = re.findall(r'^leat_requests_cancelled_total\{endpoint="[a-z]+"\} ([0-9.e+-]+)$', text, re.MULTILINE)
    values["cancelled"] = sum(float(c) for c in cancels)
    return values


def wait_for(http, check, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(http)
        if check(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; engine state {state}")
        time.sleep(0.01)


def wait_quiet(http, idle: dict[str, float], quiet: float = 0.5, timeout: float = 30) -> dict[str, float]:
    """The engine's state once it is idle, holding the pages it held at ``idle``, and has not stepped for ``quiet``
    seconds (a request still running steps every millisecond or so)."""
    deadline = time.monotonic() + timeout
    steps, since = None, time.monotonic()
    while True:
        state = engine_state(http)
        if state["engine_steps_total"] != steps:
            steps, since = state["engine_steps_total"], time.monotonic()
        settled = state["running"] == 0 and state["queue_depth"] == 0 and state["held"] == idle["held"]
        if settled and time.monotonic() - since >= quiet:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; engine state {state}")
        time.sleep(0.01)


def open_request(server, path: str, body: dict, receive_buffer: int | None = None) -> socket.socket:
    """A POST sent on a raw socket, left open: the caller reads from it or closes it."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    if receive_buffer is not None:  # before connecting, so the window the server sees is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def long_body(path: str, stream: bool) -> dict:
    """A request for :data:`LONG` tokens (the tiny model never writes its end-of-text token at temperature 0)."""
    body = {"model": "tiny", "temperature": 0, "stream": stream}
    story = [{"role": "user", "content": "tell me a long story"}]
    if path == "/v1/chat/completions":
        return {**body, "messages": story, "max_tokens": LONG, "ignore_eos": True}
    if path == "/v1/completions":
        return {**body, "prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True}
    if path == "/v1/messages":
        return {**body, "messages": story, "max_tokens": LONG}
    return {**body, "input": "tell me a long story", "max_output_tokens": LONG}


PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", PATHS)
def test_a_client_that_goes_away_frees_its_slot_and_pages(server, http, path, stream):
    idle = wait_for(http, lambda s: s["running"] == 0 and s["queue_depth"] == 0)
    sock = open_request(server, path, long_body(path, stream))
    try:
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has begun
        # running, with pages, and well short of its end
        busy = wait_for(http, lambda s: s["running"] == 1 and s["held"] > idle["held"])
    finally:
        sock.close()
    closed_at = busy["engine_steps_total"]
    after = wait_for(http, lambda s: s["running"] == 0 and s["held"] == idle["held"])
    assert after["engine_steps_total"] - closed_at < STEPS, (busy, after)
    assert after["cancelled"] == idle["cancelled"] + 1 or not server.counts_cancels
    assert after["queue_depth"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_gone_before_its_answer_starts_frees_everything(server, http, stream):
    """The client closes right after sending: the server sees the disconnect before it sends a byte (for a stream,
    before the stream's generator has started)."""
    idle = wait_for(http, lambda s: s["running"] == 0 and s["queue_depth"] == 0)
    open_request(server, "/v1/chat/completions", long_body("/v1/chat/completions", stream)).close()
    after = wait_quiet(http, idle)
    assert after["engine_steps_total"] - idle["engine_steps_total"] < STEPS, (idle, after)
    assert after["cancelled"] == idle["cancelled"] + 1 or not server.counts_cancels


def hang_up(server, http, path: str, body: dict, stream: bool, running: int) -> tuple[dict, dict, dict]:
    """Send ``body`` to ``path``, wait until ``running`` engine requests hold slots for it, then go away: the stats
    before it, while it ran and once its slots were free again."""
    idle = wait_for(http, lambda s: s["running"] == 0 and s["queue_depth"] == 0)
    sock = open_request(server, path, body)
    try:
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        busy = wait_for(http, lambda s: s["running"] == running and s["held"] > idle["held"])
    finally:
        sock.close()
    after = wait_for(http, lambda s: s["running"] == 0 and s["held"] == idle["held"])
    return idle, busy, after


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_of_several_choices_that_goes_away_frees_them_all(server, http, path, stream):
    """``n`` choices are a request each in the engine: the client's going away ends all of them."""
    idle, busy, after = hang_up(server, http, path, {**long_body(path, stream), "n": 3}, stream, running=3)
    assert after["engine_steps_total"] - busy["engine_steps_total"] < STEPS, (busy, after)
    assert after["cancelled"] == idle["cancelled"] + 3 or not server.counts_cancels


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_ollama_client_that_goes_away_frees_its_slot(server, http, stream):
    body = {"model": "tiny", "prompt": "Once upon a time", "raw": True, "stream": stream}
    body["options"] = {"temperature": 0, "num_predict": LONG}
    _, busy, after = hang_up(server, http, "/api/generate", body, stream, running=1)
    assert after["engine_steps_total"] - busy["engine_steps_total"] < STEPS, (busy, after)


def test_several_clients_going_away_at_once_free_everything(server, http):
    idle = wait_for(http, lambda s: s["running"] == 0 and s["queue_depth"] == 0)
    socks = [open_request(server, p, long_body(p, stream)) for p in PATHS for stream in (False, True)]
    try:
        busy = wait_for(http, lambda s: s["running"] == SLOTS and s["queue_depth"] == len(socks) - SLOTS)
    finally:
        for sock in socks:
            sock.close()
    after = wait_for(http, lambda s: s["running"] == 0 and s["queue_depth"] == 0 and s["held"] == idle["held"])
    assert after["engine_steps_total"] - busy["engine_steps_total"] < STEPS, (busy, after)
    assert after["cancelled"] == idle["cancelled"] + len(socks) or not server.counts_cancels


def test_a_stream_whose_client_stopped_reading_is_freed_when_it_goes_away(server, http):
    """The client reads nothing, so the server's writes back up (its sender waits on the socket, not inside the
    stream's generator) before the client closes."""
    idle = wait_for(http, lambda s: s["running"] == 0 and s["queue_depth"] == 0)
    body = {**long_body("/v1/chat/completions", True), "logprobs": True, "top_logprobs": 20}  # ~3 kB a token
    sock = open_request(server, "/v1/chat/completions", body, receive_buffer=4096)
    try:
        busy = wait_for(
            http, lambda s: s["running"] == 1 and s["engine_steps_total"] > idle["engine_steps_total"] + 400
        )
    finally:
        sock.close()
    after = wait_for(http, lambda s: s["running"] == 0 and s["held"] == idle["held"])
    assert after["engine_steps_total"] - busy["engine_steps_total"] < STEPS, (busy, after)
    assert after["cancelled"] == idle["cancelled"] + 1 or not server.counts_cancels


def test_the_server_still_answers_after_disconnects(server, http):
    answer = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0},
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
