"""Phi-3 (Phi-3 and 3.5 mini/medium, Phi-4, Phi-4-mini): pre-norm blocks, GQA attention with NEOX RoPE, SwiGLU MLP.

Particular to this family, as llama.cpp's src/models/phi3.cpp reads it:

* q, k and v in one fused ``attn_qkv`` [q + 2 kv, d] (separate ``attn_q/k/v`` are accepted too), and gate and up in
  one ``ffn_up`` [2 ffn, d], the gate first (the half ``ggml_swiglu`` activates). llama.cpp takes views of the fused
  products; here the rows are split at load instead, which works for every quant type (each row is whole blocks).
* Partial RoPE (``rope.dimension_count`` below the head size: Phi-4-mini) and LongRoPE for long contexts: per-pair
  frequency factors ``rope_factors_long`` and ``rope_factors_short`` (one tensor each, shared by every layer) and a
  magnitude ``rope.scaling.attn_factor``. llama.cpp takes the long factors when the context it runs with exceeds
  ``rope.scaling.original_context_length``; the context a model runs with is not known when it loads, so leat takes
  them when the context the file states does (llama.cpp's choice at its default, the file's context).
* ``attention.sliding_window``, which the converter writes (0 for Phi-4), is not applied: llama.cpp disables Phi's
  sliding window (its loader's "Phi SWA is currently disabled"), so every layer attends to the whole context.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import gguf
import numpy as np
from leat import blocks
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout
from leat.batch import Batch
from leat.hparams import DecoderParams, derived, has_tensor, key, tensor_rows
from leat.rope import rope_from_metadata

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phi3Params(DecoderParams):
    head_dim: int = derived(lambda file, v: v["width"] // v["heads"])  # llama.cpp: always width / heads
    rope_dims: int = key(K.Rope.DIMENSION_COUNT, missing=lambda v: v["head_dim"])
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    rope_context: int = key(K.Rope.SCALING_ORIG_CTX_LEN, missing=lambda v: v["context"])
    rope_attn_factor: float | None = key(K.Rope.SCALING_ATTN_FACTOR, None)  # LongRoPE's magnitude
    sliding_window: int | None = key(K.Attention.SLIDING_WINDOW, None)  # written by the converter, not applied
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, False)
    fused_qkv: bool = derived(has_tensor(name(T.ATTN_QKV, 0)), True)
    long_rope: bool = derived(has_tensor(name(T.ROPE_FACTORS_LONG)), True)


def split_rows(w: Weights, tensor: str, width: int, sizes: list[int]) -> list[Any]:
    """The consecutive row blocks ``sizes`` of the fused projection ``tensor`` [sum(sizes), width], each uploaded in
    its stored type."""
    starts = list(itertools.accumulate(sizes, initial=0))
    return [w.rows(tensor, (starts[-1], width), np.arange(a, b)) for a, b in itertools.pairwise(starts)]


class Phi3(Architecture):
    names = ("phi3",)
    Params = Phi3Params

    @classmethod
    def kv_layouts(cls, p: Phi3Params) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        factors = None
        if p.long_rope:
            long, short = (w.host(name(t), (p.rope_dims // 2,)) for t in (T.ROPE_FACTORS_LONG, T.ROPE_FACTORS_SHORT))
            factors = long if p.context > p.rope_context else short
        self.rope = rope_from_metadata(self.file, p.rope_dims, neox=True, freq_factors=factors)
        self.layers = [self.load_layer(w, i) for i in range(p.layers)]

    def load_layer(self, w: Weights, i: int) -> blocks.DecoderLayer:
        p = self.params
        q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
        attn_norm = w(name(T.ATTN_NORM, i), (p.width,))
        if p.fused_qkv:
            qkv = split_rows(w, name(T.ATTN_QKV, i), p.width, [q, kv, kv])
            attn = blocks.AttentionWeights(*qkv, o=w(name(T.ATTN_OUT, i), (p.width, q)))
        else:
            attn = blocks.load_attention(w, i, p.width, p.heads, p.kv_heads, p.head_dim)
        ffn_norm = w(name(T.FFN_NORM, i), (p.width,))
        down = w(name(T.FFN_DOWN, i), (p.width, p.ffn))
        gate, up = split_rows(w, name(T.FFN_UP, i), p.width, [p.ffn, p.ffn])
        return blocks.DecoderLayer(attn_norm, attn, ffn_norm, (gate, up, down))

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
    def tiny(cls, **overrides: Any) -> Phi3Params:
        """Phi-3.5-mini's shape, small: LongRoPE over a 256-token context trained from 64 (so the long factors
        apply, with the converter's magnitude sqrt(1 + ln(scale) / ln(original))), partial RoPE on 8 of 16 head
        dimensions, an untied output. ``head_dim`` follows ``width`` and ``heads``."""
        params = Phi3Params(
            layers=2, width=64, ffn=96, heads=4, kv_heads=2, head_dim=16, rope_dims=8, vocab=300, context=256,
            rope_context=64, sliding_window=0,
        )  # fmt: skip
        params = dataclasses.replace(params, **overrides)
        scale = params.context / params.rope_context
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(params.rope_context)) if scale > 1 else 1.0
        return dataclasses.replace(
            params,
            head_dim=params.width // params.heads,
            rope_attn_factor=params.rope_attn_factor or (attn_factor if params.long_rope else None),
        )
