"""Record llama.cpp's logits on the tiny DeepSeek2 files (the references ``test_llamacpp_agreement.py`` uses).

Run it from the repository root with a Python that has llama-cpp-python (CPU build)::

    /work/llref/.venv/bin/python architectures/deepseek2/tests/references/record_llamacpp.py

It needs only ``llama_cpp`` and ``numpy``; the files are built in leat's environment (``uv run python
tiny_deepseek2.py OUTDIR``, or ``LEAT_PYTHON``), so they are exactly the ones the tests rebuild. It writes
``llamacpp_deepseek2_tiny.npz`` (per configuration ``NAME/tokens`` int32 and ``NAME/logits``, llama.cpp's
full float32 logits at every position) and ``llamacpp_deepseek2.json`` (llama_cpp version, settings, each
configuration with its file's SHA-256). llama.cpp runs with its defaults (F16 KV cache, no flash
attention) on the CPU, each prompt in one batch.
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
sys.path.insert(0, str(HERE))
from tiny_deepseek2 import PROMPT_TEXT

THREADS = 2


def main() -> None:
    import llama_cpp

    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    manifest: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "backend": "cpu",
            "n_threads": THREADS,
            "kv_cache": "llama.cpp default (F16)",
            "flash_attn": False,
        },
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
        "prompt_text": PROMPT_TEXT,
        "tiny": {},
    }
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [*python, str(HERE / "tiny_deepseek2.py"), tmp], cwd=REPO, check=True, capture_output=True, text=True
        )
        built = json.loads(result.stdout.strip().splitlines()[-1])
        for name, info in built["tiny"].items():
            llm = llama_cpp.Llama(
                info["path"], n_ctx=256, n_batch=256, n_ubatch=256, logits_all=True, verbose=False, n_threads=THREADS
            )
            tokens = [int(t) for t in llm.tokenize(PROMPT_TEXT.encode(), add_bos=True, special=False)[: info["tokens"]]]
            llm.eval(tokens)
            arrays[f"{name}/tokens"] = np.asarray(tokens, dtype=np.int32)
            arrays[f"{name}/logits"] = np.array(llm.scores[: len(tokens)], dtype=np.float32)
            manifest["tiny"][name] = {k: v for k, v in info.items() if k != "path"}
            print(f"{name}: {len(tokens)} tokens", file=sys.stderr)
            del llm
    np.savez_compressed(HERE / "llamacpp_deepseek2_tiny.npz", **arrays)
    (HERE / "llamacpp_deepseek2.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
