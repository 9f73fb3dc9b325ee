"""Record llama.cpp's pooled embeddings on the tiny embedding files: the references tests/test_llamacpp_embeddings.py
checks leat's embeddings against.

Run it with a Python that has llama-cpp-python (CPU build) and numpy installed, from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_embeddings.py

The files are those of ``tests/references/tiny_embeddings.py``, built by leat's environment; llama.cpp runs as
``llama-embedding`` would on the CPU, with its default F16 KV cache and again with an F32 one, where the only
differences left are float32 rounding (``scripts/llamacpp_pooled.py`` says how).

Writes into ``tests/references`` (committed):

* ``llamacpp_embeddings.npz``: per configuration ``NAME`` and input ``I``: ``NAME/I/f16kv`` and ``NAME/I/f32kv``,
  llama.cpp's pooled embedding (``llama_get_embeddings_seq``, float32, not normalized).
* ``llamacpp_embeddings.json``: the manifest: llama_cpp version and settings, and per configuration its
  architecture, quant type, seed, pooling, the SHA-256 of the file and the token ids of every input.
"""

from __future__ import annotations

from llamacpp_pooled import pooled, record


def embeddings(llm, description: dict) -> tuple[list, dict]:
    """llama.cpp's pooled embedding of each input (token ids), and the file's manifest entry."""
    vectors = [pooled(llm, tokens, llm.n_embd()) for tokens in description["inputs"]]
    return vectors, {k: v for k, v in description.items() if k != "path"}


if __name__ == "__main__":
    record("embeddings", 256, {"pooling": "as the file states (pooling_type unspecified)"}, embeddings)
