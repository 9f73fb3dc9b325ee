"""Llama (Llama 2/3.x, SmolLM2, Mistral): pre-norm blocks, GQA attention with RoPE, SwiGLU MLP.

Particular to this family: RoPE on adjacent pairs (llama.cpp permutes Llama's q/k weights for it
when converting), Llama 3's per-frequency ``rope_freqs`` factors, and an output matrix that may be
tied to the token embedding (no ``output.weight`` in the file).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
from leat import blocks, hparams
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch
from leat.hparams import DecoderParams, derived, key

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaParams(DecoderParams):
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    rope_dims: int | None = key(K.Rope.DIMENSION_COUNT, None, missing=lambda v: v["head_dim"])
    vocab: int = key(K.LLM.VOCAB_SIZE, read=hparams.tensor_rows(name(T.TOKEN_EMBD)))
    rope_scale: float = derived(lambda file, v: blocks.rope_scale(file), 1.0)
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, True)
    rope_freqs: bool = derived(hparams.has_tensor(name(T.ROPE_FREQS)), False)
    qkv_bias: bool = derived(hparams.has_tensor(name(T.ATTN_Q, 0, "bias")), False)


class Llama(Architecture):
    names = ("llama",)
    Params = LlamaParams

    @classmethod
    def kv_layouts(cls, p: LlamaParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        rope_dims = p.rope_dims or p.head_dim
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        freq_factors = w.host(name(T.ROPE_FREQS), (rope_dims // 2,)) if p.rope_freqs else None
        self.rope = RopeSpec(rope_dims, p.rope_base, False, p.rope_scale, freq_factors)
        self.layers = [
            blocks.DecoderLayer(
                attn_norm=w(name(T.ATTN_NORM, i), (p.width,)),
                attn=blocks.load_attention(w, i, p.width, p.heads, p.kv_heads, p.head_dim, qkv_bias=p.qkv_bias),
                ffn_norm=w(name(T.FFN_NORM, i), (p.width,)),
                mlp=blocks.load_mlp(w, i, p.width, p.ffn),
            )
            for i in range(p.layers)
        ]

    def forward(self, batch: Batch, kv: Any) -> Any:
        return self.backend.matmul(self.hidden(batch, kv), self.output)

    def hidden(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):  # pre-norm attention, then a pre-norm SwiGLU MLP
            x = blocks.decoder_layer(B, x, layer, batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope, p.norm_eps)
        return B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaParams:
        params = LlamaParams(layers=2, width=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        params = dataclasses.replace(params, **overrides)
        return params if params.rope_dims else dataclasses.replace(params, rope_dims=params.head_dim)
