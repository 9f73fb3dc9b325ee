"""The tiny Gemma 4 target and assistant that llama.cpp's drafter logits were recorded on
(``scripts/record_llamacpp_drafters.py``; ``../test_assistant.py`` rebuilds them): the target is ``Gemma4.tiny()``
(E2B's shape: window 8, the last two layers sharing layers 2 and 3's KV), the assistant ``Gemma4Assistant.tiny()``
in Q8_0. Run as a script in leat's environment (``uv run python tiny_drafters.py OUTDIR``) to write them; it prints
one JSON line: per configuration the files, their SHA-256, the prompt and the draft steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = 21  # tokens: the draft is read at position 20, past the window of 8
STEPS = 4  # draft steps recorded


def build(folder: str | Path) -> dict[str, Any]:
    import gguf
    from leat.testing import sha256, write_tiny_gguf
    from leat_arch_gemma4.assistant import Gemma4Assistant
    from leat_arch_gemma4.gemma4 import Gemma4

    folder = Path(folder)
    target = write_tiny_gguf(Gemma4, folder / "gemma4-target.gguf")
    assistant = write_tiny_gguf(
        Gemma4Assistant, folder / "gemma4-assistant.gguf", gguf.GGMLQuantizationType.Q8_0, seed=3
    )
    tokens = np.random.default_rng(4).integers(0, 300, PROMPT).tolist()
    files = {"target": str(target), "assistant": str(assistant)}
    return {
        "gemma4-assistant": {
            **files,
            "sha256": {role: sha256(path) for role, path in files.items()},
            "tokens": tokens,
            "steps": STEPS,
        }
    }


if __name__ == "__main__":
    print(json.dumps(build(sys.argv[1])))
