"""``POST /v1/embeddings`` in OpenAI's shape: each input's final hidden states, pooled as the GGUF says and
L2-normalized (:meth:`leat.model.Model.embed`, run by the engine between its steps)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from leat_server.errors import bad_request, unsupported
from leat_server.schemas import EmbeddingRequest
from leat_server.service import Service

MAX_INPUTS = 2048  # as OpenAI's API


def inputs(service: Service, body: EmbeddingRequest) -> list[list[int]]:
    """Each input as token ids: texts tokenized with BOS as the model wants, token ids checked."""
    items: list[Any] = [body.input] if isinstance(body.input, str) else list(body.input)
    if items and all(isinstance(t, int) for t in items):
        items = [items]  # one input of token ids
    if not items:
        raise bad_request("input is empty; send a text, token ids, or a list of them", "input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
    vocab = service.model.architecture.vocab_size
    out = []
    for i, item in enumerate(items):
        if isinstance(item, int):
            raise bad_request("input mixes token ids with texts or lists; send one kind", "input")
        if not item:
            raise bad_request(f"input[{i}] is empty", "input")
        ids = service.tokenizer.encode(item, add_special=True) if isinstance(item, str) else item
        if not all(0 <= t < vocab for t in ids):
            raise bad_request(f"input[{i}] has token ids outside the vocabulary of {vocab}", "input")
        if len(ids) > service.max_context:
            raise bad_request(
                f"input[{i}] has {len(ids)} tokens; the limit is {service.max_context}",
                "input",
                "context_length_exceeded",
            )
        out.append(ids)
    return out


def embeddings(service: Service, body: EmbeddingRequest, owner: str | None) -> dict[str, Any]:
    if body.dimensions is not None:
        raise unsupported("dimensions", "embeddings have the model's width; they are not shortened")
    prompts = inputs(service, body)
    vectors = service.engine.embed(prompts)
    data = []
    for index, vector in enumerate(vectors):
        encoded: Any = vector
        if body.encoding_format == "base64":  # as OpenAI's: little-endian float32 bytes
            encoded = base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    tokens = sum(len(ids) for ids in prompts)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": service.name, "usage": usage}
