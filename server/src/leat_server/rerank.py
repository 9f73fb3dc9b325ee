"""``POST /v1/rerank`` (and llama-server's other paths for it) as llama-server answers it: each document scored for
the query by a reranker GGUF (pooling type rank; :meth:`leat.model.Model.rank`, run by the engine between its
steps), best first."""

from __future__ import annotations

from typing import Any

import gguf
from leat.model import pooling_type, rerank_prompt

from leat_server.errors import bad_request
from leat_server.schemas import RerankRequest
from leat_server.service import Service

PATHS = ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking")
MAX_DOCUMENTS = 1000  # as Cohere's API


def rerank(service: Service, body: RerankRequest, owner: str | None) -> dict[str, Any]:
    kind = pooling_type(service.model.file)
    if kind != gguf.PoolingType.RANK:
        raise bad_request(
            f"model {service.name!r} is not a reranker (its pooling type is {kind.name.lower()}, not rank); "
            "serve a reranker GGUF (pooling type rank, a classifier head) for /v1/rerank",
            "model",
        )
    if not body.documents:
        raise bad_request("documents is empty; send a list of one or more texts to rank", "documents")
    if len(body.documents) > MAX_DOCUMENTS:
        raise bad_request(
            f"documents has {len(body.documents)} items; at most {MAX_DOCUMENTS} per request", "documents"
        )
    prompts = [rerank_prompt(service.model.file, service.tokenizer, body.query, doc) for doc in body.documents]
    for i, ids in enumerate(prompts):
        if len(ids) > service.max_context:
            raise bad_request(
                f"documents[{i}] with the query makes {len(ids)} tokens; the limit is {service.max_context}",
                "documents",
                "context_length_exceeded",
            )
    results = []
    for index, probabilities in enumerate(service.engine.rank(prompts)):
        # llama-server's score is the classifier's first output: Qwen3-Reranker's probability of "yes"
        result: dict[str, Any] = {"index": index, "relevance_score": probabilities[0]}
        if body.return_documents:
            result["document"] = {"text": body.documents[index]}
        results.append(result)
    results.sort(key=lambda r: -r["relevance_score"])  # stable: equal scores keep the documents' order
    tokens = sum(len(ids) for ids in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"model": service.name, "object": "list", "results": results[: body.top_n], "usage": usage}
