"""The tiny random-weight Qwen files llama.cpp's references were recorded on, and how to rebuild them.

Shared by ``scripts/record_llamacpp_tiny.py`` (which records llama.cpp's logits on them) and
``../test_llamacpp_agreement.py`` (which rebuilds each file, checks its SHA-256 against the recording and
compares leat with the recorded logits). Files are written by :func:`leat.testing.write_tiny_gguf`,
deterministically: the same configuration gives the same bytes.

Run as a script (in leat's environment) to build every file into a folder and print one JSON line,
``{name: {"path", "sha256", "token_ids", ...configuration}}``::

    uv run python architectures/qwen3/tests/references/tiny_models.py OUTDIR
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# name -> architecture, quant type, seed, overrides of the architecture's tiny(), prompt length.
# Qwen3.tiny(): 2 layers, width 48, 4 heads of 16 (head size apart from width/heads), 2 kv heads, tied.
# Qwen3Moe.tiny(): the same with 8 experts of ffn 32, top-2. Qwen2.tiny(): width 64, q/k/v biases, no q/k norm.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-f32": {"arch": "qwen3", "qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "qwen3-f32-odd-heads": {
        "arch": "qwen3",
        "qtype": "F32",
        "seed": 1,
        "params": {"layers": 3, "heads": 3, "kv_heads": 1, "tied": False},
        "tokens": 64,
    },
    "qwen3-f32-yarn": {
        "arch": "qwen3",
        "qtype": "F32",
        "seed": 2,
        "params": {"heads": 8, "kv_heads": 2, "head_dim": 8, "yarn_factor": 4.0, "yarn_context": 32},
        "tokens": 100,
    },
    "qwen3-f16": {"arch": "qwen3", "qtype": "F16", "seed": 3, "params": {"kv_heads": 4}, "tokens": 64},
    "qwen3moe-f32": {"arch": "qwen3moe", "qtype": "F32", "seed": 4, "params": {}, "tokens": 64},
    "qwen3moe-f32-top4-odd-heads": {
        "arch": "qwen3moe",
        "qtype": "F32",
        "seed": 5,
        "params": {"heads": 3, "kv_heads": 1, "experts": 16, "experts_used": 4, "tied": False},
        "tokens": 64,
    },
    "qwen3moe-f16": {"arch": "qwen3moe", "qtype": "F16", "seed": 6, "params": {"layers": 3}, "tokens": 64},
    "qwen2-f32": {"arch": "qwen2", "qtype": "F32", "seed": 7, "params": {}, "tokens": 64},
    "qwen2-f16-gqa4": {
        "arch": "qwen2",
        "qtype": "F16",
        "seed": 8,
        "params": {"heads": 8, "kv_heads": 2, "head_dim": 8, "tied": False},
        "tokens": 64,
    },
}


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_qwen3.qwen import Qwen2, Qwen3, Qwen3Moe

    return {"qwen3": Qwen3, "qwen3moe": Qwen3Moe, "qwen2": Qwen2}[config["arch"]]


def params_for(config: dict[str, Any]) -> Any:
    return architecture(config).tiny(**config["params"])


def tokens(name: str) -> np.ndarray:
    """The prompt fed to configuration ``name``: seeded random token ids (no tokenizer involved)."""
    config = CONFIGS[name]
    vocab = params_for(config).vocab
    return np.random.default_rng(1000 + config["seed"]).integers(0, vocab, config["tokens"]).astype(np.int32)


def build(name: str, path: str | Path) -> Path:
    """Write the tiny file of configuration ``name`` to ``path`` (the same bytes every time)."""
    from leat.testing import write_tiny_gguf

    config = CONFIGS[name]
    qtype = gguf.GGMLQuantizationType[config["qtype"]]
    return write_tiny_gguf(architecture(config), path, qtype, config["seed"], params_for(config))


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: tiny_models.py OUTDIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name, config in CONFIGS.items():
        path = build(name, out / f"tiny-{name}.gguf")
        hyper = dataclasses.asdict(params_for(config))
        built[name] = {**config, "path": str(path), "sha256": sha256(path), "token_ids": tokens(name).tolist()}
        built[name]["hyperparameters"] = hyper
    print(json.dumps(built))


if __name__ == "__main__":
    main(sys.argv[1:])
