"""Issue #19: ``POST /v1/embeddings`` through the official openai client, against ``leat serve --api-workers 1``
(the engine in a process of its own), checked against the float64 oracle's hidden states pooled here."""

from __future__ import annotations

import base64

import httpx
import leat
import numpy as np
import openai
import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess

TEXTS = ["hello there", "the sky is blue because of rayleigh scattering"]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(Llama, tmp_path_factory.mktemp("embed") / "tiny.gguf", params=Llama.tiny(context=256))


@pytest.fixture(scope="module")
def server(path):
    with ServerProcess(path, ["--backend", "cpu", "--api-workers", "1"], timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_embeddings_are_the_oracles_pooled_hidden_states(client, path):
    oracle = leat.load(str(path), backend="cpu", precision="f64")
    answer = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in answer.data] == [0, 1]
    ids = [oracle.tokenize(text) for text in TEXTS]
    assert answer.usage.prompt_tokens == sum(map(len, ids))
    for tokens, item in zip(ids, answer.data):
        mean = oracle.hidden(tokens).mean(axis=0)  # the file states no pooling type: mean
        np.testing.assert_allclose(item.embedding, mean / np.linalg.norm(mean), atol=1e-5)
    # token ids, and base64 (little-endian float32) give the same vectors
    again = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    np.testing.assert_allclose(again.data[0].embedding, answer.data[1].embedding, atol=1e-7)
    raw = httpx.post(str(client.base_url) + "embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    packed = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(packed, answer.data[0].embedding, atol=1e-7)
    assert client.embeddings.create(model="tiny", input=[TEXTS[0]]).data[0].embedding == answer.data[0].embedding


def test_bad_embedding_requests_are_400(server):
    for body in (
        {"input": ""},
        {"input": []},
        {"input": [[]]},
        {"input": [1, "a"]},
        {"input": [10**6]},
        {"input": list(range(3, 300))},  # over the context of 256
        {"input": "hi", "dimensions": 8},
        {"input": "hi", "encoding_format": "hex"},
        {"input": "hi", "extra": 1},
        {},
    ):
        r = httpx.post(server.url + "/v1/embeddings", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
