"""`leat serve --api-workers 2`: the engine in a process of its own, two API frontend processes, driven by the
official openai client; a frontend or the engine killed mid-load loses no accepted request without an error
and every KV page comes back."""

import os
import re
import signal
import threading
import time
import urllib.request

import httpx
import openai
import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess, greedy_text

PROMPT = [5, 17, 42, 99, 3, 250, 7]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_gguf(Llama, tmp_path_factory.mktemp("procs") / "tiny.gguf", params=Llama.tiny(context=1024))


@pytest.fixture(scope="module")
def expected_text(model_path):
    return greedy_text(model_path, PROMPT, 24)


def serve(model_path, env: dict[str, str] | None = None) -> ServerProcess:
    args = ["--backend", "cpu", "--api-workers", "2", "--batch-size", "4", "--max-queue", "16"]
    return ServerProcess(model_path, args, env=env, timeout=120)


@pytest.fixture
def server(model_path):
    """A server of the test's own, whose processes it kills."""
    with serve(model_path) as proc:
        yield proc


@pytest.fixture(scope="module", params=["blocking", "async"])
def shared_server(model_path, request):
    """One server for the tests that only send it requests; its API processes submit with a blocking round trip
    (the default), or await the engine's answer in their event loop (LEAT_ASYNC_SUBMIT=1)."""
    with serve(model_path, {"LEAT_ASYNC_SUBMIT": "1"} if request.param == "async" else None) as proc:
        yield proc


def pids(server) -> tuple[int, list[int]]:
    out = server.output()
    engine = int(re.search(r"engine process (\d+)", out).group(1))
    workers = [int(p) for p in re.search(r"API workers ([\d, ]+)", out).group(1).split(", ")]
    return engine, workers


def pages_used(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return float(re.search(r"^leat_kv_pages_used (\S+)$", text, re.MULTILINE).group(1))


def cached_pages(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return float(re.search(r"^leat_kv_pages_cached (\S+)$", text, re.MULTILINE).group(1))


def complete(client, **extra):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, **extra)


def test_requests_through_separate_processes_equal_the_model(shared_server, expected_text):
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)
    engine_pid, workers = pids(shared_server)
    assert len(workers) == 2 and engine_pid not in workers
    whole = complete(client)
    assert whole.choices[0].text == expected_text
    assert "".join(c.choices[0].text for c in complete(client, stream=True) if c.choices) == expected_text
    results = [None] * 8  # many at once, spread over both frontends by the kernel

    def one(i):
        results[i] = complete(client).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [expected_text] * 8


def test_guided_choice_and_regex_through_separate_processes(shared_server):
    """A plain-text constraint is rebuilt in the engine's process from its spec (``constrained.rebuild_text``)."""
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)
    for seed in (1, 2):
        ask = {"model": "tiny", "prompt": "x", "max_tokens": 12, "temperature": 1.0, "seed": seed}
        picked = client.completions.create(**ask, extra_body={"guided_choice": ["one", "two"]}).choices[0].text
        assert picked in ("one", "two")
        code = client.completions.create(**ask, extra_body={"guided_regex": "[0-9]{3}"}).choices[0].text
        assert re.fullmatch("[0-9]{3}", code)


def test_echo_with_logprobs_through_separate_processes(shared_server):
    """An echoed prompt's logprobs come from the engine's process (the engine link's ``score`` call)."""
    client = openai.OpenAI(base_url=shared_server.url + "/v1", api_key="unused", max_retries=0)
    ids = list(range(40, 52))
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # (two tokens of one text are one key)
    # lm-evaluation-harness's own loglikelihood payload (local-completions), and its reading of the answer
    payload = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    answer = httpx.post(shared_server.url + "/v1/completions", json=payload | {"echo": True}, timeout=30).json()
    scores, tops = (answer["choices"][0]["logprobs"][key] for key in ("token_logprobs", "top_logprobs"))
    context = 4  # the first four ids the context, the rest the continuation scored
    assert sum(scores[context:-1]) == pytest.approx(sum(lp.token_logprobs[context:-1]), abs=1e-9)
    assert all(isinstance(max(top.values()), float) for top in tops[context:-1])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**64}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": -(2**64)}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "seed": 10**30}),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 2, "top_k": 2**70, "messages": [{"role": "user", "content": "x"}]},
        ),
    ],
    ids=["chat", "completions", "responses", "messages"],
)
def test_an_integer_beyond_64_bits_is_400(shared_server, path, body):
    """Before: 500 (OverflowError: the engine link's msgpack cannot carry it; one process took it)."""
    r = httpx.post(shared_server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "fit in 64 bits" in r.text
    body = {"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1}  # the largest that fits
    assert httpx.post(shared_server.url + "/v1/completions", json=body, timeout=30).status_code == 200


def test_the_anthropic_client_through_separate_processes(shared_server):
    import anthropic

    claude = anthropic.Anthropic(base_url=shared_server.url, api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "Hello"}]
    greedy = {"temperature": 0}  # newer clients no longer offer it as an argument; the API still takes it
    whole = claude.messages.create(model="tiny", max_tokens=10, messages=hello, extra_body=greedy)
    assert whole.content[0].type == "text" and whole.stop_reason in ("max_tokens", "end_turn")
    with claude.messages.stream(model="tiny", max_tokens=10, messages=hello, extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens


def _load(server, n, outcomes, max_tokens=900):
    """``n`` streaming requests on threads; each records "done", "error" (an error answer or an in-band error
    event) or "dropped" (the connection closed under it)."""

    def one(i):
        try:
            with httpx.stream(
                "POST",
                server.url + "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": PROMPT,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": True,
                    "ignore_eos": True,
                },
                timeout=60,
            ) as response:
                if response.status_code != 200:
                    outcomes[i] = f"error {response.status_code}"
                    return
                text = "".join(response.iter_text())
            outcomes[i] = "done" if "[DONE]" in text and '"error"' not in text else "error in-band"
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError) as e:
            outcomes[i] = f"dropped {type(e).__name__}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _wait_pages_back(server, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pages_used(server) <= cached_pages(server):
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def test_a_killed_frontend_loses_only_its_own_connections_and_every_page_comes_back(server):
    _, workers = pids(server)
    outcomes = [None] * 8
    threads = _load(server, 8, outcomes)
    time.sleep(0.5)
    os.kill(workers[0], signal.SIGKILL)
    # the other frontend goes on: new connections reach it (the kernel alone decides which frontend took the 8
    # above, so all of them may have been the killed one's)
    meanwhile = [None] * 2
    for t in _load(server, 2, meanwhile, max_tokens=8):
        t.join(60)
    assert meanwhile == ["done"] * 2, meanwhile
    for t in threads:
        t.join(90)
    assert all(o is not None for o in outcomes), outcomes  # nothing hangs
    assert all(o == "done" or o.startswith("dropped") for o in outcomes), outcomes
    assert _wait_pages_back(server), "KV pages of the killed frontend's requests did not come back"
    # the supervisor restarts the frontend: requests succeed again on every connection
    time.sleep(3)
    again = [None] * 4
    for t in _load(server, 4, again, max_tokens=8):
        t.join(60)
    assert again == ["done"] * 4, again


def test_a_killed_engine_ends_requests_in_flight_with_an_error_and_comes_back(server):
    engine_pid, _ = pids(server)
    outcomes = [None] * 6
    threads = _load(server, 6, outcomes)
    time.sleep(0.5)
    os.kill(engine_pid, signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert all(o is not None for o in outcomes), outcomes  # never a hang
    assert all(o == "done" or o.startswith("error") for o in outcomes), outcomes  # an answer, never a dropped line
    assert any(o.startswith("error") for o in outcomes), outcomes
    deadline = time.monotonic() + 60  # the supervisor restarts the engine; the frontends reconnect
    while True:
        again = [None]
        for t in _load(server, 1, again, max_tokens=8):
            t.join(60)
        if again == ["done"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert again == ["done"], again
    assert pages_used(server) <= cached_pages(server)
