"""Llama (Llama 2/3.x, SmolLM2, Mistral): pre-norm blocks, GQA attention with RoPE, SwiGLU MLP.

Particular to this family: RoPE on adjacent pairs (llama.cpp permutes Llama's q/k weights for it
when converting), Llama 3's per-frequency ``rope_freqs`` factors, and an output matrix that may be
tied to the token embedding (no ``output.weight`` in the file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gguf
from leat import blocks
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch
from leat.modelfile import ModelFile

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclass(frozen=True)
class LlamaParams:
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_dims: int | None = None
    rope_scale: float = 1.0
    context: int = 4096
    tied: bool = True
    rope_freqs: bool = False


@dataclass
class Layer:
    attn_norm: Any
    attn: blocks.AttentionWeights
    ffn_norm: Any
    gate: Any
    up: Any
    down: Any


class Llama(Architecture):
    names = ("llama",)

    @classmethod
    def read_params(cls, file: ModelFile) -> LlamaParams:
        width = int(file.get(K.LLM.EMBEDDING_LENGTH))
        heads = int(file.get(K.Attention.HEAD_COUNT))
        head_dim = int(file.get(K.Attention.KEY_LENGTH, width // heads))
        return LlamaParams(
            layers=int(file.get(K.LLM.BLOCK_COUNT)),
            width=width,
            ffn=int(file.get(K.LLM.FEED_FORWARD_LENGTH)),
            heads=heads,
            kv_heads=int(file.get(K.Attention.HEAD_COUNT_KV, heads)),
            head_dim=head_dim,
            vocab=file.tensor(name(T.TOKEN_EMBD)).shape[0],
            norm_eps=float(file.get(K.Attention.LAYERNORM_RMS_EPS)),
            rope_base=float(file.get(K.Rope.FREQ_BASE, 10000.0)),
            rope_dims=int(file.get(K.Rope.DIMENSION_COUNT, head_dim)),
            rope_scale=blocks.rope_scale(file),
            context=int(file.get(K.LLM.CONTEXT_LENGTH, 4096)),
            tied=name(T.OUTPUT) not in file.tensors,
            rope_freqs=name(T.ROPE_FREQS) in file.tensors,
        )

    @property
    def vocab_size(self) -> int:
        return self.params.vocab

    @classmethod
    def kv_layouts(cls, p: LlamaParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD))
        self.output_norm = w(name(T.OUTPUT_NORM))
        self.output = self.embedding if p.tied else w(name(T.OUTPUT))
        freq_factors = w.host(name(T.ROPE_FREQS)) if p.rope_freqs else None
        self.rope = RopeSpec(p.rope_dims or p.head_dim, p.rope_base, False, p.rope_scale, freq_factors)
        self.layers = [
            Layer(
                attn_norm=w(name(T.ATTN_NORM, i)),
                attn=blocks.load_attention(w, i),
                ffn_norm=w(name(T.FFN_NORM, i)),
                gate=w(name(T.FFN_GATE, i)),
                up=w(name(T.FFN_UP, i)),
                down=w(name(T.FFN_DOWN, i)),
            )
            for i in range(p.layers)
        ]

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            h = B.rms_norm(x, layer.attn_norm, p.norm_eps)
            h = blocks.attention(B, h, layer.attn, batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope)
            x = B.add(x, h)
            h = B.rms_norm(x, layer.ffn_norm, p.norm_eps)
            x = B.add(x, blocks.swiglu(B, h, layer.gate, layer.up, layer.down))
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.output)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaParams:
        params = LlamaParams(layers=2, width=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        return dataclasses.replace(params, **overrides)

    @classmethod
    def tensor_shapes(cls, p: LlamaParams) -> dict[str, tuple[int, ...]]:
        shapes = {name(T.TOKEN_EMBD): (p.vocab, p.width), name(T.OUTPUT_NORM): (p.width,)}
        if not p.tied:
            shapes[name(T.OUTPUT)] = (p.vocab, p.width)
        if p.rope_freqs:
            shapes[name(T.ROPE_FREQS)] = ((p.rope_dims or p.head_dim) // 2,)
        for i in range(p.layers):
            shapes |= {
                name(T.ATTN_NORM, i): (p.width,),
                name(T.ATTN_Q, i): (p.heads * p.head_dim, p.width),
                name(T.ATTN_K, i): (p.kv_heads * p.head_dim, p.width),
                name(T.ATTN_V, i): (p.kv_heads * p.head_dim, p.width),
                name(T.ATTN_OUT, i): (p.width, p.heads * p.head_dim),
                name(T.FFN_NORM, i): (p.width,),
                name(T.FFN_GATE, i): (p.ffn, p.width),
                name(T.FFN_UP, i): (p.ffn, p.width),
                name(T.FFN_DOWN, i): (p.width, p.ffn),
            }
        return shapes

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, p: LlamaParams) -> None:
        writer.add_block_count(p.layers)
        writer.add_context_length(p.context)
        writer.add_embedding_length(p.width)
        writer.add_feed_forward_length(p.ffn)
        writer.add_head_count(p.heads)
        writer.add_head_count_kv(p.kv_heads)
        writer.add_key_length(p.head_dim)
        writer.add_value_length(p.head_dim)
        writer.add_layer_norm_rms_eps(p.norm_eps)
        writer.add_rope_freq_base(p.rope_base)
        writer.add_rope_dimension_count(p.rope_dims or p.head_dim)
        writer.add_vocab_size(p.vocab)
