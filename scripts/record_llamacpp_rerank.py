"""Record llama.cpp's rerank prompts and scores on the tiny rerankers: the references tests/test_llamacpp_rerank.py
checks leat's ``/v1/rerank`` against.

Run it with a Python that has llama-cpp-python (CPU build) and numpy installed, from the repository root::

    /path/to/python-with-llama_cpp scripts/record_llamacpp_rerank.py

The files are those of ``tests/references/tiny_rerank.py``, built by leat's environment. Each query-document pair
becomes a prompt as llama-server's ``format_prompt_rerank`` (tools/server/server-common.cpp) builds it, with
llama.cpp's own tokenizer and vocabulary flags: the file's ``rerank`` chat template with ``{query}`` and
``{document}`` replaced, tokenized with special tokens parsed and none added; else BOS (if the vocabulary adds one),
the query, EOS (if it adds one; SEP where it has no EOS), SEP (if it adds one), the document, EOS (if it adds one).
llama.cpp then runs as ``llama-server --reranking`` does on the CPU, with the pooling the file states (rank), each
prompt a fresh sequence; its pooled output is the classifier's ``n_cls_out`` values (for qwen3 a softmax over the
labels), of which llama-server reports the first as ``relevance_score``. Twice: its default F16 KV cache, and an F32
KV cache (``scripts/llamacpp_pooled.py`` says how).

Writes into ``tests/references`` (committed):

* ``llamacpp_rerank.npz``: per configuration ``NAME`` and pair ``I``: ``NAME/I/f16kv`` and ``NAME/I/f32kv``,
  llama.cpp's pooled output (``llama_get_embeddings_seq``, float32: one value per label).
* ``llamacpp_rerank.json``: the manifest: llama_cpp version and settings, and per configuration its quant type,
  seed, SHA-256, the pairs, llama.cpp's prompt token ids for each, and the labels it read from the file.
"""

from __future__ import annotations

from llamacpp_pooled import pooled, record


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


def scores(llm, description: dict) -> tuple[list, dict]:
    """llama.cpp's pooled output for each pair, and the file's manifest entry: its prompts and labels too."""
    import llama_cpp

    model = llm._model.model
    labels = [llama_cpp.llama_model_cls_label(model, i).decode() for i in range(llama_cpp.llama_model_n_cls_out(model))]
    prompts = [[int(t) for t in rerank_prompt(llm, query, document)] for query, document in description["pairs"]]
    entry = {k: v for k, v in description.items() if k not in ("path", "template")}
    entry.update(has_template=description["template"] is not None, labels=labels, prompts=prompts)
    return [pooled(llm, tokens, len(labels)) for tokens in prompts], entry


if __name__ == "__main__":
    settings = {
        "pooling": "as the file states (rank)",
        "prompt": "llama-server's format_prompt_rerank on llama.cpp's tokenizer",
    }
    record("rerank", 1024, settings, scores)
