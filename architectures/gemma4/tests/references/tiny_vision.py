"""The tiny Gemma 4 model, ``gemma4v`` mmproj and image llama.cpp's vision references were recorded on, and how to
rebuild them.

Run in leat's environment to write the three files into a folder and print one JSON line (paths, SHA-256s,
the prompt text), which ``scripts/record_llamacpp_vision.py architectures/gemma4/tests/references`` does::

    uv run python architectures/gemma4/tests/references/tiny_vision.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MODEL = {"seed": 31, "params": {}}  # Gemma4.tiny(): E2B's shape, small (sliding window 8: shorter than the image)
MMPROJ = {"seed": 32, "shape": {}}  # leat.testing.write_tiny_mmproj's rope2d defaults: 4-pixel patches pooled 3 x 3
IMAGE = {"seed": 33, "size": (110, 100)}  # height, width: resized to 108 x 96 (letterboxed), 9 x 8 = 72 tokens
MARKER = "<__media__>"  # llama.cpp's mtmd_default_marker, as leat.vision.MARKER
PROMPT = f"the sky is blue because of {MARKER} rayleigh scattering of sunlight in the atmosphere."


def build(out: Path) -> dict[str, Any]:
    import gguf
    import numpy as np
    from leat.testing import encode_png, vision_files, write_tiny_gguf, write_tiny_mmproj
    from leat_arch_gemma4.gemma4 import Gemma4

    params = Gemma4.tiny(**MODEL["params"])
    model = write_tiny_gguf(Gemma4, out / "tiny-gemma4-vision.gguf", seed=MODEL["seed"], params=params)
    mmproj = write_tiny_mmproj(
        out / "tiny-mmproj-gemma4v.gguf",
        params.width,
        gguf.VisionProjectorType.GEMMA4V,
        MMPROJ["seed"],
        "rope2d",
        **MMPROJ["shape"],
    )
    pixels = np.random.default_rng(IMAGE["seed"]).integers(0, 256, (*IMAGE["size"], 3), dtype=np.uint8)
    image = out / "tiny-image.png"
    image.write_bytes(encode_png(pixels))
    return vision_files(PROMPT, model=model, mmproj=mmproj, image=image)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_vision.py OUTDIR")
    print(json.dumps(build(Path(sys.argv[1]))))
