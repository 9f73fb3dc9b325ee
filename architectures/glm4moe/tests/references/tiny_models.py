"""The tiny random-weight GLM-4.5 MoE files llama.cpp's references were recorded on
(:class:`leat.testing.TinyModels`): ``scripts/record_llamacpp_tiny.py`` records on them and
``../test_llamacpp_agreement.py`` rebuilds them. Run as a script in leat's environment to build them all
(``uv run python tiny_models.py OUTDIR``).
"""

from __future__ import annotations

import sys
from typing import Any

from leat.testing import TinyModels

# name -> quant type, seed, overrides of Glm4Moe.tiny(), prompt length. Glm4Moe.tiny(): 3 layers (1 dense, 2 MoE of 8
# experts of ffn 32, top 2, one shared expert), width 48, 4 heads of 16 with 2 KV heads, RoPE on 8 of 16 dimensions,
# q/k/v biases, sigmoid gating with normalized weights scaled by 2.5, an untied output.
CONFIGS: dict[str, dict[str, Any]] = {
    "glm4moe-f32": {"qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "glm4moe-f32-mtp-qk-norm": {
        # one multi-token-prediction layer (block_count 4, nextn_predict_layers 1), q/k norms, MQA
        "qtype": "F32",
        "seed": 1,
        "params": {"layers": 4, "nextn_layers": 1, "qk_norm": True, "kv_heads": 1},
        "tokens": 64,
    },
    "glm4moe-f32-grouped-softmax-tied": {
        # 16 experts in 4 groups, 2 used; top 4; softmax gating, weights neither normalized nor scaled; no dense
        # layer, no q/k/v biases, tied output
        "qtype": "F32",
        "seed": 2,
        "params": {
            "experts": 16,
            "experts_used": 4,
            "groups": 4,
            "groups_used": 2,
            "gating_func": 1,
            "weights_norm": False,
            "weights_scale": None,
            "dense_layers": 0,
            "qkv_bias": False,
            "tied": True,
        },
        "tokens": 64,
    },
    "glm4moe-f16": {"qtype": "F16", "seed": 3, "params": {"rope_dims": 16, "shared_experts": 2}, "tokens": 64},
}


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_glm4moe.glm4moe import Glm4Moe

    return Glm4Moe


models = TinyModels(CONFIGS, architecture)

if __name__ == "__main__":
    models.main(sys.argv[1:])
