"""The tiny random-weight gpt-oss files llama.cpp's references were recorded on
(:class:`leat.testing.TinyModels`): ``scripts/record_llamacpp_tiny.py`` records on them and
``../test_llamacpp_agreement.py`` rebuilds them. Run as a script in leat's environment to build them all
(``uv run python tiny_models.py OUTDIR``).

Configurations with MXFP4 experts also get a ``dequantized`` copy (every quantized tensor's exact values stored
as F32), on which llama.cpp computes in plain float: the distance between its two runs is its own quantized
arithmetic.
"""

from __future__ import annotations

import sys
from typing import Any

import gguf
from leat.testing import TinyModels

Q = gguf.GGMLQuantizationType

# name -> quant type, expert quant type (None: as the rest), seed, overrides of GptOss.tiny(), prompt length.
# GptOss.tiny(): 2 layers (sliding window 8, then full), width 64, 4 heads of 16, 2 kv heads, 4 experts of
# ffn 32 with top-2, YaRN factor 32 over 4096 positions, rope base 150000.
CONFIGS: dict[str, dict[str, Any]] = {
    "f32": {"qtype": "F32", "experts": None, "seed": 0, "params": {}, "tokens": 64},
    "f32-odd-heads-top3": {
        "qtype": "F32",
        "experts": None,
        "seed": 1,
        "params": {"layers": 3, "heads": 3, "kv_heads": 1, "window": 5, "experts": 8, "experts_used": 3},
        "tokens": 64,
    },
    "f32-pattern-mha": {
        "qtype": "F32",
        "experts": None,
        "seed": 2,
        "params": {"layers": 3, "sliding": (False, True, True), "kv_heads": 4, "window": 16, "rope_base_swa": 1e4},
        "tokens": 100,
    },
    "f16-gqa4-top4": {
        "qtype": "F16",
        "experts": None,
        "seed": 3,
        "params": {"heads": 8, "kv_heads": 2, "head_dim": 8, "experts": 8, "experts_used": 4},
        "tokens": 64,
    },
    "mxfp4": {"qtype": "F32", "experts": "MXFP4", "seed": 4, "params": {}, "tokens": 64},
    "mxfp4-f16": {
        "qtype": "F16",
        "experts": "MXFP4",
        "seed": 5,
        "params": {"layers": 3, "experts": 8, "experts_used": 2, "expert_ffn": 64},
        "tokens": 64,
    },
}


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_gpt_oss.gpt_oss import GptOss

    return GptOss


class GptOssModels(TinyModels):
    def types(self, name: str) -> dict[str, gguf.GGMLQuantizationType]:
        """The experts of a configuration with ``experts`` in that type (a dequantized copy follows)."""
        experts = self.configs[name]["experts"]
        if not experts:
            return {}
        shapes = architecture(self.configs[name]).tensor_shapes(self.params(name))
        return {n: Q[experts] for n in shapes if n.endswith("_exps.weight")}


models = GptOssModels(CONFIGS, architecture)

if __name__ == "__main__":
    models.main(sys.argv[1:])
