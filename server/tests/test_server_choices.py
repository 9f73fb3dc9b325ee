"""``n`` choices, and batches of prompts on ``/v1/completions``, through the official openai client against a real
``leat serve``: each choice is a request of its own in the engine, seeded with the request's seed plus its index;
greedy choices against the greedy CPU text of this process."""

from __future__ import annotations

import httpx
import openai
import pytest
from leat_server.testing import greedy_text

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def sampled(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=10, temperature=1.5, **kwargs)


def test_n_chat_choices_are_the_seeded_single_requests(client):
    whole = sampled(client, n=3, seed=40)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    singles = [sampled(client, seed=40 + i).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in whole.choices] == singles
    assert len(set(singles)) > 1  # the choices differ
    one = sampled(client, seed=40)
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert whole.usage.completion_tokens == sum(sampled(client, seed=40 + i).usage.completion_tokens for i in range(3))


def test_n_chat_choices_streamed_are_the_whole_answers(client):
    whole = sampled(client, n=2, seed=7)
    texts, finishes, usage = ["", ""], [None, None], None
    for chunk in sampled(client, n=2, seed=7, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_batch_of_prompts_with_n_gives_each_prompts_choices_in_order(client, path):
    prompts = ["the quick brown", "once upon a"]
    answer = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    want = [greedy_text(path, p, 6) for p in prompts]
    assert [c.text for c in answer.choices] == [want[0], want[0], want[1], want[1]]
    streamed = ["" for _ in range(4)]
    for chunk in client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [c.text for c in answer.choices]
    echoed = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0, echo=True)
    assert [c.text[: len(p)] for c, p in zip(echoed.choices, prompts, strict=True)] == prompts


@pytest.mark.parametrize(
    ("route", "body", "says"),
    [
        ("/v1/chat/completions", {"messages": HELLO, "n": 17}, "at most 16"),
        ("/v1/chat/completions", {"messages": HELLO, "n": 2, "session": "s"}, "session"),
        ("/v1/completions", {"prompt": ["a"] * 9, "n": 2}, "at most 16"),
        ("/v1/completions", {"prompt": ["a", 5]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], ""]}, "empty"),
    ],
)
def test_too_many_or_mixed_choices_are_a_400(server, route, body, says):
    r = httpx.post(server.url + route, json={"model": "tiny", "max_tokens": 2, **body})
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
