"""The tiny random-weight Gemma 4 files llama.cpp's references were recorded on
(:class:`leat.testing.TinyModels`): ``scripts/record_llamacpp_tiny.py`` records on them and
``../test_llamacpp_agreement.py`` rebuilds them. Run as a script in leat's environment to build them all
(``uv run python tiny_models.py OUTDIR``).
"""

from __future__ import annotations

import sys
from typing import Any

from leat.testing import TinyModels

# name -> quant type, seed, overrides of Gemma4.tiny(), prompt length. Gemma4.tiny(): E2B's shape, small: 6 layers
# alternating sliding (window 8) and full attention with their own head sizes and KV heads, the last two sharing the
# KV of the two before them, double-wide MLPs there, per-layer embeddings 32 wide, output scales, logits capped at 30.
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma4-f32-e2b": {"qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "gemma4-f32-dense-k-as-v": {
        # the larger models' shape: no per-layer embeddings, no shared KV, one MLP width, no attn_v (k is v), an
        # untied output, uncapped logits, two sliding layers per full one
        "qtype": "F32",
        "seed": 1,
        "params": {
            "layers": 3,
            "ffn": 96,
            "kv_heads": 2,
            "pattern": (True, True, False),
            "shared_kv_layers": 0,
            "per_layer": 0,
            "final_softcap": None,
            "output_scale": False,
            "separate_v": False,
            "tied": False,
        },
        "tokens": 64,
    },
    "gemma4-f16-e2b": {"qtype": "F16", "seed": 2, "params": {"window": 5}, "tokens": 64},
}


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_gemma4.gemma4 import Gemma4

    return Gemma4


models = TinyModels(CONFIGS, architecture)

if __name__ == "__main__":
    models.main(sys.argv[1:])
