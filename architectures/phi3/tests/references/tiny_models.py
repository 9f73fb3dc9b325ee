"""The tiny random-weight Phi-3 files llama.cpp's references were recorded on
(:class:`leat.testing.TinyModels`): ``scripts/record_llamacpp_tiny.py`` records on them and
``../test_llamacpp_agreement.py`` rebuilds them. Run as a script in leat's environment to build them all
(``uv run python tiny_models.py OUTDIR``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from leat.testing import TinyModels

# name -> quant type, seed, overrides of Phi3.tiny(), prompt length. Phi3.tiny(): 2 layers, width 64, 4 heads of 16
# with 2 kv heads, fused attn_qkv and ffn_up, RoPE on 8 of 16 dimensions, LongRoPE with a 256-token context trained
# from 64 (llama.cpp, run at n_ctx 256, takes the long factors), an untied output, sliding_window 0 (Phi-4's).
NAME = "tiny-phi-"  # in place of write_tiny_gguf's "tiny-phi3" (see build)
CONFIGS: dict[str, dict[str, Any]] = {
    "phi3-f32": {"qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "phi3-f32-short-factors-window": {
        # original context = context: the short factors; a sliding window of 16 that llama.cpp does not apply
        "qtype": "F32",
        "seed": 1,
        "params": {"layers": 3, "rope_dims": 16, "rope_context": 256, "sliding_window": 16},
        "tokens": 100,
    },
    "phi3-f32-unfused-tied": {
        # separate attn_q/k/v, no LongRoPE, tied output, GQA 4
        "qtype": "F32",
        "seed": 2,
        "params": {"heads": 8, "kv_heads": 2, "rope_dims": 8, "fused_qkv": False, "long_rope": False, "tied": True},
        "tokens": 64,
    },
    "phi3-f16": {"qtype": "F16", "seed": 3, "params": {"kv_heads": 4}, "tokens": 64},
    "phi3-f16-gqa-tied": {
        "qtype": "F16",
        "seed": 4,
        "params": {"heads": 8, "kv_heads": 2, "rope_dims": 6, "tied": True, "sliding_window": 2047},
        "tokens": 64,
    },
}


def architecture(config: dict[str, Any]) -> Any:
    from leat_arch_phi3.phi3 import Phi3

    return Phi3


class Phi3Models(TinyModels):
    def build(self, name: str, path: str | Path, dequantized: bool = False) -> Path:
        path = super().build(name, path, dequantized)
        # llama.cpp gives the special tokens of a model whose general.name holds "phi3" Phi-3's whitespace
        # attributes, looking up Phi-3's </s>, <s> and <unk>, which the tiny byte-level vocabulary lacks: loading
        # fails (unordered_map::at). So the files are renamed in place, to a name of the same length.
        field = gguf.GGUFReader(path, "r+").fields[gguf.Keys.General.NAME]
        field.parts[field.data[0]][:] = np.frombuffer(NAME.encode(), np.uint8)
        return path


models = Phi3Models(CONFIGS, architecture)

if __name__ == "__main__":
    models.main(sys.argv[1:])
