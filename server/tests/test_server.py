"""``leat serve`` as a real process on 127.0.0.1, driven by the official openai and anthropic clients."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
from leat.keys import KeyStore
from leat.testing import encode_png, write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess

MODEL = "tiny"
ALLOWED_ORIGIN = "http://app.example:3000"


@pytest.fixture(scope="module")
def server(leat_home):
    home = leat_home()
    model = write_tiny_gguf(Llama, home / "tiny.gguf", params=Llama.tiny(context=1024))
    store = KeyStore(home / "keys.json")
    key = store.add("tests")
    args = [
        "--backend",
        "cpu",
        "--batch-size",
        "4",
        "--api-key-file",
        str(store.path),
        "--receipt-key",
        str(home / "receipt.pem"),
        "--allow-origin",
        ALLOWED_ORIGIN,
    ]
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}) as proc:
        proc.key = key
        proc.home = home
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.key}"}, timeout=30) as c:
        yield c


def metric(http, name: str, **labels) -> float:
    text = http.get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" ([0-9.e+-]+)"
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


HELLO = [{"role": "user", "content": "hello there"}]


def test_models_and_health(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # /health needs no key
    assert httpx.get(server.url + "/").text == "leat is running"  # nor the root, which Ollama's clients check
    assert httpx.get(server.url + "/api/tags").status_code == 401  # the rest does


def test_the_server_warmed_up_before_its_first_request_and_did_not_count_it(http):
    """Before it answers, the server generated one token through its engine (a first request pays nothing once
    paid); /metrics counts no request and no prompt token for it."""
    assert metric(http, "leat_engine_steps_total") >= 1
    assert metric(http, "leat_prompt_tokens_total") == 0
    assert "leat_requests_total{" not in http.get("/metrics").text


def test_chat_whole_and_streamed_agree(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.message.role == "assistant"
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens and not chunks[-1].choices


def test_seed_makes_sampling_repeatable(client):
    def ask(seed):
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, temperature=1.0, seed=seed)
        return r.choices[0].message.content

    assert ask(7) == ask(7)
    assert ask(-7) == ask(-7)  # any 64-bit seed
    assert ask(-1)  # llama.cpp's "a random seed"
    with pytest.raises(openai.BadRequestError, match="64 bits"):
        ask(2**64)


def test_vllms_guided_decoding_fields_constrain_the_text(client, http):
    """guided_choice, guided_regex and guided_json (vLLM's; also as parts of structured_outputs), on chat and
    completions, sampled at temperature 1; two ways to constrain one request are a 400."""

    def chat(**extra):
        return client.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=40, temperature=1.0, extra_body=extra
        ).choices[0]

    for seed in (1, 2, 3):
        assert chat(guided_choice=["yes", "no", "maybe not"], seed=seed).message.content in ("yes", "no", "maybe not")
        answer = chat(guided_regex=r"[A-Z]{2}-\d{2,3}", seed=seed)
        assert answer.finish_reason == "stop" and re.fullmatch(r"[A-Z]{2}-\d{2,3}", answer.message.content)
        parts = chat(structured_outputs={"choice": ["left", "right"]}, seed=seed).message.content
        assert parts in ("left", "right")
    value = json.loads(chat(guided_json={"type": "array", "items": {"type": "boolean"}, "maxItems": 2}).message.content)
    assert isinstance(value, list) and len(value) <= 2 and all(isinstance(v, bool) for v in value)
    completion = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=10, temperature=1.0, extra_body={"guided_choice": ["A", "B"]}
    )
    assert completion.choices[0].text in ("A", "B")
    sums = 'root ::= term ("+" term)*\nterm ::= [1-9] [0-9]? | "(" [1-9] "+" [1-9] ")"'
    term = r"([1-9][0-9]?|\([1-9]\+[1-9]\))"
    for seed in (1, 2):  # llama-server's grammar (GBNF) and vLLM's guided_grammar
        for field in ("grammar", "guided_grammar"):
            answer = chat(**{field: sums}, seed=seed)
            assert answer.finish_reason == "stop", answer.message.content
            assert re.fullmatch(f"{term}(\\+{term})*", answer.message.content), answer.message.content
    both = {"messages": HELLO, "max_tokens": 3, "guided_choice": ["a"], "response_format": {"type": "json_object"}}
    r = http.post("/v1/chat/completions", json=both)
    assert r.status_code == 400 and "one way to constrain" in r.json()["error"]["message"]


def echo_scores(client, ids: list[int], **extra):
    """lm-evaluation-harness's loglikelihood request: the prompt as token ids, echo, logprobs 1, one token."""
    return client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, **extra
    )


def test_echo_with_logprobs_scores_the_prompt_as_generation_scores_its_tokens(client):
    """Completions' echo with logprobs: every prompt token's log-probability after those before it (the first none),
    then the generated token's; the top token at a prompt position is the one a generation from the prefix before
    it picks, with the logprob that generation reports (a decode step there, prefill chunks here)."""
    ids = list(range(40, 64))
    scored = echo_scores(client, ids)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))  # greedy: its own top
    for k in (5, 17):
        generated = (
            client.completions.create(model=MODEL, prompt=ids[:k], max_tokens=1, temperature=0, logprobs=1)
            .choices[0]
            .logprobs
        )
        (token, logprob), *_ = lp.top_logprobs[k].items()
        assert generated.tokens[0] == token and generated.token_logprobs[0] == pytest.approx(logprob, abs=1e-4)
    streamed = list(echo_scores(client, ids, stream=True))
    assert streamed[0].choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-9)


def test_stop_strings_and_logprobs(client):
    full = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0).choices[0]
    text = full.message.content
    assert len(text) > 6
    stop = text[3:5]
    cut = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    scored = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = scored.choices[0].logprobs.content
    assert len(entries) == scored.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-9  # greedy: the chosen token is the likeliest


def test_completions_text_and_token_ids(client):
    text = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=6, temperature=0)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 6
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4
    streamed = client.completions.create(
        model=MODEL, prompt="the quick brown", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text


def test_bad_requests_are_400_in_openai_shape(server, client, http):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=-3)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5000)
    assert "1024" in info.value.body["message"] and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )
    assert info.value.body["param"] == "messages[0].content[0]"
    png = "data:image/png;base64," + base64.b64encode(encode_png(np.zeros((2, 2, 3), np.uint8))).decode()
    with pytest.raises(openai.BadRequestError) as info:  # a well-formed image, but this model has no --mmproj
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}]
        )
    assert "vision projector" in info.value.body["message"] and "--mmproj" in info.value.body["message"]
    assert http.get("/nowhere").status_code == 404
    assert server.process.poll() is None


def test_keys_host_and_origin(server, http):
    url = server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer leat_wrong"}).status_code == 401
    assert httpx.get(url, headers={"x-api-key": server.key}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="leat_wrong", max_retries=0).models.list()
    foreign = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403 and "allow-origin" in foreign.json()["error"]["message"]
    allowed = http.get("/v1/models", headers={"Origin": ALLOWED_ORIGIN})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    preflight = httpx.options(url, headers={"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204
    rebound = http.get("/v1/models", headers={"Host": f"attacker.example:{server.port}"})
    assert rebound.status_code == 403


def test_tokenize_detokenize(http):
    ids = http.post("/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == "hello world"
    chat = http.post("/tokenize", json={"messages": HELLO}).json()
    assert chat["count"] == len(chat["tokens"]) > len(ids)


def test_the_remote_tokenizer_that_lm_evaluation_harness_reads(http, server):
    """lm-evaluation-harness's remote tokenizer (vLLM's endpoints): /tokenizer_info with the special tokens and the
    chat template, /tokenize of {"prompt", "add_special_tokens"} to {"tokens"}, /detokenize to {"prompt"}; its eos
    token's id is the first id of the eos token's text."""
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] > 0
    ids = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "hello world"
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1 and http.post("/detokenize", json={"tokens": eos}).json()["prompt"] in ("", info["eos_token"])
    assert httpx.get(server.url + "/tokenizer_info").status_code == 401  # behind the keys, as every route


def test_anthropic_messages_whole_and_streamed(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.key, max_retries=0)
    greedy = {"temperature": 0}  # newer clients no longer offer it as an argument; the API still takes it
    whole = claude.messages.create(model=MODEL, max_tokens=10, messages=HELLO, extra_body=greedy)
    assert whole.content[0].type == "text" and whole.stop_reason in ("max_tokens", "end_turn")
    with claude.messages.stream(model=MODEL, max_tokens=10, messages=HELLO, extra_body=greedy) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.usage.output_tokens == whole.usage.output_tokens
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="leat_wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=HELLO
        )
    count = claude.messages.count_tokens(model=MODEL, messages=HELLO)
    assert count.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_responses_whole_and_streamed(client):
    whole = client.responses.create(model=MODEL, input="hello there", max_output_tokens=8, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens <= 8
    events = list(
        client.responses.create(model=MODEL, input="hello there", max_output_tokens=8, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_receipts_verify_and_tampering_fails(server, http, tmp_path):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 6, "temperature": 0})
    body = r.json()
    assert body["receipt"]["claims"]["output_tokens"] == body["usage"]["completion_tokens"]
    assert re.fullmatch(r"[0-9a-f]{16}", body["receipt"]["claims"]["owner"])  # the key that asked
    public = server.home / "receipt.pub.pem"

    def check(doc) -> subprocess.CompletedProcess:
        path = tmp_path / "doc.json"
        path.write_text(json.dumps(doc))
        return subprocess.run(
            [sys.executable, "-m", "leat", "receipts", "verify", str(path), "--public-key", str(public)],
            capture_output=True,
            text=True,
            check=False,
        )

    ok = check(body)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["claims"]["model_sha256"] == _sha256(server.home / "tiny.gguf")
    body["choices"][0]["message"]["content"] += "!"
    bad = check(body)
    assert bad.returncode != 0 and "altered" in bad.stderr


def _sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_concurrent_clients_are_batched(server, http):
    async def one(c: openai.AsyncOpenAI, i: int) -> int:
        r = await c.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=24, temperature=0)
        return r.usage.completion_tokens

    async def all_of_them() -> list[int]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.key, max_retries=0)
        return await asyncio.gather(*(one(c, i) for i in range(4)))

    steps = metric(http, "leat_engine_steps_total")
    tokens = sum(asyncio.run(all_of_them()))
    taken = metric(http, "leat_engine_steps_total") - steps
    assert taken < tokens, f"{tokens} tokens in {taken} steps: requests were not decoded together"


def test_disconnect_cancels_and_frees_the_slot(server, http):
    before = metric(http, "leat_requests_cancelled_total", endpoint="chat")
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 900, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {server.key}"}
    with (
        httpx.Client(base_url=server.url, headers=headers) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and '"content":"' in line and '"content":""' not in line:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (
            metric(http, "leat_requests_cancelled_total", endpoint="chat") > before
            and metric(http, "leat_running") == 0
        ):
            break
        time.sleep(0.05)
    assert metric(http, "leat_requests_cancelled_total", endpoint="chat") == before + 1
    assert metric(http, "leat_running") == 0
    # Its pages came back: whatever is still in use is only held by the prefix cache.
    assert metric(http, "leat_kv_pages_used") == metric(http, "leat_kv_pages_cached")
    metrics = http.get("/metrics").text
    for name in (
        "leat_queue_depth",
        "leat_kv_pages_used",
        "leat_kv_pages_free",
        'leat_allocated_bytes{kind="weights"}',
        "leat_time_to_first_token_seconds_bucket",
        "leat_generated_tokens_total",
    ):
        assert name in metrics


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}}]


def test_engine_offers_constrained_decoding():
    from leat_server.service import ENGINE_FIELDS

    assert "processors" in ENGINE_FIELDS  # forced tool calls and response_format rely on it


def test_tool_call_round_trip(client):
    """tool_choice naming a function makes the model write that call (constrained decoding), then the result goes back."""
    ask = [{"role": "user", "content": "weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice=choice, max_tokens=60, seed=1
    )
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and isinstance(args["days"], int)
    back = ask + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=back, tools=TOOLS, max_tokens=5, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", max_tokens=150, seed=2, stream=True
    )
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and json.loads(deltas[0].function.arguments)["city"]


def test_json_schema_output_parses_and_validates(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=HELLO, response_format=fmt, max_tokens=80, seed=3)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 10


def test_the_openai_clients_parse_gets_a_pydantic_model_with_tuples_dates_and_bounds(client):
    """The official client's ``parse`` sends a pydantic model's strict schema (prefixItems for a tuple, format for
    dates and uuids, minimum / maximum, pattern); what comes back must validate as that model (before: a 400 for
    prefixItems and pattern, formats and bounds not enforced)."""
    import datetime
    import uuid
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Trip(BaseModel):
        day: datetime.date
        start: datetime.datetime
        id: uuid.UUID
        spot: tuple[Annotated[int, Field(ge=-3, le=40)], Annotated[str, Field(max_length=3)]]
        code: Annotated[str, Field(pattern=r"^[A-Z]{2}-\d{2}(x|yz)?$")]

    for seed in (1, 2):
        r = client.beta.chat.completions.parse(
            model=MODEL, messages=HELLO, response_format=Trip, max_tokens=160, temperature=1.0, seed=seed
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        trip = r.choices[0].message.parsed
        assert isinstance(trip, Trip) and -3 <= trip.spot[0] <= 40 and len(trip.spot[1]) <= 3


def test_messages_and_responses_stream_tool_use(server, client):
    claude = anthropic.Anthropic(base_url=server.url, api_key=server.key, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    with claude.messages.stream(
        model=MODEL, max_tokens=60, messages=HELLO, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input["city"] in ("Paris", "Rome")
    events = list(
        client.responses.create(
            model=MODEL,
            input="weather?",
            max_output_tokens=150,
            stream=True,
            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
            tool_choice="required",
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    assert events[-1].response.output[-1].type == "function_call"


def test_sessions_reuse_the_conversation_kv(client):
    first = client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, temperature=0, extra_body={"session": "conversation-1"}
    )
    turn = HELLO + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and then?"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=turn, max_tokens=4, temperature=0, extra_body={"session": "conversation-1"}
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"session": "../../x"})


def test_hibernating_needs_a_session_store(client, http):
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, extra_body={"session": "no-store"})
    refused = http.post("/v1/sessions/no-store/hibernate")
    assert refused.status_code == 400 and "--session-store" in refused.json()["error"]["message"]
    assert http.get("/v1/sessions/no-store").json()["hibernated"] is False  # still in memory, still usable
