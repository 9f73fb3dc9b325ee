"""vLLM's token-level controls on chat and completions through the official openai client (``extra_body``):
``stop_token_ids``, ``min_tokens``, ``allowed_token_ids``, ``skip_special_tokens`` and ``include_stop_str_in_output``,
against the greedy tokens of this process's CPU model."""

from __future__ import annotations

import leat
import openai
import pytest

PROMPT = "the quick brown"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def greedy(path):
    model = leat.load(str(path), backend="cpu", precision="f32")
    return model, list(model.generate(PROMPT, max_tokens=8, sampling={"temperature": 0}))


def complete(client, **extra):
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)


def test_stop_token_ids_end_the_output_before_the_token(client, greedy):
    _, tokens = greedy
    stop = tokens[3].id
    first = next(i for i, t in enumerate(tokens) if t.id == stop)
    answer = complete(client, stop_token_ids=[stop])
    assert answer.choices[0].text == "".join(t.text for t in tokens[:first])
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == first
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].finish_reason == "length"  # without it the greedy chat runs to its limit


def test_min_tokens_hold_back_the_stop_tokens(client, greedy):
    model, tokens = greedy
    stop = tokens[0].id  # would end the output at once
    answer = complete(client, stop_token_ids=[stop], min_tokens=5, logprobs=0)
    assert answer.usage.completion_tokens >= 5
    ids = [model.tokenize(t, add_special=False, parse_special=True) for t in answer.choices[0].logprobs.tokens[:5]]
    assert all(stop not in piece for piece in ids)
    with pytest.raises(openai.BadRequestError):
        complete(client, min_tokens=9)  # over max_tokens


def test_allowed_token_ids_and_special_tokens(client, greedy):
    model, _ = greedy
    a, b = (model.tokenize(c, add_special=False)[0] for c in "ab")
    text = complete(client, allowed_token_ids=[a, b]).choices[0].text
    assert len(text) == 8 and set(text) <= {"a", "b"}
    special = model.tokenize("<|im_start|>", add_special=False, parse_special=True)[0]
    kept = complete(client, allowed_token_ids=[special], skip_special_tokens=False, max_tokens=3)
    assert kept.choices[0].text == "<|im_start|>" * 3
    assert complete(client, allowed_token_ids=[special]).choices[0].text == ""  # skipped, as by default
    with pytest.raises(openai.BadRequestError):
        complete(client, allowed_token_ids=[10**6])


def test_include_stop_str_in_output_keeps_the_stop_string(client, greedy):
    _, tokens = greedy
    whole = "".join(t.text for t in tokens)
    word = whole[2:4]
    cut = complete(client, stop=[word]).choices[0].text
    kept = complete(client, stop=[word], include_stop_str_in_output=True).choices[0].text
    assert cut == whole[: whole.index(word)] and kept == cut + word


def test_the_controls_cross_to_an_engine_process(path, greedy):
    """With ``--api-workers`` the engine runs in a process of its own: the processor goes there by its spec."""
    from leat_server.testing import ServerProcess

    model, _ = greedy
    a, b = (model.tokenize(c, add_special=False)[0] for c in "ab")
    with ServerProcess(path, ["--backend", "cpu", "--api-workers", "1"], timeout=120) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        text = complete(client, allowed_token_ids=[a, b], min_tokens=2).choices[0].text
    assert len(text) == 8 and set(text) <= {"a", "b"}
