"""Record llama.cpp's rerank prompts and scores on the tiny rerankers: the references tests/test_llamacpp_rerank.py
checks leat's ``/v1/rerank`` against.

Run it with a Python that has llama-cpp-python (CPU build) and numpy installed, from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_rerank.py

The files are built by leat's own environment (``uv run python tests/references/tiny_rerank.py OUTDIR``; set
``LEAT_PYTHON`` to another command if ``uv`` is not how leat runs here), so they are exactly the files the test
rebuilds. Each query-document pair becomes a prompt as llama-server's ``format_prompt_rerank``
(tools/server/server-common.cpp) builds it, with llama.cpp's own tokenizer and vocabulary flags: the file's
``rerank`` chat template with ``{query}`` and ``{document}`` replaced, tokenized with special tokens parsed and none
added; else BOS (if the vocabulary adds one), the query, EOS (if it adds one; SEP where it has no EOS), SEP (if it
adds one), the document, EOS (if it adds one). llama.cpp then runs as ``llama-server --reranking`` does on the CPU:
``embedding=True``, the pooling the file states (rank), each prompt a fresh sequence; its pooled output is the
classifier's ``n_cls_out`` values (for qwen3 a softmax over the labels), of which llama-server reports the first as
``relevance_score``. Twice: its default F16 KV cache, and an F32 KV cache (``type_k = type_v = F32``).

Writes into ``tests/references`` (committed):

* ``llamacpp_rerank.npz``: per configuration ``NAME`` and pair ``I``: ``NAME/I/f16kv`` and ``NAME/I/f32kv``,
  llama.cpp's pooled output (``llama_get_embeddings_seq``, float32: one value per label).
* ``llamacpp_rerank.json``: the manifest: llama_cpp version and settings, and per configuration its quant type,
  seed, SHA-256, the pairs, llama.cpp's prompt token ids for each, and the labels it read from the file.
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
N_CTX = 1024


def build_models(out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    script = REFERENCES / "tiny_rerank.py"
    result = subprocess.run([*python, str(script), str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def rerank_prompt(llm, query: str, document: str) -> list[int]:
    """llama-server's format_prompt_rerank, on llama.cpp's tokenizer."""
    import llama_cpp

    model, vocab = llm._model.model, llm._model.vocab
    template = llama_cpp.llama_model_chat_template(model, b"rerank")
    if template is not None:
        text = template.decode().replace("{query}", query).replace("{document}", document)
        return llm.tokenize(text.encode(), add_bos=False, special=True)
    words = [llm.tokenize(text.encode(), add_bos=False, special=False) for text in (query, document)]
    eos = llama_cpp.llama_vocab_eos(vocab)
    if eos == llama_cpp.LLAMA_TOKEN_NULL:
        eos = llama_cpp.llama_vocab_sep(vocab)
    out = [llama_cpp.llama_vocab_bos(vocab)] if llama_cpp.llama_vocab_get_add_bos(vocab) else []
    out += words[0]
    out += [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
    out += [llama_cpp.llama_vocab_sep(vocab)] if llama_cpp.llama_vocab_get_add_sep(vocab) else []
    out += words[1]
    out += [eos] if llama_cpp.llama_vocab_get_add_eos(vocab) else []
    return out


def scores(path: str, pairs: list[list[str]], f32_kv: bool) -> tuple[list[list[int]], list[np.ndarray], list[str]]:
    """llama.cpp's prompt and pooled output for each pair (each a fresh sequence), and the file's labels."""
    import llama_cpp

    kv = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if f32_kv else {}
    llm = llama_cpp.Llama(
        path, embedding=True, n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, verbose=False, n_threads=THREADS, **kv
    )
    model = llm._model.model
    n_out = llama_cpp.llama_model_n_cls_out(model)
    labels = [llama_cpp.llama_model_cls_label(model, i).decode() for i in range(n_out)]
    prompts, out = [], []
    for query, document in pairs:
        tokens = rerank_prompt(llm, query, document)
        llm._ctx.kv_cache_clear()
        llm._batch.reset()
        llm._batch.add_sequence(tokens, 0, True)
        llm._ctx.decode(llm._batch)
        pointer = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        if not pointer:
            raise SystemExit(f"{path}: llama.cpp gave no pooled output (is the file's pooling type rank?)")
        prompts.append([int(t) for t in tokens])
        out.append(np.array(pointer[:n_out], dtype=np.float32))
    del llm
    return prompts, out, labels


def main() -> None:
    import llama_cpp

    manifest: dict = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {
            "backend": "cpu",
            "n_threads": THREADS,
            "n_ctx": N_CTX,
            "embedding": True,
            "pooling": "as the file states (rank)",
            "prompt": "llama-server's format_prompt_rerank on llama.cpp's tokenizer",
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
                prompts, outputs, labels = scores(info["path"], info["pairs"], f32_kv)
                for i, values in enumerate(outputs):
                    arrays[f"{name}/{i}/{kind}"] = values
            manifest["tiny"][name] = {k: v for k, v in info.items() if k not in ("path", "template")}
            manifest["tiny"][name].update(has_template=info["template"] is not None, labels=labels, prompts=prompts)
            print(f"{name}: {len(info['pairs'])} pairs, labels {labels}", file=sys.stderr)
    np.savez_compressed(REFERENCES / "llamacpp_rerank.npz", **arrays)
    (REFERENCES / "llamacpp_rerank.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
