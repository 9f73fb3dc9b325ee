"""Record llama.cpp's logits on a plugin's tiny files: the references its agreement test checks.

``REFERENCES`` is a plugin's ``tests/references`` folder holding a ``tiny_models.py`` whose
``python tiny_models.py OUTDIR`` writes the files and prints one JSON line describing them. Run it with a
Python that has llama-cpp-python (CPU build) installed, from the repository root, e.g.::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_tiny.py architectures/qwen3/tests/references
    /path/to/python-with-llama_cpp scripts/record_llamacpp_tiny.py architectures/gpt-oss/tests/references

That Python needs only ``llama_cpp`` and ``numpy``. The files are built by leat's own environment, through
``uv run python tiny_models.py OUTDIR`` (set ``LEAT_PYTHON`` to another command if ``uv`` is not how leat
runs here), so they are exactly the files the test rebuilds. llama.cpp runs with its defaults (F16 KV
cache, no flash attention) on the CPU, one batch per prompt, every position's logits kept.

Writes into ``REFERENCES`` (committed):

* ``llamacpp.npz``: per configuration ``NAME``: ``NAME/tokens`` (int32) and ``NAME/logits`` (llama.cpp's
  float32 logits at every position, ``[n, vocab]``); for configurations built with a ``dequantized`` copy
  (the quantized tensors' exact values stored as F32) also ``NAME/logits_dequantized``, llama.cpp on that copy.
* ``llamacpp.json``: the manifest: llama_cpp version and settings, and per configuration its quant type,
  seed, hyperparameters and the SHA-256 of each file recorded on.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
THREADS = 2


def build_models(references: Path, out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    result = subprocess.run(
        [*python, str(references / "tiny_models.py"), str(out)], cwd=REPO, check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def evaluate(path: str, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ``tokens`` (a fresh sequence), float32 ``[n, vocab]``."""
    import llama_cpp

    n_ctx = 256
    llm = llama_cpp.Llama(
        path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False, n_threads=THREADS
    )
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    del llm
    return logits


def main() -> None:
    import llama_cpp

    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} PLUGIN/tests/references")
    references = Path(sys.argv[1]).resolve()

    manifest: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {"backend": "cpu", "n_threads": THREADS, "kv_cache": "llama.cpp default (F16)", "n_ctx": 256},
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
        "tiny": {},
    }
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, info in build_models(references, Path(tmp)).items():
            tokens = [int(t) for t in info.pop("token_ids")]
            arrays[f"{name}/tokens"] = np.asarray(tokens, dtype=np.int32)
            arrays[f"{name}/logits"] = evaluate(info.pop("path"), tokens)
            if "dequantized_path" in info:
                arrays[f"{name}/logits_dequantized"] = evaluate(info.pop("dequantized_path"), tokens)
            manifest["tiny"][name] = info
            print(f"{name}: {len(tokens)} tokens", file=sys.stderr)
    np.savez_compressed(references / "llamacpp.npz", **arrays)
    (references / "llamacpp.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
