"""The files of ``../tiny_vision.py`` with the text model 1536 wide, E2B's width: llama.cpp decodes an image
causally in every layer of such a model (``mtmd_decode_use_non_causal``), where other widths see it bidirectionally
in their sliding layers. Recorded with ``scripts/record_llamacpp_vision.py architectures/gemma4/tests/references/e2b_width``.
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
build = base.build

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_vision.py OUTDIR")
    print(json.dumps(build(Path(sys.argv[1]))))
