"""The tiny Gemma 3 model, mmproj and image llama.cpp's vision references were recorded on, and how to rebuild them.

Run in leat's environment to write the three files into a folder and print one JSON line (paths, SHA-256s,
the prompt text), which ``scripts/record_llamacpp_vision.py`` does::

    uv run python architectures/gemma/tests/references/tiny_vision.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MODEL = {"seed": 21, "params": {"window": 8, "pattern": 2}}  # a sliding window shorter than the image's span
MMPROJ = {"seed": 22}  # leat.testing.write_tiny_mmproj's defaults: 32-pixel images, 16 image tokens
IMAGE_SEED = 23
MARKER = "<__media__>"  # llama.cpp's mtmd_default_marker, as leat.vision.MARKER
PROMPT = f"the sky is blue because of {MARKER} rayleigh scattering of sunlight in the atmosphere."


def build(out: Path) -> dict[str, Any]:
    import gguf
    import numpy as np
    from leat.testing import encode_png, vision_files, write_tiny_gguf, write_tiny_mmproj
    from leat_arch_gemma.gemma import Gemma3

    params = Gemma3.tiny(**MODEL["params"])
    model = write_tiny_gguf(Gemma3, out / "tiny-gemma3-vision.gguf", seed=MODEL["seed"], params=params)
    mmproj = write_tiny_mmproj(
        out / "tiny-mmproj.gguf", params.width, gguf.VisionProjectorType.GEMMA3, seed=MMPROJ["seed"]
    )
    pixels = np.random.default_rng(IMAGE_SEED).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = out / "tiny-image.png"
    image.write_bytes(encode_png(pixels))
    return vision_files(PROMPT, model=model, mmproj=mmproj, image=image)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_vision.py OUTDIR")
    print(json.dumps(build(Path(sys.argv[1]))))
