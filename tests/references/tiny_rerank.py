"""The tiny random-weight rerankers llama.cpp's rerank scores were recorded on, and how to rebuild them.

Shared by ``scripts/record_llamacpp_rerank.py`` (which records llama.cpp's prompts and scores on them) and
``tests/test_llamacpp_rerank.py`` (which rebuilds each file, checks its SHA-256 against the recording and compares
leat's prompts and scores with the recorded ones). Each file is a tiny qwen3 model of
:func:`leat.testing.write_tiny_gguf` made a reranker as llama.cpp's converter makes Qwen3-Reranker one: pooling type
rank, ``classifier.output_labels`` ["yes", "no"] and a ``cls.output.weight`` head (written by leat's own
:meth:`~leat.architecture.Architecture.load_classifier`, through ``tensor_shapes``). One states the converter's
``tokenizer.chat_template.rerank``; the other none, so llama-server joins query and document itself (and its
tokenizer adds EOS, so that join has every piece a causal model's can have). Deterministic: the same configuration
gives the same bytes.

``llamacpp_pooled.py rerank OUTDIR`` builds every file into a folder (how the recording script gets them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

# The rerank template llama.cpp's converter writes into Qwen3-Reranker files (conversion/qwen.py, llama.cpp b8xxx).
QWEN3_RERANK = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
# name -> quant type, seed, rerank template (None: llama-server's own join), whether the tokenizer adds EOS
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-f32-template": {"qtype": "F32", "seed": 40, "template": QWEN3_RERANK, "add_eos": False},
    "qwen3-f16-plain": {"qtype": "F16", "seed": 41, "template": None, "add_eos": True},
}
QUERIES = ["why is the sky blue", "the capital of france"]
DOCUMENTS = [
    "sunlight is scattered by the molecules of the air, and blue light the most",
    "paris is the capital and largest city of france",
    "a recipe for bread: flour, water, salt and yeast",
]
PAIRS = [[query, document] for query in QUERIES for document in DOCUMENTS]


def build(name: str, path: Path) -> dict[str, Any]:
    """Write configuration ``name`` to ``path``; its description (with the query-document pairs)."""
    from leat.testing import sha256, write_tiny_gguf
    from leat_arch_qwen3.qwen import Qwen3

    config = CONFIGS[name]

    class Reranker(Qwen3):  # the family's own metadata, and what makes the file a reranker
        @classmethod
        def write_metadata(cls, writer: gguf.GGUFWriter, params: Any) -> None:
            Qwen3.write_metadata(writer, params)
            writer.add_uint32(gguf.Keys.LLM.POOLING_TYPE.format(arch="qwen3"), int(gguf.PoolingType.RANK))
            writer.add_array(gguf.Keys.Classifier.OUTPUT_LABELS.format(arch="qwen3"), ["yes", "no"])
            if config["template"] is not None:
                writer.add_string(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name="rerank"), config["template"])
            if config["add_eos"]:
                writer.add_bool(gguf.Keys.Tokenizer.ADD_EOS, True)

    params = Qwen3.tiny(context=1024, vocab=512)
    qtype = gguf.GGMLQuantizationType[config["qtype"]]
    write_tiny_gguf(Reranker, path, qtype=qtype, seed=config["seed"], params=params)
    sha = sha256(path)
    return {**config, "path": str(path), "sha256": sha, "pairs": PAIRS}
