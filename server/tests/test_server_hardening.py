"""Issue #15: what one client can do to others. Each test sends one class of hostile or mistaken request to a real
``leat serve`` (two API keys, batch 8, queue 8, a chat template with runaway branches) and checks it is a 4xx that
leaves the server, the event loop and the other clients alone."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import signal
import subprocess
import threading
import time

import httpx
import pytest
from leat.engine import Overloaded
from leat.keys import KeyStore
from leat.model import load
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server import ServeOptions, build
from leat_server.service import Job
from leat_server.testing import ServerProcess

# Branches a client reaches by what it writes: two loops of 10^10 steps, a macro doubling its argument at every
# level, a 10 GB string.
RUNAWAY = (
    "{% if messages[0]['content'] == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% macro deeper(s) %}{{ deeper(s ~ s) }}{% endmacro %}"
    "{% if messages[0]['content'] == 'recurse' %}{{ deeper('x') }}{% endif %}"
    "{% if messages[0]['content'] == 'multiply' %}{{ 'x' * 10 ** 10 }}{% endif %}"
)
HELLO = [{"role": "user", "content": "hello there"}]


def runaway_model(path):
    import leat.testing

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(leat.testing, "CHATML", RUNAWAY + leat.testing.CHATML)
        return write_tiny_gguf(Llama, path, params=Llama.tiny(context=1024))


@pytest.fixture(scope="module")
def server(leat_home):
    home = leat_home()
    model = runaway_model(home / "tiny.gguf")
    store = KeyStore(home / "keys.json")
    keys = {"alice": store.add("alice"), "bob": store.add("bob")}
    args = ["--backend", "cpu", "--batch-size", "8", "--max-queue", "8", "--api-key-file", str(store.path)]
    args += ["--session-store", str(home / "sessions"), "--max-sessions", "4", "--template-timeout", "1"]
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}) as proc:
        proc.keys = keys
        proc.home = home
        yield proc


@pytest.fixture(scope="module")
def alice(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['alice']}"}) as c:
        c.timeout = 60
        yield c


@pytest.fixture(scope="module")
def bob(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys['bob']}"}) as c:
        c.timeout = 60
        yield c


def chat(client, messages=HELLO, **fields) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **fields})


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested_items(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def doubling_defs(levels: int) -> dict:
    """Linear in size, exponential once every allOf is expanded: each level uses the one below twice."""
    defs = {"d0": {"type": "integer"}}
    for i in range(1, levels):
        below = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}]}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": below, "b": below}, "required": ["a", "b"]}
    return {"$defs": defs, "$ref": f"#/$defs/d{levels - 1}"}


IMPOSSIBLE = {
    "empty enum": {"enum": []},
    "empty anyOf": {"anyOf": []},
    "required property that cannot exist": {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
    "minItems above maxItems": {"type": "array", "minItems": 3, "maxItems": 1},
    "integer minimum above maximum": {"type": "integer", "minimum": 5, "maximum": 1},
    "integer bounds with no integer between": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4},
    "self $ref": {"$ref": "#"},
    "$ref loop": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    "left-recursive $ref": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    "absurd nesting": nested_items(40),
    "exponential expansion": doubling_defs(16),
}


def test_an_impossible_constraint_is_400_and_fails_no_one_else(alice):
    """Before: 500 for the request, and an engine-step failure for every request running beside it."""
    body = {"messages": HELLO, "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}
    streamed: list[str] = []

    def neighbour():
        with alice.stream("POST", "/v1/chat/completions", json=body) as r:
            streamed.extend(line for line in r.iter_lines() if line)

    running = threading.Thread(target=neighbour)
    running.start()
    for what, schema in IMPOSSIBLE.items():
        r = chat(alice, response_format=schema_format(schema))
        assert r.status_code == 400, (what, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == "response_format" and error["code"] == "unsupported_schema", (what, error)
    running.join(60)
    assert streamed[-1] == "data: [DONE]" and not any('"error"' in line for line in streamed)
    # a part that can never be written is left out; the rest still constrains the output
    optional_dead = {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": []}, "minItems": 1}}}
    r = chat(alice, response_format=schema_format(optional_dead), max_tokens=40, seed=1)
    assert r.status_code == 200, r.text
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == {}


def test_sessions_and_prefix_cache_belong_to_one_key(alice, bob, server):
    """Before: bob naming alice's session continued it, and its cached_tokens told him how much of a guess matched."""
    secret = [{"role": "user", "content": "the secret plan is to meet at the old mill at dawn " * 4}]
    first = chat(alice, secret, session="plans", temperature=0)
    assert first.status_code == 200
    again = chat(alice, secret, session="plans", temperature=0).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the owner reuses it
    probe = chat(bob, secret, session="plans", temperature=0).json()
    assert probe["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for text, user in (("the other plan is to row across the lake at noon ", None), ("a third plan ", "alice")):
        prompt = [{"role": "user", "content": text * 6}]
        assert chat(alice, prompt, temperature=0).status_code == 200
        mine = chat(alice, prompt, temperature=0).json()
        assert mine["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # alice's pages are in the prefix cache
        seen = chat(bob, prompt, temperature=0, **({"user": user} if user else {})).json()
        assert seen["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # alice's session was not touched by bob's request of the same name
    mine = chat(alice, secret, session="plans", temperature=0).json()
    assert mine["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_session_routes_list_and_delete_only_the_keys_own(alice, bob):
    """Before: no way to list or delete a session (404)."""
    assert chat(alice, session="alice-notes").status_code == 200
    assert chat(bob, session="bob-notes").status_code == 200
    mine = alice.get("/v1/sessions")
    assert mine.status_code == 200, mine.text
    names = {s["id"] for s in mine.json()["data"]}
    assert "alice-notes" in names and "bob-notes" not in names
    assert alice.delete("/v1/sessions/bob-notes").status_code == 404
    assert "bob-notes" in {s["id"] for s in bob.get("/v1/sessions").json()["data"]}
    gone = bob.delete("/v1/sessions/bob-notes")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert "bob-notes" not in {s["id"] for s in bob.get("/v1/sessions").json()["data"]}
    assert alice.delete("/v1/sessions/..%2F..%2Fkeys").status_code in (400, 404)


def test_session_count_is_capped_least_recently_used_first(alice, bob, server):
    """Before: every session was kept, in memory and on disk, forever (--max-sessions 4 here)."""
    names = [f"burst-{i}" for i in range(6)]
    for name in names:
        assert chat(alice, session=name).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kept = {s["id"] for s in alice.get("/v1/sessions").json()["data"]}
        kept |= {s["id"] for s in bob.get("/v1/sessions").json()["data"]}
        if len(kept) <= 4:
            break
        time.sleep(0.2)
    assert kept == set(names[2:])
    assert len(list((server.home / "sessions").glob("*.npz"))) <= 4


def _timed_get(client, path: str) -> float:
    start = time.monotonic()
    assert client.get(path).status_code == 200
    return time.monotonic() - start


def _in_background(call) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    return thread, out


def test_a_runaway_template_neither_blocks_the_server_nor_runs_past_its_budget(alice):
    """Before: the server stopped answering, /health included, for as long as the loops ran (--template-timeout 1)."""
    started = time.monotonic()
    thread, out = _in_background(lambda: chat(alice, [{"role": "user", "content": "spin"}]))
    time.sleep(0.3)
    assert _timed_get(alice, "/health") < 1.0
    thread.join(20)
    assert out and out[0].status_code == 400, out and out[0].text
    assert "chat template" in out[0].json()["error"]["message"]
    assert time.monotonic() - started < 10


def test_tokenizing_a_large_body_does_not_block_the_server(alice):
    """Before: /health waited for the whole tokenization (about 1 s per 4 MB here)."""
    content = "the quick brown fox jumps. " * (16_000_000 // 27)
    thread, out = _in_background(lambda: alice.post("/tokenize", json={"content": content}))
    time.sleep(0.5)
    assert _timed_get(alice, "/health") < 1.0
    thread.join(60)
    assert out and out[0].status_code == 200


@pytest.mark.parametrize("content", ["recurse", "multiply"])
def test_runaway_template_growth_is_400_quickly(alice, content):
    """Before: 500, after up to minutes of growing strings."""
    started = time.monotonic()
    r = chat(alice, [{"role": "user", "content": content}])
    assert r.status_code == 400, r.text
    assert "chat template" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5


def _raw_chat(client, raw: bytes) -> httpx.Response:
    return client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_400(alice, depth):
    """Before: 500 (RecursionError while decoding)."""
    raw = b'{"messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"x":'
    raw += b"[" * depth + b"]" * depth + b"}}"
    r = _raw_chat(alice, raw)
    assert r.status_code == 400, r.text
    assert "nest" in r.json()["error"]["message"]


@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools", "bos_token"])
def test_chat_template_kwargs_cannot_replace_the_servers_own_variables(alice, name):
    """Before: 500 (TypeError: multiple values for keyword argument)."""
    r = chat(alice, chat_template_kwargs={name: 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_body_over_the_limit_is_413(alice):
    r = _raw_chat(alice, b'{"messages": "' + b"x" * (33 << 20) + b'"}')
    assert r.status_code == 413


def test_openapi_schema_is_served_from_the_request_structs(alice):
    """Before: 404 (no OpenAPI schema)."""
    doc = alice.get("/openapi.json")
    assert doc.status_code == 200, doc.text
    schema = doc.json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"/v1/completions", "/v1/messages", "/v1/responses", "/v1/sessions"} <= set(schema["paths"])
    assert alice.get("/schema/openapi.json").json() == schema


@pytest.mark.parametrize("host", ["evil.example@127.0.0.1", "127.0.0.1@evil.example", "evil.example#@localhost"])
def test_host_with_userinfo_is_refused(server, host):
    """Before: 'evil.example@127.0.0.1' passed as loopback (urlsplit takes what follows '@')."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.putrequest("GET", "/health", skip_host=True)
    connection.putheader("Host", host)
    connection.endheaders()
    assert connection.getresponse().status in (400, 403)
    connection.close()


def test_a_burst_is_admitted_up_to_free_slots_plus_queue(tmp_path):
    """Before: the queue counted requests a free slot would take at once (8 of 48 with batch 8 and queue 8)."""
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf")
    model = load(str(path), backend="cpu")
    app, _ = build(ServeOptions(str(path), batch_size=8, max_queue=8), model, None, log=lambda *_: None)
    service = app.app.state.service  # its engine is not started: nothing leaves the queue, as in a burst within a step
    admitted = 0
    for i in range(48):
        job = Job("completions", model.tokenizer.encode(f"request {i}"), 4, service.sampling({}))
        try:
            asyncio.run(service.submit(job))
            admitted += 1
        except Overloaded:
            pass
    assert admitted == 16


def test_sigterm_ends_the_server_during_a_runaway_template(tmp_path, leat_home):
    """Before: the server never exited (the loops held the event loop, so the signal was never handled)."""
    model = runaway_model(tmp_path / "tiny.gguf")
    env = {"LEAT_HOME": str(leat_home())}
    with ServerProcess(model, ["--backend", "cpu", "--template-timeout", "60"], env=env) as s:

        def spin():
            with httpx.Client(base_url=s.url, timeout=90) as c, contextlib.suppress(httpx.HTTPError):
                chat(c, [{"role": "user", "content": "spin"}])

        thread = threading.Thread(target=spin)
        thread.start()
        time.sleep(1.0)
        started = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        try:
            s.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 15 s after SIGTERM:\n{s.output()}")
        assert time.monotonic() - started < 10
    thread.join(5)


def _store(tmp_path, **limits):
    from leat.sessions import SessionStore, StoreLimits

    return SessionStore(tmp_path / "sessions", "fingerprint", StoreLimits(**limits))


def _saved(store, name: str, used: float, size: int = 1000):
    import numpy as np
    from leat.sessions import Session

    session = store.live[name] = Session(name, tokens=[1, 2, 3], last_used=used)
    store.save(session, [([0], [np.zeros(size, np.float32)])])
    return session


def test_store_names_sessions_past_their_idle_time_then_beyond_the_count(tmp_path):
    store = _store(tmp_path, max_sessions=2, idle_seconds=100)
    for i, used in enumerate([10.0, 500.0, 900.0, 950.0, 990.0]):
        _saved(store, f"s{i}", used)
    store.live["s3"].busy = True
    # at 1000: s0 idle 990 s (expired); of the four left, two too many: s1, s2 (s3 is busy, never named)
    assert store.stale(now=1000.0) == ["s0", "s1", "s2"]


def test_store_keeps_its_files_under_the_byte_limit_least_recently_used_first(tmp_path):
    store = _store(tmp_path)
    first = _saved(store, "first", 1.0, size=1000)
    first.pages = []  # hibernated: the file is its only copy
    store.limits.max_bytes = int(2.5 * store.sizes["first"])  # room for two
    _saved(store, "second", 2.0, size=1000)
    _saved(store, "third", 3.0, size=1000)
    assert sorted(p.name for p in (tmp_path / "sessions").iterdir()) == ["second.npz", "third.npz"]
    assert "first" not in store.live and sum(store.sizes.values()) <= store.limits.max_bytes


def test_store_reads_back_idle_times_and_skips_partial_files(tmp_path):
    import os

    store = _store(tmp_path)
    _saved(store, "old", 1.0)
    path = tmp_path / "sessions" / "old.npz"
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "sessions" / "new.npz.partial").write_bytes(b"half written")
    again = _store(tmp_path, idle_seconds=60)
    assert set(again.live) == {"old"} and again.live["old"].tokens == [1, 2, 3]
    assert again.stale() == ["old"]


def test_session_names_are_scoped_to_their_key():
    from leat.errors import LeatError
    from leat.sessions import scoped, unscoped

    owner = "0123456789abcdef"
    assert scoped(owner, "chat") == "0123456789abcdef.chat" and scoped(None, "chat") == "chat"
    assert unscoped(owner, "0123456789abcdef.chat") == "chat" and unscoped(owner, "fedcba9876543210.chat") is None
    with pytest.raises(LeatError, match="at most 111"):
        scoped(owner, "x" * 112)
    with pytest.raises(LeatError):
        scoped(owner, "../x")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_engine_process_is_awaited_only_when_asked(tmp_path, monkeypatch, asynchronous):
    """LEAT_ASYNC_SUBMIT=1 (leat_server.service.ASYNC_SUBMIT) makes an API process await the engine process's answer
    in its event loop (RemoteEngine.submit_async); by default it takes the blocking round trip (RemoteEngine.submit)."""
    import leat_server.service

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf")
    model = load(str(path), backend="cpu")
    app, _ = build(ServeOptions(str(path), batch_size=2), model, None, log=lambda *_: None)
    service = app.app.state.service
    local, called = service.engine, []

    class Remote:  # the calls of a RemoteEngine, answered by the engine in this process
        def submit(self, request):
            called.append("submit")
            return local.submit(request)

        async def submit_async(self, request):
            called.append("submit_async")
            return local.submit(request)

    monkeypatch.setattr(service, "engine", Remote())
    monkeypatch.setattr(leat_server.service, "ASYNC_SUBMIT", asynchronous)
    job = Job("completions", model.tokenizer.encode("hello"), 2, service.sampling({}))
    asyncio.run(service.submit(job))
    assert called == ["submit_async" if asynchronous else "submit"] and job.accepted is not None
