"""Record llama.cpp's Gemma 4 assistant drafter on the tiny files: the reference ``test_assistant.py`` checks.

Run with a Python that has llama-cpp-python (CPU build), from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_assistant.py

The files are built by leat's own environment (``architectures/gemma4/tests/references/tiny_assistant.py``, through
``uv run``, or ``LEAT_PYTHON``). llama.cpp then runs as its ``draft-mtp`` speculative mode does with an assistant:
the target decodes all but the prompt's last token in one batch (F16 KV cache, its defaults) with its hidden states
kept (``llama_set_embeddings_nextn``); a context for the assistant is made against the target's
(``ctx_other``: it reads the target's KV cache), and each draft step decodes one token at the prompt's last position
with a hidden state (the target's at the position before, then the assistant's own), its top token feeding the
next step. Writes ``architectures/gemma4/tests/references/assistant_llamacpp.npz``: ``tokens``, the assistant's
``logits`` [steps, vocab] and ``hidden`` [steps, width] per step, and ``target_hidden`` (the state it started from),
and ``assistant_llamacpp.json``: the llama_cpp version, settings and the files' SHA-256.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
REFERENCES = REPO / "architectures/gemma4/tests/references"
THREADS, N_CTX = 2, 256


def build(out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    script = str(REFERENCES / "tiny_assistant.py")
    result = subprocess.run([*python, script, str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def context(llama_cpp, model, other=None):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = N_CTX, N_CTX, N_CTX
    params.n_threads = params.n_threads_batch = THREADS
    if other is not None:
        params.ctx_other = other
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        sys.exit("llama.cpp could not make a context")
    return ctx


def decode(llama_cpp, ctx, rows):
    """One batch of ``rows`` (token, position, hidden state or None), every row's outputs kept."""
    batch = llama_cpp.llama_batch_ext_init(ctx)
    keep = []
    for token, position, hidden in rows:
        index = llama_cpp.llama_batch_ext_add_token(batch, 0, token)
        llama_cpp.llama_batch_ext_set_pos(batch, index, ctypes.byref(llama_cpp.llama_pos(position)))
        if hidden is not None:
            row = np.ascontiguousarray(hidden, dtype=np.float32).reshape(1, -1)
            keep.append(row)
            view = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[1])
            assert llama_cpp.llama_batch_ext_set_embd_token(batch, index, view)  # a token and its state
        llama_cpp.llama_batch_ext_set_output_logits(batch, index, True)
    if llama_cpp.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch) != 0:
        sys.exit("llama_process failed")
    llama_cpp.llama_batch_ext_free(batch)


def main() -> None:
    import llama_cpp
    from llama_cpp import llama_cpp_ext

    llama_cpp.llama_backend_init()
    with tempfile.TemporaryDirectory() as tmp:
        info = build(Path(tmp))
        tokens, steps = info["tokens"], info["steps"]
        load = llama_cpp.llama_model_default_params()
        target = llama_cpp.llama_model_load_from_file(info["target"].encode(), load)
        assistant = llama_cpp.llama_model_load_from_file(info["assistant"].encode(), load)
        if not target or not assistant:
            sys.exit("llama.cpp could not load the files")
        width = llama_cpp.llama_model_n_embd(target)
        vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(assistant))
        ctx_tgt = context(llama_cpp, target)
        llama_cpp_ext.llama_set_embeddings_nextn(ctx_tgt, True, False)
        # made before the target decodes, as llama.cpp's server does: making it clears the cache it shares
        ctx_dft = context(llama_cpp, assistant, other=ctx_tgt)
        llama_cpp_ext.llama_set_embeddings_nextn(ctx_dft, True, True)
        last = len(tokens) - 1
        decode(llama_cpp, ctx_tgt, [(t, p, None) for p, t in enumerate(tokens[:last])])
        state = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn_ith(ctx_tgt, last - 1), (width,)).copy()
        token, hidden, logits, states = tokens[-1], state, [], []
        for _ in range(steps):
            decode(llama_cpp, ctx_dft, [(token, last, hidden)])
            logits.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx_dft, 0), (vocab,)).copy())
            hidden = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn_ith(ctx_dft, 0), (width,)).copy()
            states.append(hidden)
            token = int(np.argmax(logits[-1]))
        np.savez(
            REFERENCES / "assistant_llamacpp.npz",
            tokens=np.asarray(tokens, np.int32),
            logits=np.asarray(logits, np.float32),
            hidden=np.asarray(states, np.float32),
            target_hidden=state.astype(np.float32),
        )
        manifest = {
            "llama_cpp_python": llama_cpp.__version__,
            "settings": {"backend": "cpu", "n_threads": THREADS, "kv_cache": "llama.cpp default (F16)", "n_ctx": N_CTX},
            "sha256": info["sha256"],
            "steps": steps,
        }
        (REFERENCES / "assistant_llamacpp.json").write_text(json.dumps(manifest, indent=1) + "\n")
        print(json.dumps({"steps": steps, "top": [int(np.argmax(x)) for x in logits]}))


if __name__ == "__main__":
    main()
