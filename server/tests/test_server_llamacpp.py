"""llama-server's own endpoints on ``leat serve`` (a real process): ``/completion`` whole and streamed in the shapes
llama.cpp's server README gives (greedy text against this process's CPU model), mixed and several prompts,
``n_probs``, stop words, grammars and schemas, ``logit_bias``, ``/apply-template`` and ``/props``."""

from __future__ import annotations

import json

import httpx
import leat
import openai
import pytest
from leat_server.testing import greedy_text

GREEDY = {"temperature": 0, "n_predict": 8}


@pytest.fixture(scope="module")
def model(path):
    return leat.load(str(path), backend="cpu", precision="f32")


def complete(server, **body):
    r = httpx.post(server.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_is_the_greedy_text_with_its_tokens_and_probabilities(server, model, path):
    answer = complete(server, prompt="hello there", return_tokens=True, n_probs=3, **GREEDY)
    tokens = list(model.generate("hello there", max_tokens=8, sampling={"temperature": 0}))
    assert answer["content"] == "".join(t.text for t in tokens) == greedy_text(path, "hello there", 8)
    assert answer["tokens"] == [t.id for t in tokens] and answer["stop"] is True
    assert answer["stop_type"] == "limit" and answer["tokens_predicted"] == 8
    assert answer["tokens_evaluated"] == len(model.tokenize("hello there"))
    assert answer["generation_settings"]["n_ctx"] == 512 and answer["generation_settings"]["n_predict"] == 8
    assert answer["timings"]["predicted_n"] == 8 and answer["timings"]["predicted_ms"] > 0
    probs = answer["completion_probabilities"]
    assert [p["id"] for p in probs] == answer["tokens"]
    for p in probs:
        assert len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"]
        assert p["top_logprobs"][0]["logprob"] == pytest.approx(p["logprob"]) and p["logprob"] <= 0


def test_completion_streamed_is_the_whole_answer(server):
    whole = complete(server, prompt="hello there", return_tokens=True, **GREEDY)
    with httpx.stream(
        "POST",
        server.url + "/completion",
        json={"prompt": "hello there", "stream": True, "return_tokens": True, **GREEDY},
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == whole["tokens"] == events[-1]["tokens"]
    assert events[-1]["stop_type"] == "limit"


def test_mixed_and_several_prompts(server, model, path):
    ids = model.tokenize("hello")
    mixed = complete(server, prompt=[*ids, " there"], **GREEDY)
    assert mixed["content"] == greedy_text(path, ids + model.tokenize(" there", add_special=False), 8)
    several = complete(server, prompt=["the quick brown", [*ids]], **GREEDY)
    assert [a["index"] for a in several] == [0, 1]
    assert [a["content"] for a in several] == [greedy_text(path, "the quick brown", 8), greedy_text(path, ids, 8)]


def test_stop_words_grammars_and_bias(server):
    whole = complete(server, prompt="hello there", **GREEDY)["content"]
    word = whole[3:5]
    stopped = complete(server, prompt="hello there", stop=[word], **GREEDY)
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == whole[: whole.index(word)]
    gbnf = complete(server, prompt="answer:", grammar='root ::= "yes" | "no"', temperature=1, seed=5)
    assert gbnf["content"] in ("yes", "no") and gbnf["stop_type"] == "eos"
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    shaped = complete(server, prompt="json:", json_schema=schema, temperature=1, seed=6)
    assert isinstance(json.loads(shaped["content"])["a"], int)
    first = complete(server, prompt="hello there", return_tokens=True, **GREEDY)["tokens"][0]
    banned = complete(server, prompt="hello there", return_tokens=True, logit_bias=[[first, False]], **GREEDY)
    assert banned["tokens"][0] != first
    as_object = complete(server, prompt="hello there", return_tokens=True, logit_bias={str(first): -100}, **GREEDY)
    assert as_object["tokens"] == banned["tokens"]


def test_apply_template_and_props(server):
    messages = [{"role": "user", "content": "hello there"}]
    prompt = httpx.post(server.url + "/apply-template", json={"messages": messages}).json()["prompt"]
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).chat.completions.create(
        model="tiny", messages=messages, max_tokens=1
    )
    counted = httpx.post(server.url + "/tokenize", json={"content": prompt, "parse_special": True}).json()["count"]
    assert counted == chat.usage.prompt_tokens
    props = httpx.get(server.url + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 512
    assert props["chat_template"] and props["model_path"].endswith("tiny.gguf")
    assert props["default_generation_settings"]["params"]["top_k"] == 40  # the sampler's default


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "x", "mirostat": 2}, "mirostat"),
        ({"prompt": "x", "lora": [{"id": 0, "scale": 1}]}, "lora"),
        ({"prompt": "x", "n_probs": 30}, "n_probs"),
        ({"prompt": "x", "grammar": 'root ::= "a"', "json_schema": {}}, "grammar"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "logit_bias": [[1]]}, "logit_bias"),
        ({"prompt": "x", "post_sampling_probs": True}, "post_sampling_probs"),
        ({"prompt": "x", "unknown": 1}, "unknown"),
    ],
)
def test_bad_completions_are_a_400(server, body, says):
    r = httpx.post(server.url + "/completion", json=body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_infill_needs_fim_tokens(server):
    r = httpx.post(server.url + "/infill", json={"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]
