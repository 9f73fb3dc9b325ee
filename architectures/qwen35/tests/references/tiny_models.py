"""The tiny random-weight Qwen3.5 files llama.cpp's references were recorded on (:class:`leat.testing.TinyModels`):
``scripts/record_llamacpp_tiny.py`` records on them and ``../test_llamacpp_agreement.py`` rebuilds them. Run as a
script in leat's environment to build them all (``uv run python tiny_models.py OUTDIR``).
"""

from __future__ import annotations

import sys
from typing import Any

from leat.testing import TinyModels

# name -> quant type, seed, overrides of Qwen35.tiny(), prompt length. Qwen35.tiny(): 4 layers, the fourth full
# attention (q with its gate, IMRoPE over 16 of 32 dimensions), the others gated delta-nets with 2 key heads and
# 4 value heads (value head h reads key head h % 2), a convolution over 4 tokens, a tied output.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen35-f32": {"qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "qwen35-f32-layers-listed": {
        # the layer kinds as attention.recurrent_layers lists them (the converter writes it from layer_types), key
        # heads as many as value heads, the IMRoPE sections leaving pairs unrotated, an untied output
        "qtype": "F32",
        "seed": 1,
        "params": {
            "layers": 5,
            "recurrent_layers": (True, False, True, True, False),
            "k_heads": 4,
            "rope_sections": (2, 2, 1, 1),
            "tied": False,
        },
        "tokens": 64,
    },
    "qwen35-f16": {"qtype": "F16", "seed": 2, "params": {"interval": 2}, "tokens": 64},
    # Qwen35Moe.tiny(): those layers with 8 experts of 32 (2 per token) and a gated shared expert of 48
    "qwen35moe-f32": {"qtype": "F32", "seed": 3, "params": {}, "tokens": 64, "moe": True},
}


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_qwen35.qwen35 import Qwen35, Qwen35Moe

    return Qwen35Moe if config.get("moe") else Qwen35


models = TinyModels(CONFIGS, architecture)

if __name__ == "__main__":
    models.main(sys.argv[1:])
