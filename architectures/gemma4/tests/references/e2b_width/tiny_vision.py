"""The files of ``../tiny_vision.py`` as E2B's would be: the text model 1536 wide, where llama.cpp decodes an image
causally in every layer (``mtmd_decode_use_non_causal``; other widths see it bidirectionally in their sliding layers),
and an mmproj without ``clip.use_gelu`` (llama.cpp's converter does not write it for Gemma 4), so llama.cpp's ViT
uses gelu_quick, x * sigmoid(1.702 x), in its GeGLU. Recorded with
``scripts/record_llamacpp_vision.py architectures/gemma4/tests/references/e2b_width``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "tiny_vision_base", Path(__file__).resolve().parents[1] / "tiny_vision.py"
)
assert spec is not None and spec.loader is not None
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)
base.MODEL = {"seed": 34, "params": {"width": 1536}}
base.MMPROJ = {"seed": 35, "shape": {"gelu": 0}}
build = base.build

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_vision.py OUTDIR")
    print(json.dumps(build(Path(sys.argv[1]))))
