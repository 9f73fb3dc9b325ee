"""leat's embeddings (``Model.embed``, what ``POST /v1/embeddings`` returns) are llama.cpp's, for the same file and
token ids.

The references are llama.cpp's pooled embeddings recorded by ``scripts/record_llamacpp_embeddings.py`` on the tiny
files of ``tests/references/tiny_embeddings.py`` (rebuilt here, and checked against the recorded SHA-256), which
state their pooling: mean, CLS (the first token's) and last (Qwen3-Embedding's). leat L2-normalizes what it pools;
llama.cpp's recorded vectors are normalized here the same way. Two llama.cpp runs per file: its default F16 KV
cache (as ``llama-embedding`` runs), and an F32 KV cache, which leaves only float32 rounding between the two.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REFERENCES = Path(__file__).parent / "references"
spec = importlib.util.spec_from_file_location("leat_tests_pooled", REFERENCES / "llamacpp_pooled.py")
pooled = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pooled)
RECORDING = pooled.Recording("embeddings")

# Largest |difference| of an element of the unit vectors, by the file's weights and llama.cpp's KV cache. Measured
# with llama-cpp-python 0.3.36, leat at f64 and at f32 alike: F32 files with an F32 KV cache <= 2.8e-7 (float32
# rounding); with llama.cpp's default F16 KV cache <= 3.6e-4 (its keys and values rounded to 16 bits); F16 files
# <= 4.2e-4 with either cache (llama.cpp rounds activations to F16 before an F16 product). Bars a few times above.
TOLERANCE = {("F32", "f32kv"): 2e-6, ("F32", "f16kv"): 1e-3, ("F16", "f32kv"): 1e-3, ("F16", "f16kv"): 1e-3}


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


@pytest.mark.parametrize("name", RECORDING.names)
def test_embeddings_match_llamacpp(name, tmp_path):
    config, recorded = RECORDING.manifest["tiny"][name], RECORDING.arrays
    for precision, model in RECORDING.models(name, tmp_path, "inputs"):
        assert model.pooling == config["pooling"].lower()
        for i, ids in enumerate(config["inputs"]):
            ours = model.embed(ids).astype(np.float64)
            for kind in ("f32kv", "f16kv"):
                tolerance = TOLERANCE[config["qtype"], kind]
                theirs = unit(recorded[f"{name}/{i}/{kind}"].astype(np.float64))
                error = float(np.abs(ours - theirs).max())
                assert error <= tolerance, f"{name} input {i} ({len(ids)} tokens), {precision} vs llama.cpp {kind}"
        # the check can fail: another pooling of the same states is far from llama.cpp's
        if len(config["inputs"][-1]) > 1:
            states = model.hidden(config["inputs"][-1])
            other = unit(states[0] if config["pooling"] != "CLS" else states.mean(axis=0))
            theirs = unit(recorded[f"{name}/{len(config['inputs']) - 1}/f32kv"])
            assert np.abs(other - theirs).max() > 30 * TOLERANCE[config["qtype"], "f32kv"]
