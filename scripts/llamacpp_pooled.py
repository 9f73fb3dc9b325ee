"""What scripts/record_llamacpp_embeddings.py and scripts/record_llamacpp_rerank.py share: llama.cpp's pooled output
of token sequences on tiny files, recorded with its default F16 KV cache and again with an F32 one.

The files are built by leat's own environment (``uv run python tests/references/llamacpp_pooled.py KIND OUTDIR``;
set ``LEAT_PYTHON`` to another command if ``uv`` is not how leat runs here), so they are exactly the files the
tests rebuild. llama.cpp runs on the CPU with ``embedding=True`` and the pooling the file states
(``pooling_type`` left unspecified), each sequence a fresh one in one batch with every token an output, as
``llama-embedding`` and ``llama-server`` run; with ``type_k = type_v = F32`` for the F32 KV cache.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
REFERENCES = REPO / "tests" / "references"
THREADS = 2
KV_CACHES = {"f16kv": False, "f32kv": True}  # name -> whether llama.cpp's KV cache is F32


def build_models(kind: str, out: Path) -> dict:
    """The tiny files of ``tests/references/tiny_KIND.py``, built into ``out``: name -> description (with ``path``)."""
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    script = REFERENCES / "llamacpp_pooled.py"
    args = [*python, str(script), kind, str(out)]
    result = subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def pooled(llm: Any, tokens: list[int], n: int) -> np.ndarray:
    """llama.cpp's pooled output of ``tokens`` (a fresh sequence), its first ``n`` values, float32."""
    import llama_cpp

    llm._ctx.kv_cache_clear()  # as Llama.embed does, on token ids instead of text
    llm._batch.reset()
    llm._batch.add_sequence(tokens, 0, True)  # every token an output, as embedding mode wants
    llm._ctx.decode(llm._batch)
    pointer = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
    if not pointer:
        raise SystemExit(f"{llm.model_path}: llama.cpp gave no pooled output (what pooling type does the file state?)")
    return np.array(pointer[:n], dtype=np.float32)


def record(kind: str, n_ctx: int, settings: dict, run: Callable[[Any, dict], tuple[list[np.ndarray], dict]]) -> None:
    """Write ``tests/references/llamacpp_KIND.npz`` (per file ``NAME`` and sequence ``I``: ``NAME/I/f16kv`` and
    ``NAME/I/f32kv``) and its manifest ``llamacpp_KIND.json`` (llama_cpp's version, ``settings`` and the machine,
    then per file what ``run`` says of it). ``run(llm, description)`` gives a file's pooled outputs, one per
    sequence, and its manifest entry; it runs once per KV cache, and the F32 cache's entry is kept."""
    import llama_cpp

    manifest: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "backend": "cpu",
            "n_threads": THREADS,
            "n_ctx": n_ctx,
            "embedding": True,
            **settings,
            "kv_cache": {"f16kv": "llama.cpp default (F16)", "f32kv": "F32"},
        },
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
        "tiny": {},
    }
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, description in build_models(kind, Path(tmp)).items():
            for cache, f32_kv in KV_CACHES.items():
                kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_kv else {}
                llm = llama_cpp.Llama(
                    description["path"],
                    embedding=True,
                    n_ctx=n_ctx,
                    n_batch=n_ctx,
                    n_ubatch=n_ctx,
                    verbose=False,
                    n_threads=THREADS,
                    **kv,
                )
                outputs, entry = run(llm, description)
                del llm
                arrays.update({f"{name}/{i}/{cache}": values for i, values in enumerate(outputs)})
            manifest["tiny"][name] = entry
            print(f"{name}: {len(outputs)} sequences", file=sys.stderr)
    np.savez_compressed(REFERENCES / f"llamacpp_{kind}.npz", **arrays)
    (REFERENCES / f"llamacpp_{kind}.json").write_text(json.dumps(manifest, indent=1) + "\n")
