"""Fill-in-the-middle through llama-server's ``/infill``, OpenAI completions' ``suffix`` and Ollama's ``suffix``, on
a tiny model whose vocabulary has FIM tokens: each answers the greedy CPU text of the prompt written out by hand as
llama-server writes it ([BOS] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID])."""

from __future__ import annotations

import httpx
import leat
import leat.testing
import ollama
import openai
import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess, greedy_text

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
PREFIX, SUFFIX = "the quick brown", " over the lazy dog"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # the tiny vocabulary with FIM tokens (found by their text)
        patch.setattr(leat.testing, "SPECIAL_TOKENS", [*leat.testing.SPECIAL_TOKENS, *FIM])
        return write_tiny_gguf(Llama, tmp_path_factory.mktemp("fim") / "tiny.gguf", params=Llama.tiny(context=512))


@pytest.fixture(scope="module")
def server(path):
    with ServerProcess(path, ["--backend", "cpu"], timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def want(path):
    model = leat.load(str(path), backend="cpu", precision="f32")
    pre, suf, mid = (model.tokenize(t, add_special=False, parse_special=True) for t in FIM)
    ids = [model.tokenizer.bos_id, *pre, *model.tokenize(PREFIX, add_special=False)]
    ids += [*suf, *model.tokenize(SUFFIX, add_special=False), *mid]
    assert len(pre) == len(suf) == len(mid) == 1
    return ids, greedy_text(path, ids, 8)


def test_infill_is_the_greedy_text_of_the_fim_prompt(server, want):
    ids, text = want
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, "temperature": 0}
    answer = httpx.post(server.url + "/infill", json=body).json()
    assert answer["content"] == text and answer["tokens_evaluated"] == len(ids)
    # other files' chunks do not fit a 512-token context beside llama-server's 2,048-token batch: left out, as there
    extra = {**body, "input_extra": [{"filename": "a.py", "text": "x = 1\n"}]}
    assert httpx.post(server.url + "/infill", json=extra).json()["content"] == text


def test_openai_and_ollama_suffix_fill_the_middle(server, want):
    _, text = want
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    completion = client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    assert completion.choices[0].text == text
    generated = ollama.Client(host=server.url).generate(
        model="tiny", prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 8}
    )
    assert generated.response == text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
