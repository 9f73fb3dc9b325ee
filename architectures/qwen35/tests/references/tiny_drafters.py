"""The tiny Qwen3.5 files with a multi-token-prediction layer that llama.cpp's draft logits were recorded on
(``scripts/record_llamacpp_drafters.py``; ``../test_mtp.py`` rebuilds them): ``Qwen35.tiny()`` and
``Qwen35Moe.tiny()`` with a fifth layer, the nextn one. Run as a script in leat's environment
(``uv run python tiny_drafters.py OUTDIR``) to write them; it prints one JSON line: per configuration the file, its
SHA-256, the prompt and the draft steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = 21  # tokens
STEPS = 4  # draft steps recorded
MTP = {"layers": 5, "nextn_layers": 1}


def build(folder: str | Path) -> dict[str, Any]:
    from leat.testing import sha256, write_tiny_gguf
    from leat_arch_qwen35.qwen35 import Qwen35, Qwen35Moe

    out = {}
    for seed, family in enumerate((Qwen35, Qwen35Moe)):
        name = f"{family.names[0]}-mtp"
        path = write_tiny_gguf(family, Path(folder) / f"{name}.gguf", seed=seed, params=family.tiny(**MTP))
        tokens = np.random.default_rng(5 + seed).integers(0, 300, PROMPT).tolist()
        out[name] = {"target": str(path), "sha256": {"target": sha256(path)}, "tokens": tokens, "steps": STEPS}
    return out


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))
