"""Ollama's native API on ``leat serve`` (a real process), driven by the official ``ollama`` Python client: chat and
generate whole and streamed (newline-delimited JSON), raw prompts against the greedy CPU text, a context carried
over, JSON output, logprobs, embeddings against the float64 oracle, the model listings, and clear errors."""

from __future__ import annotations

import json

import httpx
import leat
import numpy as np
import ollama
import openai
import pytest
from leat_server.ollama_api import served_name
from leat_server.testing import greedy_text

HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


def test_chat_whole_and_streamed_is_the_openai_endpoints_answer(server, client):
    whole = client.chat(model="tiny", messages=HELLO, options=GREEDY)
    openai_client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    reference = openai_client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    assert whole.message.role == "assistant" and whole.message.content == reference.choices[0].message.content
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.prompt_eval_count == reference.usage.prompt_tokens and whole.total_duration > 0
    parts = list(client.chat(model="tiny", messages=HELLO, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == 8 and parts[-1].eval_duration > 0


def test_generate_raw_is_the_greedy_text_and_its_context_carries_on(client, path):
    """A raw prompt's answer is the greedy text of this process's CPU model; its ``context`` is the prompt's tokens
    and the generated ones, and a request with it goes on from there as a prompt of those tokens would."""
    model = leat.load(str(path), backend="cpu", precision="f32")
    ids = model.tokenize("hello there")
    tokens = list(model.generate(ids, max_tokens=8, sampling={"temperature": 0}))
    first = client.generate(model="tiny", prompt="hello there", raw=True, options=GREEDY)
    assert first.response == "".join(t.text for t in tokens) == greedy_text(path, "hello there", 8)
    assert list(first.context) == ids + [t.id for t in tokens]
    again = client.generate(model="tiny", prompt=" and more", raw=True, context=first.context, options=GREEDY)
    continued = list(first.context) + model.tokenize(" and more", add_special=False)
    assert again.response == greedy_text(path, continued, 8)
    streamed = list(client.generate(model="tiny", prompt="hello there", raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == first.response and list(streamed[-1].context) == list(first.context)


def test_generate_with_the_template_is_a_one_message_chat(client):
    generated = client.generate(model="tiny", prompt="hello there", system="be brief", options=GREEDY)
    chat = client.chat(model="tiny", messages=[{"role": "system", "content": "be brief"}, *HELLO], options=GREEDY)
    assert generated.response == chat.message.content


def test_model_names_take_ollamas_latest_tag():
    assert served_name({"tiny": 1}, "tiny:latest") == "tiny"
    assert served_name({"tiny:latest": 1}, "tiny:latest") == "tiny:latest"
    assert served_name({"tiny": 1}, "other:latest") == "other:latest"  # the lookup's 404 names it as sent


def test_json_format_and_a_schema_give_json(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    answer = client.chat(model="tiny", messages=HELLO, format=schema, options={"temperature": 1, "seed": 3})
    value = json.loads(answer.message.content)
    assert set(value) == {"name", "age"} and len(value["name"]) <= 5 and 0 <= value["age"] <= 99
    loose = client.generate(model="tiny", prompt="hello", format="json", options={"seed": 4, "num_predict": 200})
    assert loose.done_reason == "stop" and isinstance(json.loads(loose.response), dict)


def test_logprobs_are_the_tokens_and_their_alternatives(client):
    answer = client.generate(
        model="tiny", prompt="hello there", raw=True, logprobs=True, top_logprobs=3, options=GREEDY
    )
    assert len(answer.logprobs) == 8 and "".join(lp.token for lp in answer.logprobs) == answer.response
    for lp in answer.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.logprob <= 0
        assert lp.top_logprobs[0].token == lp.token and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
    streamed = list(client.chat(model="tiny", messages=HELLO, logprobs=True, options=GREEDY, stream=True))
    assert sum(len(p.logprobs or []) for p in streamed) == 8


def test_embeddings_are_the_oracles_pooled_hidden_states(client, path):
    oracle = leat.load(str(path), backend="cpu", precision="f64")
    texts = ["hello there", "the sky is blue"]
    answer = client.embed(model="tiny", input=texts)
    assert answer.prompt_eval_count == sum(len(oracle.tokenize(t)) for t in texts)
    for text, vector in zip(texts, answer.embeddings, strict=True):
        mean = oracle.hidden(oracle.tokenize(text)).mean(axis=0)
        np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=1e-5)
    single = client.embeddings(model="tiny", prompt=texts[0])
    np.testing.assert_allclose(single.embedding, answer.embeddings[0], atol=1e-7)
    long = "word " * 700  # over the context of 512: cut by default, refused with truncate false
    assert len(client.embed(model="tiny", input=long).embeddings[0]) == len(answer.embeddings[0])
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="tiny", input=long, truncate=False)
    assert refused.value.status_code == 400 and "truncate" in refused.value.error


def test_listings_show_and_version(server, client, path):
    listed = client.list().models
    assert [m.model for m in listed] == ["tiny"] and listed[0].size == path.stat().st_size
    assert listed[0].details.format == "gguf" and listed[0].details.family == "llama"
    assert listed[0].details.quantization_level == "F32" and listed[0].details.parameter_size.endswith("K")
    running = client.ps().models
    assert [m.model for m in running] == ["tiny"] and running[0].context_length == 512
    shown = client.show("tiny:latest")
    assert "completion" in shown.capabilities and shown.modelinfo["llama.context_length"] == 512
    assert shown.template and shown.details.family == "llama"
    assert httpx.get(server.url + "/api/version").json()["version"] == leat.__version__


def test_loading_with_no_prompt_generates_nothing(server):
    for path, field in (("/api/generate", "response"), ("/api/chat", "message")):
        r = httpx.post(server.url + path, json={"model": "tiny"})
        assert r.status_code == 200 and r.json()["done_reason"] == "load" and field in r.json()
    # one model served: it cannot be unloaded, and says so
    r = httpx.post(server.url + "/api/generate", json={"model": "tiny", "keep_alive": 0})
    assert r.status_code == 400 and r.json()["error"]


def test_options_map_onto_the_sampler_and_load_options_are_the_servers(client):
    base = client.chat(model="tiny", messages=HELLO, options=GREEDY)
    same = client.chat(
        model="tiny", messages=HELLO, options={**GREEDY, "num_ctx": 4096, "num_gpu": 99, "typical_p": 1.0}
    )
    assert same.message.content == base.message.content
    raw = client.generate(model="tiny", prompt="hello there", raw=True, options=GREEDY).response
    stopped = client.generate(model="tiny", prompt="hello there", raw=True, options={**GREEDY, "stop": [raw[3:5]]})
    assert stopped.done_reason == "stop" and stopped.response == raw[: raw.index(raw[3:5])]
    seeded = [
        client.chat(model="tiny", messages=HELLO, options={"temperature": 1.5, "seed": 11, "num_predict": 12})
        for _ in range(2)
    ]
    assert seeded[0].message.content == seeded[1].message.content


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/api/chat", {"model": "tiny", "messages": HELLO, "options": {"bogus": 1}}, "options.bogus"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "options": {"typical_p": 0.5}}, "typical_p"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "options": {"num_predict": "x"}}, "num_predict"),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "format": "yaml"}, "format"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "think": "very"}, "think"),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["@@"]}]}, "base64"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "top_logprobs": 2}, "logprobs"),
        ("/api/chat", {"model": "tiny", "messages": HELLO, "extra": 1}, "extra"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"}, "suffix"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"}, "template"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "context": [10**6]}, "context"),
        ("/api/embed", {"model": "tiny", "input": []}, "input"),
        ("/api/show", {}, "model"),
        ("/api/chat", "not json", "JSON"),
    ],
)
def test_bad_requests_are_a_400_in_ollamas_shape(server, route, body, says):
    r = httpx.post(server.url + route, **({"json": body} if isinstance(body, dict) else {"content": body}))
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str) and says in r.json()["error"]


def test_model_management_is_left_to_the_command_line(server):
    r = httpx.post(server.url + "/api/pull", json={"model": "llama3"})
    assert r.status_code == 404 and "leat pull" in r.json()["error"]
    r = httpx.request("DELETE", server.url + "/api/delete", json={"model": "tiny"})
    assert r.status_code == 404 and "leat rm" in r.json()["error"]


def test_tools_and_a_tool_round_are_taken(client, server):
    """Tools (a Python function, as the client turns it into a schema) and a conversation holding an assistant's
    tool call and its result are rendered by the chat template and answered; a tool call without an arguments
    object is a 400."""

    def weather(city: str) -> str:
        """The weather in a city.

        Args:
          city: the city's name
        """
        return "sunny"

    with_tools = client.chat(model="tiny", messages=HELLO, tools=[weather], options=GREEDY)
    assert with_tools.done and with_tools.message.role == "assistant"
    call = {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    rounds = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [call]}]
    rounds.append({"role": "tool", "content": "sunny", "tool_name": "weather"})
    answered = client.chat(model="tiny", messages=rounds, tools=[weather], options={**GREEDY, "num_predict": 1})
    assert answered.done and answered.eval_count == 1
    bad = [*HELLO, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather"}}]}]
    bad[-1]["tool_calls"][0]["function"]["arguments"] = "city=Oslo"
    r = httpx.post(server.url + "/api/chat", json={"model": "tiny", "messages": bad, "stream": False})
    assert r.status_code == 400 and "arguments" in r.json()["error"]
