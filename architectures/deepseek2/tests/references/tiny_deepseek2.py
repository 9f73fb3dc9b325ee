"""The tiny DeepSeek2 files the llama.cpp references were recorded on, and how to rebuild them.

Shared by ``record_llamacpp.py`` (run with a Python that has llama-cpp-python; it needs only the tables here)
and the agreement tests (which rebuild each file bit for bit and check its SHA-256 against the recording).
Run as a script in leat's environment to build every file into a folder and print JSON (path, SHA-256 and
hyperparameters of each)::

    uv run python architectures/deepseek2/tests/references/tiny_deepseek2.py OUTDIR
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

# name -> quant type, seed, overrides of DeepSeek2.tiny(), how many tokens of PROMPT_TEXT to use.
# tiny(): 3 layers (1 dense, 2 MoE), width 64, 4 heads, q_rank 24, kv_rank 32, nope 16, rope 8, v 16,
# 8 experts of 32, top-2, 1 shared expert, softmax gating, attn_k_b/attn_v_b, untied output.
CONFIGS: dict[str, dict[str, Any]] = {
    "f32-v2": {"qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "f32-lite-kv-b-odd-heads": {
        "qtype": "F32",
        "seed": 1,
        "tokens": 64,
        "params": {"q_rank": 0, "split_kv_b": False, "heads": 3},
    },
    "f32-v3-routing": {
        "qtype": "F32",
        "seed": 2,
        "tokens": 64,
        "params": {
            "gating": "sigmoid",
            "selection_bias": True,
            "groups": 4,
            "groups_used": 2,
            "weights_norm": True,
            "weights_scale": 2.5,
            "experts_used": 3,
        },
    },
    "f32-yarn": {
        "qtype": "F32",
        "seed": 3,
        "tokens": 64,
        "params": {
            "heads": 6,
            "tied": True,
            "rope_scaling": "yarn",
            "rope_factor": 4.0,
            "yarn_context": 16,
            "yarn_log_mul": 0.0707,
        },
    },
    "f16-v3-yarn": {
        "qtype": "F16",
        "seed": 4,
        "tokens": 64,
        "params": {
            "gating": "sigmoid",
            "selection_bias": True,
            "groups": 2,
            "groups_used": 1,
            "weights_norm": True,
            "rope_scaling": "yarn",
            "rope_factor": 8.0,
            "yarn_context": 32,
        },
    },
    "f32-v3-mtp": {
        # a fourth block that is a multi-token-prediction layer (nextn_predict_layers 1): llama.cpp, as leat, runs
        # the three before it
        "qtype": "F32",
        "seed": 6,
        "tokens": 64,
        "params": {"layers": 4, "nextn_layers": 1, "gating": "sigmoid", "selection_bias": True, "weights_norm": True},
    },
    "f16-kv-b-all-moe": {
        "qtype": "F16",
        "seed": 5,
        "tokens": 64,
        "params": {"split_kv_b": False, "dense_layers": 0, "experts_used": 4, "shared_experts": 2},
    },
}

PROMPT_TEXT = (
    "the quick brown fox jumps over the lazy dog. hello world, this is a tiny test model for leat and "
    "llama.cpp. the sky is blue because of rayleigh scattering of sunlight in the atmosphere, and sunsets "
    "are red for the same reason: 1 + 2 = 3, def f(x): return x * 2 # Ünïcödé ✓ 漢字 🙂 tabs\tand\nnewlines."
)


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_deepseek2.deepseek2 import DeepSeek2

    return DeepSeek2


def models() -> Any:
    """The configurations as a :class:`leat.testing.TinyModels` (imported here: record_llamacpp.py reads this file
    without leat)."""
    from leat.testing import TinyModels

    return TinyModels(CONFIGS, architecture)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: tiny_deepseek2.py OUTDIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    from leat.testing import sha256

    built, tiny = {}, models()
    for name, config in CONFIGS.items():
        path = tiny.build(name, out / f"tiny-deepseek2-{name}.gguf")
        hyper = dataclasses.asdict(tiny.params(name))
        built[name] = {"path": str(path), "sha256": sha256(path), **config, "hyperparameters": hyper}
    print(json.dumps({"tiny": built}))


if __name__ == "__main__":
    main(sys.argv[1:])
