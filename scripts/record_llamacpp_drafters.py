"""Record llama.cpp's native drafters on a plugin's tiny files: the references its drafter tests check.

``REFERENCES`` is a plugin's ``tests/references`` folder holding a ``tiny_drafters.py`` whose
``python tiny_drafters.py OUTDIR`` writes the files and prints one JSON line: per configuration ``target`` (a file),
``assistant`` (a Gemma 4 assistant's file, or none: the target's own multi-token-prediction layer drafts), the
``sha256`` of each, the prompt's ``tokens`` and the draft ``steps``. Run it with a Python that has llama-cpp-python
(CPU build), from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_drafters.py architectures/gemma4/tests/references
    /path/to/python-with-llama_cpp scripts/record_llamacpp_drafters.py architectures/qwen35/tests/references

The files are built by leat's own environment (through ``uv run``, or ``LEAT_PYTHON``). llama.cpp then runs as its
``draft-mtp`` speculative mode does (common/speculative.cpp), on the CPU with its defaults (F16 KV cache): the target
decodes all but the prompt's last token in one batch with its hidden states kept (``llama_set_embeddings_nextn``),
beside a draft context made first against the target's (``ctx_other``):

* an assistant's context reads the target's KV cache; each draft step decodes one token at the prompt's last
  position with a hidden state (the target's at the position before, then the assistant's own);
* a multi-token-prediction context (``LLAMA_CONTEXT_TYPE_MTP`` on the target model, loaded with its MTP layers) has
  a KV cache of its own, which is filled first with each prompt token but the last paired with the target's state
  at the position before (zeros before the first), as its ``process`` hook does; each draft step then decodes one
  token at the next position with a hidden state (the target's at the position before, then its own).

The draft's next token is the step's top one. Writes into ``REFERENCES`` (committed) ``drafters_llamacpp.npz``:
per configuration ``NAME/tokens``, ``NAME/logits`` [steps, vocab] and ``NAME/hidden`` [steps, width] of each draft
step, and ``NAME/target_hidden`` (the target's state it started from); and ``drafters_llamacpp.json``: the
llama_cpp version, settings and each file's SHA-256.
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
THREADS, N_CTX = 2, 256


def build(references: Path, out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    script = str(references / "tiny_drafters.py")
    result = subprocess.run([*python, script, str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def context(llama_cpp, model, other=None, mtp=False):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = N_CTX, N_CTX, N_CTX
    params.n_threads = params.n_threads_batch = THREADS
    if other is not None:
        params.ctx_other = other
    if mtp:
        params.ctx_type, params.n_rs_seq = llama_cpp.LLAMA_CONTEXT_TYPE_MTP, 0
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


def record(llama_cpp, info: dict) -> dict[str, np.ndarray]:
    from llama_cpp import llama_cpp_ext

    tokens, steps, last = info["tokens"], info["steps"], len(info["tokens"]) - 1
    load = llama_cpp.llama_model_default_params()
    load.load_mtp = "assistant" not in info
    target = llama_cpp.llama_model_load_from_file(info["target"].encode(), load)
    drafter = target if load.load_mtp else llama_cpp.llama_model_load_from_file(info["assistant"].encode(), load)
    if not target or not drafter:
        sys.exit("llama.cpp could not load the files")
    width = llama_cpp.llama_model_n_embd(target)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(target))

    ctx_tgt = context(llama_cpp, target)
    llama_cpp_ext.llama_set_embeddings_nextn(ctx_tgt, True, False)
    # made before the target decodes, as llama.cpp's server does: an assistant's context clears the cache it shares
    ctx_dft = context(llama_cpp, drafter, other=ctx_tgt, mtp=load.load_mtp)
    llama_cpp_ext.llama_set_embeddings_nextn(ctx_dft, True, True)
    decode(llama_cpp, ctx_tgt, [(t, p, None) for p, t in enumerate(tokens[:last])])
    states = [
        np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn_ith(ctx_tgt, p), (width,)).copy()
        for p in range(last)
    ]
    if load.load_mtp:  # the draft context's own KV: x_p paired with the state before it
        pairs = [np.zeros(width, np.float32), *states[:-1]]
        decode(llama_cpp, ctx_dft, [(t, p, h) for p, (t, h) in enumerate(zip(tokens[:last], pairs))])
    token, hidden, logits, hiddens = tokens[-1], states[-1], [], []
    for step in range(steps):
        # an assistant reads every draft token at the same position, a multi-token-prediction layer at the next
        decode(llama_cpp, ctx_dft, [(token, last + (step if load.load_mtp else 0), hidden)])
        logits.append(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx_dft, 0), (vocab,)).copy())
        hidden = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn_ith(ctx_dft, 0), (width,)).copy()
        hiddens.append(hidden)
        token = int(np.argmax(logits[-1]))
    return {
        "tokens": np.asarray(tokens, np.int32),
        "logits": np.asarray(logits, np.float32),
        "hidden": np.asarray(hiddens, np.float32),
        "target_hidden": states[-1].astype(np.float32),
    }


def main() -> None:
    import llama_cpp

    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} PLUGIN/tests/references")
    references = Path(sys.argv[1]).resolve()
    llama_cpp.llama_backend_init()
    arrays, manifest = (
        {},
        {
            "llama_cpp_python": llama_cpp.__version__,
            "settings": {"backend": "cpu", "n_threads": THREADS, "kv_cache": "llama.cpp default (F16)", "n_ctx": N_CTX},
            "drafters": {},
        },
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, info in build(references, Path(tmp)).items():
            for key, value in record(llama_cpp, info).items():
                arrays[f"{name}/{key}"] = value
            manifest["drafters"][name] = {"sha256": info["sha256"], "steps": info["steps"]}
            print(name, [int(np.argmax(x)) for x in arrays[f"{name}/logits"]])
    np.savez(references / "drafters_llamacpp.npz", **arrays)
    (references / "drafters_llamacpp.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
