"""Issue #19: ``POST /v1/rerank`` (and llama-server's other paths for it) against a real ``leat serve --api-workers 1``
(the engine in a process of its own) holding a tiny Qwen3-Reranker-style file, checked against the float64 oracle's
label probabilities; and a model that is no reranker beside it refused. There is no official rerank client: httpx
sends llama-server's (and Jina's) request shape."""

from __future__ import annotations

from typing import Any

import gguf
import httpx
import leat
import pytest
from leat.model import rerank_prompt
from leat.testing import write_tiny_gguf
from leat_arch_qwen3.qwen import Qwen3
from leat_server.testing import ServerProcess

QUERY = "why is the sky blue"
DOCUMENTS = ["blue light scatters the most", "paris is in france", "bread needs flour and water", "the sky at noon"]


class Reranker(Qwen3):  # a qwen3 file made a reranker as llama.cpp's converter makes Qwen3-Reranker one
    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, params: Any) -> None:
        Qwen3.write_metadata(writer, params)
        writer.add_uint32(gguf.Keys.LLM.POOLING_TYPE.format(arch="qwen3"), int(gguf.PoolingType.RANK))
        writer.add_array(gguf.Keys.Classifier.OUTPUT_LABELS.format(arch="qwen3"), ["yes", "no"])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank")
    reranker = write_tiny_gguf(Reranker, folder / "reranker.gguf", params=Qwen3.tiny(context=256), seed=5)
    plain = write_tiny_gguf(Qwen3, folder / "plain.gguf", params=Qwen3.tiny(context=256), seed=6)
    return {"reranker": reranker, "plain": plain}


@pytest.fixture(scope="module")
def server(files):
    with ServerProcess(files["reranker"], [str(files["plain"]), "--backend", "cpu"], timeout=120) as proc:
        yield proc


def test_rerank_ranks_by_the_oracles_yes_probability(server, files):
    oracle = leat.load(str(files["reranker"]), backend="cpu", precision="f64")
    prompts = [rerank_prompt(oracle.file, oracle.tokenizer, QUERY, doc) for doc in DOCUMENTS]
    want = [float(oracle.rank(ids)[0]) for ids in prompts]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])
    assert len({round(w, 4) for w in want}) == len(want)  # else the order could not be checked
    body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": True}
    answer = httpx.post(server.url + "/v1/rerank", json=body, timeout=60).json()
    assert answer["model"] == "reranker" and answer["object"] == "list"
    assert [r["index"] for r in answer["results"]] == order[:3]
    for result in answer["results"]:
        assert result["relevance_score"] == pytest.approx(want[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    tokens = sum(map(len, prompts))
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # llama-server's other paths; without top_n every document, without return_documents no text
    for path in ("/rerank", "/v1/reranking", "/reranking"):
        again = httpx.post(server.url + path, json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
        assert [r["index"] for r in again["results"]] == order and "document" not in again["results"][0]


def test_bad_rerank_requests_are_400(server):
    for body, words in (
        ({"query": QUERY, "documents": []}, "documents is empty"),
        ({"documents": DOCUMENTS}, "query"),
        ({"query": QUERY}, "documents"),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
        ({"query": QUERY, "documents": [{"text": "a"}]}, "documents"),
        ({"query": QUERY, "texts": DOCUMENTS}, "texts"),  # TEI's shape, which llama-server also takes
        ({"model": "plain", "query": QUERY, "documents": DOCUMENTS}, "not a reranker"),
    ):
        answer = httpx.post(server.url + "/v1/rerank", json=body, timeout=60)
        assert answer.status_code == 400, body
        assert words in answer.json()["error"]["message"], (body, answer.json())
    embedding = httpx.post(server.url + "/v1/embeddings", json={"model": "reranker", "input": "a"}, timeout=60)
    assert embedding.status_code == 400 and "reranker" in embedding.json()["error"]["message"]


def test_rerank_through_an_engine_process(server, files):
    body = {"query": QUERY, "documents": DOCUMENTS}
    want = httpx.post(server.url + "/v1/rerank", json=body, timeout=60).json()["results"]
    with ServerProcess(files["reranker"], ["--backend", "cpu", "--api-workers", "1"], timeout=120) as remote:
        got = httpx.post(remote.url + "/v1/rerank", json=body, timeout=60).json()["results"]
    assert [r["index"] for r in got] == [r["index"] for r in want]
    for ours, theirs in zip(got, want):
        assert ours["relevance_score"] == pytest.approx(theirs["relevance_score"], abs=1e-6)
