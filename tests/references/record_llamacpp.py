"""Record llama.cpp's logits as the references ``tests/test_llamacpp_agreement.py`` checks leat against.

Run it with a Python that has llama-cpp-python (CPU build) installed, from the repository root::

    /path/to/python-with-llama_cpp tests/references/record_llamacpp.py

for example ``/work/llref/.venv/bin/python tests/references/record_llamacpp.py``. That Python needs only
``llama_cpp``, ``numpy`` and ``gguf`` (``pip install llama-cpp-python gguf``): leat need not be importable there. The tiny model files and the path of the
default model (SmolLM2-135M-Instruct Q4_1, pulled into leat's cache if it is not there yet) come from leat's
own environment, through ``uv run python tests/references/tiny_models.py`` (set ``LEAT_PYTHON`` to another
command, e.g. ``LEAT_PYTHON="/path/to/venv/bin/python"``, if ``uv`` is not how leat is run here), so the
files recorded on are exactly the ones the tests rebuild.

Two references per model, both teacher-forced over the same token ids:

* **default**: llama.cpp as people run it: the file as it is, llama.cpp's defaults (F16 KV cache, its
  quantized matmul kernels, which round activations to 8 bits for quantized weights). This is what the
  design's agreement bars are about.
* **exact**: llama.cpp's exact-arithmetic path: the file converted to all-F32 by llama.cpp itself
  (``llama_model_quantize`` to ``LLAMA_FTYPE_ALL_F32``, which dequantizes each tensor with ggml's own
  routines) and run with an F32 KV cache. Any difference from leat's float64 oracle is then float32
  rounding, so this checks leat's dequantization and model arithmetic against llama.cpp's to within
  ~1e-5, which the default reference's quantization noise cannot.

What it writes, into ``tests/references/`` (about 2.8 MB, all committed):

* ``llamacpp_tiny.npz``: per tiny configuration ``NAME``: ``NAME/tokens`` (the token ids, int32),
  ``NAME/logits`` and ``NAME/exact/logits`` (llama.cpp's full logits at every position, float32 ``[n, 300]``).
* ``llamacpp_smollm2.npz``: per prompt ``pN``: ``pN/tokens`` and llama.cpp's top-64 record per position
  under ``pN/`` (default) and ``pN/exact/``: ``ids``, ``logprobs`` (normalized over the full
  vocabulary), ``gap`` (top-2 logit gap), ``spread`` (max - min logit), as :class:`leat.compare.TopK`
  stores them.
* ``llamacpp.json``: the manifest: llama_cpp version and settings, each tiny configuration (quant type,
  seed, hyperparameters) with its file's SHA-256, the SmolLM2 file's SHA-256, each prompt's messages or
  text, the text llama.cpp rendered from them and how it was tokenized; and, per file, the largest
  difference between llama.cpp's dequantized weights and gguf-py's (which leat's CPU backend uses) and
  how far the default run is from the exact one (``default_vs_exact``: llama.cpp's own noise floor).

Token ids are llama.cpp's own tokenization (chat prompts rendered with llama.cpp's chat-template code,
``llama_chat_apply_template``, then tokenized with special tokens parsed), so the tests do not depend on
leat's tokenizer. llama.cpp runs on the CPU with all logits kept, one batch per sequence, 2 threads.
"""

from __future__ import annotations

import ctypes
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
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
from tiny_models import PROMPT_TEXT

TOP_K = 64
THREADS = 2

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# The SmolLM2 prompts: chat conversations (rendered with the model's chat template) and plain text.
PROMPTS: list[dict] = [
    {
        "kind": "chat",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Why is the sky blue? Answer in two or three sentences."},
            {
                "role": "assistant",
                "content": "The sky looks blue because sunlight is scattered by the molecules of the air, and "
                "blue light, with its shorter wavelength, is scattered much more strongly than red light. "
                "So wherever you look away from the sun, you see this scattered blue light.",
            },
            {"role": "user", "content": "And why are sunsets red, then?"},
        ],
    },
    {
        "kind": "chat",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
            {
                "role": "assistant",
                "content": "Here is an iterative version:\n\n```python\ndef fib(n):\n    a, b = 0, 1\n"
                "    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n\n"
                "It runs in O(n) time and constant memory.",
            },
            {"role": "user", "content": "Can you make it recursive, with memoization?"},
        ],
    },
    {
        "kind": "chat",
        "messages": [
            {"role": "system", "content": "You are a concise assistant. Answer with a short list."},
            {"role": "user", "content": "Give me three tips for learning a new language quickly."},
            {
                "role": "assistant",
                "content": "1. Practise a little every day instead of a lot once a week.\n2. Speak from the "
                "first day, even badly, with a tutor or a friend.\n3. Learn the thousand most common words "
                "first; they cover most of everyday speech.",
            },
            {"role": "user", "content": "What about grammar?"},
        ],
    },
    {
        "kind": "chat",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": "What is the capital of France, and what is it famous for? Also, how many people "
                "live there, roughly? Please keep it brief, but mention at least one museum and one "
                "monument that visitors should not miss.",
            },
        ],
    },
    {
        "kind": "text",
        "text": "Once upon a time, in a small village at the edge of a great forest, there lived an old "
        "clockmaker who had never once left the valley. Every morning he opened the shutters of his shop, "
        "wound the hundred clocks that hung on its walls, and listened to them tick in unison. One winter "
        "night, a stranger knocked at the door with a broken pocket watch",
    },
    {
        "kind": "text",
        "text": 'import numpy as np\n\n\ndef softmax(x, axis=-1):\n    """Numerically stable softmax."""\n'
        "    x = x - x.max(axis=axis, keepdims=True)\n    e = np.exp(x)\n    return e / e.sum(axis=axis, "
        'keepdims=True)\n\n\ndef cross_entropy(logits, targets):\n    """Mean cross-entropy of integer '
        'targets."""\n    log_probs = np.log(softmax(logits))\n    return -log_probs[np.arange(len(targets)), '
        "targets].mean()\n",
    },
]


def leat_python() -> list[str]:
    command = os.environ.get("LEAT_PYTHON")
    return shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]


def build_models(out: Path) -> dict:
    """Build every tiny file into ``out`` with leat's environment; returns tiny_models.py's JSON."""
    command = [*leat_python(), str(HERE / "tiny_models.py"), str(out)]
    print("building tiny models:", shlex.join(command), file=sys.stderr)
    result = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def sha256(path: str | Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load(path: str | Path, n_ctx: int, f32_kv: bool = False):
    import llama_cpp

    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_kv else {}
    return llama_cpp.Llama(
        str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        verbose=False,
        n_threads=THREADS,
        **kv,
    )


def dequantize_to_f32(src: str | Path, dst: str | Path) -> float:
    """Convert ``src`` to an all-F32 file with llama.cpp's own dequantization; returns the largest
    difference between its tensors and gguf-py's dequantization of ``src`` (0.0 when they agree)."""
    import gguf
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.pure = True
    params.quantize_output_tensor = True
    params.output_tensor_type = llama_cpp.GGML_TYPE_F32
    params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.nthread = THREADS
    with suppress_stdout_stderr(disable=False):
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} ({rc})")
    theirs = {t.name: t for t in gguf.GGUFReader(src).tensors}
    worst = 0.0
    for tensor in gguf.GGUFReader(dst).tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise RuntimeError(f"{dst}: {tensor.name} is {tensor.tensor_type.name}, not F32")
        source = theirs[tensor.name]
        ours = gguf.quants.dequantize(np.asarray(source.data), source.tensor_type).reshape(-1)
        worst = max(worst, float(np.max(np.abs(np.asarray(tensor.data, dtype=np.float32).reshape(-1) - ours))))
    return worst


def evaluate(llm, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of ``tokens`` (a fresh sequence), float32 ``[n, vocab]``."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def apply_chat_template(llm, messages: list[dict], add_assistant: bool = True) -> str:
    """The prompt text llama.cpp's own chat-template code renders (the model's template, detected by llama.cpp)."""
    import llama_cpp

    template = llama_cpp.llama_model_chat_template(llm.model, None)
    array = (llama_cpp.llama_chat_message * len(messages))()
    keep = []  # the encoded strings must outlive the ctypes array that points at them
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        array[i].role, array[i].content = role, content
    size = 4096
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(template, array, len(messages), add_assistant, buf, size)
        if n < 0:
            raise RuntimeError("llama.cpp could not apply the chat template")
        if n <= size:
            return buf.raw[:n].decode()
        size = n


def topk_record(logits: np.ndarray, k: int = TOP_K) -> dict[str, np.ndarray]:
    """Top-k ids and log-probs (normalized over the full vocabulary), top-2 gap and spread per position.

    The same record as :meth:`leat.compare.TopK.from_logits` (not imported: leat need not be installed here).
    """
    x = logits.astype(np.float64)
    peak = x.max(axis=-1, keepdims=True)
    lp = x - peak - np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    order = np.lexsort((part, -np.take_along_axis(x, part, axis=-1)), axis=-1)
    ids = np.take_along_axis(part, order, axis=-1)
    two = -np.partition(-x, 1, axis=-1)[:, :2]
    return {
        "ids": ids.astype(np.int32),
        "logprobs": np.take_along_axis(lp, ids, axis=-1).astype(np.float32),
        "gap": (two[:, 0] - two[:, 1]).astype(np.float32),
        "spread": (x.max(axis=-1) - x.min(axis=-1)).astype(np.float32),
    }


def self_difference(default: np.ndarray, exact: np.ndarray) -> dict:
    """How far llama.cpp as people run it is from llama.cpp's own exact path: its noise floor.

    Top-1 flips are counted where the exact run's top-2 gap is at least 1e-3, as leat.compare does.
    """
    x, y = default.astype(np.float64), exact.astype(np.float64)
    two = -np.partition(-y, 1, axis=-1)[:, :2]
    counted = (two[:, 0] - two[:, 1]) >= 1e-3
    flips = np.flatnonzero((x.argmax(axis=-1) != y.argmax(axis=-1)) & counted)
    return {
        "max_abs_logit_diff": float(np.abs(x - y).max()),
        "top1_flips": [int(i) for i in flips],
        "counted": int(counted.sum()),
    }


def record_tiny(built: dict, manifest: dict, tmp: Path) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for name, info in built["tiny"].items():
        llm = load(info["path"], 256)
        text_tokens = llm.tokenize(PROMPT_TEXT.encode(), add_bos=True, special=False)
        tokens = [int(t) for t in text_tokens[: info["tokens"]]]
        if len(tokens) < info["tokens"]:
            raise RuntimeError(f"{name}: the prompt text gives only {len(tokens)} tokens")
        arrays[f"{name}/tokens"] = np.asarray(tokens, dtype=np.int32)
        arrays[f"{name}/logits"] = evaluate(llm, tokens)
        del llm
        f32 = tmp / f"{name}-f32.gguf"
        worst = dequantize_to_f32(info["path"], f32)
        arrays[f"{name}/exact/logits"] = evaluate(load(f32, 256, f32_kv=True), tokens)
        manifest["tiny"][name] = {
            **{k: v for k, v in info.items() if k != "path"},
            "dequantized_f32_sha256": sha256(f32),
            "max_dequantization_difference": worst,
            "default_vs_exact": self_difference(arrays[f"{name}/logits"], arrays[f"{name}/exact/logits"]),
        }
        print(f"{name}: {len(tokens)} tokens; llama.cpp vs gguf-py dequantization differ by {worst:g}", file=sys.stderr)
    return arrays


def record_smollm2(path: str, manifest: dict, tmp: Path) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    llm = load(path, 512)
    f32 = tmp / "smollm2-f32.gguf"
    worst = dequantize_to_f32(path, f32)
    exact = load(f32, 512, f32_kv=True)
    prompts = []
    for i, prompt in enumerate(PROMPTS):
        if prompt["kind"] == "chat":
            text = apply_chat_template(llm, prompt["messages"])
            tokens = llm.tokenize(text.encode(), add_bos=True, special=True)
            how = "llama_chat_apply_template(model template, add_ass=true); tokenize(add_special=true, parse_special=true)"
        else:
            text = prompt["text"]
            tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
            how = "tokenize(add_special=true, parse_special=false)"
        tokens = [int(t) for t in tokens]
        if not 64 <= len(tokens) <= 200:
            raise RuntimeError(f"prompt {i} has {len(tokens)} tokens; keep each within 64-200")
        key = f"p{i}"
        arrays[f"{key}/tokens"] = np.asarray(tokens, dtype=np.int32)
        default_logits, exact_logits = evaluate(llm, tokens), evaluate(exact, tokens)
        arrays |= {f"{key}/{k}": v for k, v in topk_record(default_logits).items()}
        arrays |= {f"{key}/exact/{k}": v for k, v in topk_record(exact_logits).items()}
        prompts.append(
            {
                "key": key,
                **prompt,
                "rendered": text,
                "tokenization": how,
                "tokens": len(tokens),
                "default_vs_exact": self_difference(default_logits, exact_logits),
            }
        )
        print(f"smollm2 {key}: {len(tokens)} tokens", file=sys.stderr)
    manifest["smollm2"] = {
        "file": Path(path).name,
        "sha256": sha256(path),
        "dequantized_f32_sha256": sha256(f32),
        "max_dequantization_difference": worst,
        "top_k": TOP_K,
        "prompts": prompts,
    }
    return arrays


def main() -> None:
    import llama_cpp

    manifest: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "backend": "cpu",
            "n_threads": THREADS,
            "flash_attn": False,
            "n_batch": "n_ctx (one batch per sequence)",
            "default": "the file as it is; llama.cpp's default KV cache (F16)",
            "exact": "the file converted to all-F32 by llama_model_quantize(LLAMA_FTYPE_ALL_F32); F32 KV cache",
        },
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
        "prompt_text": PROMPT_TEXT,
        "tiny": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        built = build_models(Path(tmp))
        manifest["tiny_generator_versions"] = built["generator_versions"]
        tiny = record_tiny(built, manifest, Path(tmp))
        smol = record_smollm2(built["default_model"], manifest, Path(tmp))
    np.savez_compressed(HERE / "llamacpp_tiny.npz", **tiny)
    np.savez_compressed(HERE / "llamacpp_smollm2.npz", **smol)
    (HERE / "llamacpp.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    sizes = {p.name: p.stat().st_size for p in HERE.glob("llamacpp*")}
    print("wrote", sizes, file=sys.stderr)


if __name__ == "__main__":
    main()
