"""leat's reranking (``leat.model.rerank_prompt`` and ``Model.rank``, what ``POST /v1/rerank`` returns) is
llama.cpp's, for the same file, query and documents.

The references are llama.cpp's prompt token ids (llama-server's join of query and document, on llama.cpp's
tokenizer) and pooled outputs recorded by ``scripts/record_llamacpp_rerank.py`` on the tiny rerankers of
``tests/references/tiny_rerank.py`` (rebuilt here, and checked against the recorded SHA-256): one with the
Qwen3-Reranker rerank template, one without (llama-server's own join). llama.cpp's pooled output is the softmax of the
classifier head over the labels ["yes", "no"]; llama-server reports the first as ``relevance_score``. Two llama.cpp
runs per file: its default F16 KV cache (as ``llama-server`` runs), and an F32 KV cache.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.model import rerank_prompt

REFERENCES = Path(__file__).parent / "references"
spec = importlib.util.spec_from_file_location("leat_tests_pooled", REFERENCES / "llamacpp_pooled.py")
pooled = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pooled)
RECORDING = pooled.Recording("rerank")

# Largest |difference| of a label probability, by the file's weights and llama.cpp's KV cache. Measured with
# llama-cpp-python 0.3.36, leat at f64 and at f32 alike: the F32 file with an F32 KV cache <= 3.5e-7 (float32
# rounding); with llama.cpp's default F16 KV cache <= 2.0e-4 (its keys and values rounded to 16 bits); the F16 file
# <= 5.8e-4 with either cache (llama.cpp rounds activations to F16 before an F16 product). Bars a few times above.
TOLERANCE = {("F32", "f32kv"): 2e-6, ("F32", "f16kv"): 1e-3, ("F16", "f32kv"): 2e-3, ("F16", "f16kv"): 2e-3}


@pytest.mark.parametrize("name", RECORDING.names)
def test_rerank_matches_llamacpp(name, tmp_path):
    config, recorded = RECORDING.manifest["tiny"][name], RECORDING.arrays
    for precision, model in RECORDING.models(name, tmp_path, "pairs"):
        assert model.pooling == "rank" and model.architecture.classifier.shape[0] == len(config["labels"])
        for i, (query, document) in enumerate(config["pairs"]):
            ids = rerank_prompt(model.file, model.tokenizer, query, document)
            assert ids == config["prompts"][i], f"{name} pair {i}: leat joins query and document unlike llama-server"
            ours = model.rank(ids)
            for kind in ("f32kv", "f16kv"):
                tolerance = TOLERANCE[config["qtype"], kind]
                error = float(np.abs(ours - recorded[f"{name}/{i}/{kind}"]).max())
                assert error <= tolerance, f"{name} pair {i} ({len(ids)} tokens), {precision} vs llama.cpp {kind}"
        # the check can fail: the first position's state, or the logits unsoftmaxed, are far from llama.cpp's
        states = model.hidden(config["prompts"][0])
        logits = model.architecture.classifier.astype(np.float64) @ states[-1]
        first = model.architecture.classifier.astype(np.float64) @ states[0]
        theirs = recorded[f"{name}/0/f32kv"]
        for other in (np.exp(first) / np.exp(first).sum(), logits):
            assert np.abs(other - theirs).max() > 30 * TOLERANCE[config["qtype"], "f32kv"]
