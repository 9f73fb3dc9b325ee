"""Record llama.cpp's pooled embeddings on the tiny embedding files: the references tests/test_llamacpp_embeddings.py
checks leat's embeddings against.

Run it with a Python that has llama-cpp-python (CPU build) and numpy installed, from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_embeddings.py

The files are built by leat's own environment (``uv run python tests/references/tiny_embeddings.py OUTDIR``; set
``LEAT_PYTHON`` to another command if ``uv`` is not how leat runs here), so they are exactly the files the test
rebuilds. llama.cpp runs as ``llama-embedding`` would on the CPU: ``embedding=True``, the pooling the file states
(``pooling_type`` left unspecified), its default F16 KV cache, each input a fresh sequence in one batch; and again
with an F32 KV cache (``type_k = type_v = F32``), where the only differences left are float32 rounding.

Writes into ``tests/references`` (committed):

* ``llamacpp_embeddings.npz``: per configuration ``NAME`` and input ``I``: ``NAME/I/f16kv`` and ``NAME/I/f32kv``,
  llama.cpp's pooled embedding (``llama_get_embeddings_seq``, float32, not normalized).
* ``llamacpp_embeddings.json``: the manifest: llama_cpp version and settings, and per configuration its
  architecture, quant type, seed, pooling, the SHA-256 of the file and the token ids of every input.
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
REFERENCES = REPO / "tests" / "references"
THREADS = 2
N_CTX = 256


def build_models(out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    script = REFERENCES / "tiny_embeddings.py"
    result = subprocess.run([*python, str(script), str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def embeddings(path: str, inputs: list[list[int]], f32_kv: bool) -> list[np.ndarray]:
    """llama.cpp's pooled embedding of each input (token ids, each a fresh sequence), float32."""
    import llama_cpp

    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_kv else {}
    llm = llama_cpp.Llama(
        path, embedding=True, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, verbose=False, n_threads=THREADS, **kv
    )
    out = []
    for tokens in inputs:  # as Llama.embed does, on token ids instead of text
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(tokens, 0, True)  # every token an output, as embedding mode wants
        llm._ctx.decode(llm._batch)
        pointer = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        if not pointer:
            raise SystemExit(f"{path}: llama.cpp gave no pooled embedding (does the file state a pooling type?)")
        out.append(np.array(pointer[: llm.n_embd()], dtype=np.float32))
    del llm
    return out


def main() -> None:
    import llama_cpp

    manifest: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "backend": "cpu",
            "n_threads": THREADS,
            "n_ctx": N_CTX,
            "embedding": True,
            "pooling": "as the file states (pooling_type unspecified)",
            "kv_cache": {"f16kv": "llama.cpp default (F16)", "f32kv": "F32"},
        },
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
        "tiny": {},
    }
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, info in build_models(Path(tmp)).items():
            for kind, f32_kv in (("f16kv", False), ("f32kv", True)):
                for i, vector in enumerate(embeddings(info["path"], info["inputs"], f32_kv)):
                    arrays[f"{name}/{i}/{kind}"] = vector
            manifest["tiny"][name] = {k: v for k, v in info.items() if k != "path"}
            print(f"{name}: {len(info['inputs'])} inputs", file=sys.stderr)
    np.savez_compressed(REFERENCES / "llamacpp_embeddings.npz", **arrays)
    (REFERENCES / "llamacpp_embeddings.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
