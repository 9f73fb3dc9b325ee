"""An answer that continues the assistant's last message (a prefill): Anthropic's last assistant message, vLLM's
``continue_final_message`` (and, as llama-server does, a last assistant message with no flag), Ollama's chat, through
the official clients, against the greedy CPU text of the prompt written out by hand in the tiny model's ChatML."""

from __future__ import annotations

import anthropic
import httpx
import leat
import ollama
import openai
import pytest
from leat_server.testing import greedy_text

PREFILL = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "Once upon"}]
CHATML = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nOnce upon"


@pytest.fixture(scope="module")
def want(path):
    ids = leat.load(str(path), backend="cpu", precision="f32").tokenize(CHATML, add_special=False, parse_special=True)
    return ids, greedy_text(path, ids, 6)


def test_the_template_is_chatml(server):
    """The hand-written prompt below is this model's template's (the template opens the assistant's turn so)."""
    rendered = httpx.post(server.url + "/apply-template", json={"messages": PREFILL[:1]}).json()["prompt"]
    assert rendered + "Once upon" == CHATML


def test_openai_chat_continues_the_last_assistant_message(server, want):
    ids, text = want
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
        answer = client.chat.completions.create(
            model="tiny", messages=PREFILL, max_tokens=6, temperature=0, extra_body=extra
        )
        assert answer.choices[0].message.content == text and answer.usage.prompt_tokens == len(ids)
    opened = client.chat.completions.create(
        model="tiny", messages=PREFILL, max_tokens=6, temperature=0, extra_body={"add_generation_prompt": True}
    )
    assert opened.usage.prompt_tokens > len(ids)  # the message closed and a new turn opened after it
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny",
            messages=PREFILL,
            max_tokens=6,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=PREFILL[:1], max_tokens=6, extra_body={"continue_final_message": True}
        )


def test_anthropic_messages_continue_the_last_assistant_message(server, want):
    ids, text = want
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    answer = claude.messages.create(model="tiny", max_tokens=6, messages=PREFILL, extra_body={"temperature": 0})
    assert answer.content[0].text == text
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == len(ids)
    assert claude.messages.count_tokens(model="tiny", messages=PREFILL).input_tokens == len(ids)


def test_ollama_chat_continues_the_last_assistant_message(server, want):
    ids, text = want
    answer = ollama.Client(host=server.url).chat(
        model="tiny", messages=PREFILL, options={"temperature": 0, "num_predict": 6}
    )
    assert answer.message.content == text and answer.prompt_eval_count <= len(ids)
