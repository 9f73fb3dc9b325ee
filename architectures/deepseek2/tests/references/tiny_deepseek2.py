"""The tiny DeepSeek2 files the llama.cpp references were recorded on, and how to rebuild them.

Shared by ``record_llamacpp.py`` (run with a Python that has llama-cpp-python; it needs only the tables here)
and the agreement tests (which rebuild each file bit for bit and check its SHA-256 against the recording).
Run as a script in leat's environment to build every file into a folder and print JSON (path, SHA-256 and
hyperparameters of each)::

    uv run python architectures/deepseek2/tests/references/tiny_deepseek2.py OUTDIR
"""

from __future__ import annotations

import dataclasses
import hashlib
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


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def params_for(config: dict[str, Any]) -> Any:
    from leat_arch_deepseek2.deepseek2 import DeepSeek2

    return DeepSeek2.tiny(**config["params"])


def build(name: str, path: str | Path) -> Path:
    """Write the tiny file of configuration ``name`` to ``path`` (deterministic: same bytes every time)."""
    import gguf
    from leat.testing import write_tiny_gguf
    from leat_arch_deepseek2.deepseek2 import DeepSeek2

    config = CONFIGS[name]
    qtype = gguf.GGMLQuantizationType[config["qtype"]]
    return write_tiny_gguf(DeepSeek2, path, qtype, config["seed"], params_for(config))


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: tiny_deepseek2.py OUTDIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name, config in CONFIGS.items():
        path = build(name, out / f"tiny-deepseek2-{name}.gguf")
        hyper = dataclasses.asdict(params_for(config))
        built[name] = {"path": str(path), "sha256": sha256(path), **config, "hyperparameters": hyper}
    print(json.dumps({"tiny": built}))


if __name__ == "__main__":
    main(sys.argv[1:])
