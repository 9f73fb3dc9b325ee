"""Hyperparameters declared once: reading and writing follow each field's declaration, and an architecture's test
files take their tensors from what its load_weights asks for."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import pytest
from leat.architecture import Architecture
from leat.errors import ModelFileError
from leat.hparams import REQUIRED, derived, has_tensor, key, tensor_rows, with_tensor
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf

K = gguf.Keys


@dataclass(frozen=True, kw_only=True)
class ToyParams:
    layers: int = key(K.LLM.BLOCK_COUNT)
    width: int = key(K.LLM.EMBEDDING_LENGTH)
    heads: int = key(K.Attention.HEAD_COUNT, missing=lambda v: v["width"] // 8)
    head_dim: int = key(
        K.Attention.KEY_LENGTH, missing=lambda v: v["width"] // v["heads"], also=(K.Attention.VALUE_LENGTH,)
    )
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-5, missing=REQUIRED)
    window: int | None = key(K.Attention.SLIDING_WINDOW, None)
    pattern: tuple[bool, ...] | None = key(K.Attention.SLIDING_WINDOW_PATTERN, None)
    experts: int | None = key(
        K.LLM.EXPERT_COUNT, None, read=with_tensor("blk.0.ffn_gate_exps.weight", K.LLM.EXPERT_COUNT)
    )
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows("token_embd.weight"))
    biased: bool = derived(has_tensor("blk.0.bias.weight"), False)


class Toy(Architecture):
    names = ("toy",)
    Params = ToyParams

    def load_weights(self, w):
        p = self.params
        self.embedding = w("token_embd.weight", (p.vocab, p.width))
        self.layers = [w(f"blk.{i}.attn_q.weight", (p.heads * p.head_dim, p.width)) for i in range(p.layers)]
        self.bias = w("blk.0.bias.weight", (p.width,)) if p.biased else None

    @classmethod
    def kv_layouts(cls, p):
        return []

    @classmethod
    def tiny(cls, **overrides):
        return ToyParams(
            **{"layers": 2, "width": 16, "heads": 2, "head_dim": 8, "vocab": 300, "norm_eps": 0.25} | overrides
        )


def metadata(path) -> dict:
    return {k: v for k, v in ModelFile(path).metadata.items() if k.startswith("toy.")}


def test_tensor_shapes_are_what_load_weights_asks_for():
    assert Toy.tensor_shapes(Toy.tiny(layers=3, biased=True)) == {
        "token_embd.weight": (300, 16),
        "blk.0.attn_q.weight": (16, 16),
        "blk.1.attn_q.weight": (16, 16),
        "blk.2.attn_q.weight": (16, 16),
        "blk.0.bias.weight": (16,),
    }


@pytest.mark.parametrize("overrides", [{}, {"window": 4, "pattern": (True, False)}, {"biased": True}])
def test_written_files_read_back_as_declared(tmp_path, overrides):
    params = Toy.tiny(**overrides)
    path = write_tiny_gguf(Toy, tmp_path / "toy.gguf", params=params)
    assert Toy.read_params(ModelFile(path)) == params
    assert metadata(path) == {
        "toy.block_count": 2,
        "toy.embedding_length": 16,
        "toy.attention.head_count": 2,
        "toy.attention.key_length": 8,
        "toy.attention.value_length": 8,
        "toy.attention.layer_norm_rms_epsilon": 0.25,
        "toy.vocab_size": 300,
    } | (
        {"toy.attention.sliding_window": 4, "toy.attention.sliding_window_pattern": [True, False]}
        if "window" in overrides
        else {}
    )


def test_missing_keys_take_their_fallbacks_or_are_named(tmp_path):
    path = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(path, "toy")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tensor("token_embd.weight", np.zeros((7, 32), np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="missing metadata key toy.expert_count"):
        Toy.read_params(ModelFile(path))  # experts are required once their tensors are there
    file = ModelFile(path)
    file.metadata["toy.expert_count"] = 2
    p = Toy.read_params(file)
    assert (p.heads, p.head_dim, p.vocab, p.window, p.experts, p.biased) == (4, 8, 7, None, 2, False)
    del file.metadata["toy.attention.layer_norm_rms_epsilon"]
    with pytest.raises(ModelFileError, match="missing metadata key toy.attention.layer_norm_rms_epsilon"):
        Toy.read_params(file)
