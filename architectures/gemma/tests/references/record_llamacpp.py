"""Record llama.cpp's logits on the Gemma files, the references ``test_llamacpp_agreement.py`` checks leat against.

Run it from the repository root with a Python that has llama-cpp-python (CPU build)::

    /work/llref/.venv/bin/python architectures/gemma/tests/references/record_llamacpp.py

That Python needs only ``llama_cpp`` and ``numpy``. The tiny files and the path of the pulled Gemma 3 270M
come from leat's own environment (``uv run python tiny_gemma.py OUTDIR``; set ``LEAT_PYTHON`` to another
command if ``uv`` is not how leat is run here), so the files recorded on are exactly the ones the tests
rebuild. What it writes, next to this script:

* ``llamacpp_gemma_tiny.npz``: per configuration ``NAME``: ``NAME/tokens`` (int32) and ``NAME/logits``
  (llama.cpp's full logits at every position, float32 ``[n, 300]``).
* ``llamacpp_gemma3_270m.npz``: ``tokens`` (the prompt as llama.cpp tokenizes it, with BOS), llama.cpp's
  top-64 record per position (``ids``, ``logprobs`` normalized over the full vocabulary, ``gap`` top-2 logit
  gap, ``spread`` max - min logit: :class:`leat.compare.TopK`'s arrays), and ``greedy`` / ``greedy_gap``:
  llama.cpp's own 64-token greedy continuation and its top-2 gap at each step.
* ``llamacpp_gemma.json``: llama_cpp version and settings, each tiny configuration with its file's SHA-256,
  the Gemma 3 file's SHA-256 and the prompt.

llama.cpp runs with its defaults (F16 KV cache, no flash attention), on the CPU, all logits kept, each
prompt in one batch.
"""

from __future__ import annotations

import hashlib
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
from tiny_gemma import GEMMA3_PROMPT, PROMPT_TEXT

TOP_K = 64
THREADS = 2
GREEDY = 64


def build_models(out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    result = subprocess.run(
        [*python, str(HERE / "tiny_gemma.py"), str(out)], cwd=REPO, check=True, capture_output=True, text=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load(path: str | Path, n_ctx: int):
    import llama_cpp

    return llama_cpp.Llama(
        str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False, n_threads=THREADS
    )


def evaluate(llm, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def topk_record(logits: np.ndarray, k: int = TOP_K) -> dict[str, np.ndarray]:
    """The arrays of :meth:`leat.compare.TopK.from_logits` (not imported: leat need not be installed here)."""
    x = logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    lp = x - peak - np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    order = np.lexsort((part, -np.take_along_axis(x, part, axis=-1)), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1)
    return {
        "ids": ids.astype(np.int32),
        "logprobs": np.take_along_axis(lp, ids, axis=-1).astype(np.float32),
        "gap": gap(x).astype(np.float32),
        "spread": (x.max(axis=-1) - x.min(axis=-1)).astype(np.float32),
    }


def gap(logits: np.ndarray) -> np.ndarray:
    two = -np.partition(-np.asarray(logits, np.float64), 1, axis=-1)[..., :2]
    return two[..., 0] - two[..., 1]


def record_tiny(built: dict, manifest: dict) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for name, info in built["tiny"].items():
        llm = load(info["path"], 256)
        tokens = [int(t) for t in llm.tokenize(PROMPT_TEXT.encode(), add_bos=True, special=False)[: info["tokens"]]]
        if len(tokens) < info["tokens"]:
            raise RuntimeError(f"{name}: the prompt text gives only {len(tokens)} tokens")
        arrays[f"{name}/tokens"] = np.asarray(tokens, dtype=np.int32)
        arrays[f"{name}/logits"] = evaluate(llm, tokens)
        manifest["tiny"][name] = {k: v for k, v in info.items() if k != "path"}
        print(f"{name}: {len(tokens)} tokens", file=sys.stderr)
        del llm
    return arrays


def record_gemma3(path: str, manifest: dict) -> dict[str, np.ndarray]:
    llm = load(path, 1024)
    tokens = [int(t) for t in llm.tokenize(GEMMA3_PROMPT.encode(), add_bos=True, special=False)]
    if not 560 <= len(tokens) <= 700:
        raise RuntimeError(f"the Gemma 3 prompt has {len(tokens)} tokens; keep it within 560-700")
    logits = evaluate(llm, tokens)
    greedy, gaps = [], []
    last = logits[-1]
    for _ in range(GREEDY):
        token = int(np.argmax(last))
        greedy.append(token)
        gaps.append(float(gap(last)))
        llm.eval([token])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    manifest["gemma3_270m"] = {
        "file": Path(path).name,
        "sha256": sha256(path),
        "top_k": TOP_K,
        "tokens": len(tokens),
        "tokenization": "tokenize(add_special=true, parse_special=false)",
        "prompt": GEMMA3_PROMPT,
        "greedy_text": llm.detokenize(greedy).decode(errors="replace"),
    }
    print(f"gemma3 270m: {len(tokens)} tokens", file=sys.stderr)
    return {
        "tokens": np.asarray(tokens, dtype=np.int32),
        **topk_record(logits),
        "greedy": np.asarray(greedy, dtype=np.int32),
        "greedy_gap": np.asarray(gaps, dtype=np.float32),
    }


def main() -> None:
    import llama_cpp

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
    with tempfile.TemporaryDirectory() as tmp:
        built = build_models(Path(tmp))
        tiny = record_tiny(built, manifest)
        gemma3 = record_gemma3(built["gemma3_270m"], manifest)
    np.savez_compressed(HERE / "llamacpp_gemma_tiny.npz", **tiny)
    np.savez_compressed(HERE / "llamacpp_gemma3_270m.npz", **gemma3)
    (HERE / "llamacpp_gemma.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    print("wrote", {p.name: p.stat().st_size for p in HERE.glob("llamacpp*")}, file=sys.stderr)


if __name__ == "__main__":
    main()
