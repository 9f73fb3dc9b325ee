"""Record llama.cpp's image embeddings and logits on a tiny model with a tiny mmproj: the references a family's
vision test checks leat against (Gemma 3's ``architectures/gemma/tests/test_vision.py``, the default; Gemma 4's
``architectures/gemma4/tests/test_vision.py``, with that plugin's references folder as the argument).

Run with a Python that has llama-cpp-python (CPU build, with its libmtmd) and numpy, from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_vision.py [REFERENCES_FOLDER]

The files are built by leat's environment (``uv run python REFERENCES_FOLDER/tiny_vision.py``;
set ``LEAT_PYTHON`` to another command if ``uv`` is not how leat runs here). llama.cpp's mtmd tokenizes the prompt
(its image marker becomes the projector's begin text, the image's embeddings and its end text), encodes the image
(``mtmd_encode_chunk``), and the model evaluates the chunks in order: text with every position's logits kept, the
image through ``mtmd_helper_eval_chunk_single`` (which attends bidirectionally within the image where the projector
says: Gemma 3's everywhere, Gemma 4's in the sliding layers).

Writes into the references folder (committed): ``llamacpp_vision.npz`` (``tokens``: the prompt's
ids, -1 at the image's positions; ``embeddings``: the encoder's output [image tokens, width]; ``logits``: float32
logits at every text position, NaN at the image's) and ``llamacpp_vision.json`` (versions, settings, file hashes).
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

REPO = Path(__file__).resolve().parents[1]
REFERENCES = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO / "architectures/gemma/tests/references"
THREADS = 2
N_CTX = 256


def build(out: Path) -> dict:
    command = os.environ.get("LEAT_PYTHON")
    python = shlex.split(command) if command else ["uv", "run", "--project", str(REPO), "python"]
    script = REFERENCES / "tiny_vision.py"
    result = subprocess.run([*python, str(script), str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def record(info: dict) -> dict[str, np.ndarray]:
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    llm = llama_cpp.Llama(
        info["model"], n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, logits_all=True, verbose=False, n_threads=THREADS
    )
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, THREADS, False, False
    params.flash_attn_type = 0  # off: the encoder's attention in float32, not over f16 K and V
    ctx = mtmd.mtmd_init_from_file(info["mmproj"].encode(), llm._model.model, params)
    if not ctx:
        sys.exit("mtmd_init_from_file failed")
    bitmap = mtmd.mtmd_helper_bitmap_init_from_file(ctx, info["image"].encode(), False)
    text = mtmd.mtmd_input_text()
    prompt = info["prompt"].encode()
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), True, True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1) != 0:
        sys.exit("mtmd_tokenize failed")
    width = llama_cpp.llama_model_n_embd(llm._model.model)
    tokens: list[int] = []
    embeddings = None
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ids = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            piece = [ids[j] for j in range(n.value)]
            llm.eval(piece)
            tokens += piece
            continue
        n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
            sys.exit("mtmd_encode_chunk failed")
        embeddings = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(n * width,)).reshape(n, width).copy()
        past = llama_cpp.llama_pos(0)
        start = llama_cpp.llama_pos(llm.n_tokens)
        if mtmd.mtmd_helper_eval_chunk_single(ctx, llm._ctx.ctx, chunk, start, 0, N_CTX, False, ctypes.byref(past)):
            sys.exit("mtmd_helper_eval_chunk_single failed")
        llm.n_tokens = past.value
        tokens += [-1] * n
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    logits[np.asarray(tokens) < 0] = np.nan  # the image's positions were decoded without logits
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    return {"tokens": np.asarray(tokens, np.int32), "embeddings": embeddings, "logits": logits}


def main() -> None:
    import llama_cpp

    with tempfile.TemporaryDirectory() as tmp:
        info = build(Path(tmp))
        arrays = record(info)
    manifest = {
        "llama_cpp_python": llama_cpp.__version__,
        "settings": {"backend": "cpu", "n_threads": THREADS, "kv_cache": "llama.cpp default (F16)", "n_ctx": N_CTX},
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "platform": platform.platform(),
        "sha256": info["sha256"],
        "prompt": info["prompt"],
    }
    np.savez_compressed(REFERENCES / "llamacpp_vision.npz", **arrays)
    (REFERENCES / "llamacpp_vision.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(arrays['tokens'])} positions, image {arrays['embeddings'].shape}", file=sys.stderr)


if __name__ == "__main__":
    main()
