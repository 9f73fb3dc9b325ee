"""The tiny random-weight Qwen files llama.cpp's references were recorded on
(:class:`leat.testing.TinyModels`): ``scripts/record_llamacpp_tiny.py`` records on them and
``../test_llamacpp_agreement.py`` rebuilds them. Run as a script in leat's environment to build them all
(``uv run python tiny_models.py OUTDIR``).
"""

from __future__ import annotations

import sys
from typing import Any

from leat.testing import TinyModels

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


models = TinyModels(CONFIGS, architecture)

if __name__ == "__main__":
    models.main(sys.argv[1:])
