"""The tiny random-weight embedding files llama.cpp's embeddings were recorded on, and how to rebuild them.

Shared by ``scripts/record_llamacpp_embeddings.py`` (which records llama.cpp's pooled embeddings on them) and
``tests/test_llamacpp_embeddings.py`` (which rebuilds each file, checks its SHA-256 against the recording and
compares leat's embeddings with the recorded ones). Each file is a tiny model of :func:`leat.testing.write_tiny_gguf`
that states its ``{arch}.pooling_type``, so llama.cpp and leat pool the same way (llama.cpp gives per-token vectors,
not one, for a file that states none). Deterministic: the same configuration gives the same bytes.

``llamacpp_pooled.py embeddings OUTDIR`` builds every file into a folder (how the recording script gets them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

# name -> architecture, quant type, seed, pooling the file states. Qwen3-Embedding is a qwen3 file with last-token
# pooling; mean and CLS are the other two that give one vector per input.
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-f32-mean": {"arch": "llama", "qtype": "F32", "seed": 30, "pooling": "MEAN"},
    "llama-f32-cls": {"arch": "llama", "qtype": "F32", "seed": 31, "pooling": "CLS"},
    "llama-f16-last": {"arch": "llama", "qtype": "F16", "seed": 32, "pooling": "LAST"},
    "qwen3-f32-last": {"arch": "qwen3", "qtype": "F32", "seed": 33, "pooling": "LAST"},
}
LENGTHS = (1, 5, 17, 64)  # tokens in each input: BOS, then random ids


def architecture(name: str) -> Any:
    if name == "llama":
        from leat_arch_llama.llama import Llama

        return Llama
    from leat_arch_qwen3.qwen import Qwen3

    return Qwen3


def inputs(seed: int, vocab: int, bos: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[bos, *map(int, rng.integers(3, vocab, n - 1))] for n in LENGTHS]


def build(name: str, path: Path) -> dict[str, Any]:
    """Write configuration ``name`` to ``path``; its description (with the token ids of every input)."""
    from leat.testing import sha256, write_tiny_gguf

    config = CONFIGS[name]
    base = architecture(config["arch"])
    pooling = gguf.PoolingType[config["pooling"]]

    class Pooled(base):  # the family's own metadata, and the pooling the file states
        @classmethod
        def write_metadata(cls, writer: gguf.GGUFWriter, params: Any) -> None:
            base.write_metadata(writer, params)
            writer.add_uint32(gguf.Keys.LLM.POOLING_TYPE.format(arch=base.names[0]), int(pooling))

    params = base.tiny(context=256)
    write_tiny_gguf(Pooled, path, qtype=gguf.GGMLQuantizationType[config["qtype"]], seed=config["seed"], params=params)
    sha = sha256(path)
    bos = int(gguf.GGUFReader(path).fields["tokenizer.ggml.bos_token_id"].contents())
    return {**config, "path": str(path), "sha256": sha, "inputs": inputs(config["seed"], params.vocab, bos)}
