"""The example architecture: pre-norm blocks, grouped-query attention with RoPE, a SwiGLU MLP, tied output.

It serves GGUF files whose ``general.architecture`` is ``example``; replace it with your family's particulars and
keep the shared building blocks (:mod:`leat.blocks`) for the rest.
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
class ExampleParams:
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    context: int = 2048


class Example(Architecture):
    names = ("example",)

    @classmethod
    def read_params(cls, file: ModelFile) -> ExampleParams:
        return ExampleParams(
            layers=int(file.get(K.LLM.BLOCK_COUNT)),
            width=int(file.get(K.LLM.EMBEDDING_LENGTH)),
            ffn=int(file.get(K.LLM.FEED_FORWARD_LENGTH)),
            heads=int(file.get(K.Attention.HEAD_COUNT)),
            kv_heads=int(file.get(K.Attention.HEAD_COUNT_KV)),
            head_dim=int(file.get(K.Attention.KEY_LENGTH)),
            vocab=file.tensor(name(T.TOKEN_EMBD)).shape[0],
            norm_eps=float(file.get(K.Attention.LAYERNORM_RMS_EPS)),
            rope_base=float(file.get(K.Rope.FREQ_BASE, 10000.0)),
            context=int(file.get(K.LLM.CONTEXT_LENGTH, 2048)),
        )

    @property
    def vocab_size(self) -> int:
        return self.params.vocab

    @classmethod
    def kv_layouts(cls, p: ExampleParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD))
        self.output_norm = w(name(T.OUTPUT_NORM))
        self.rope = RopeSpec(p.head_dim, p.rope_base, True, 1.0, None)  # neox-style: halves rotated together
        self.layers = [
            {
                "attn_norm": w(name(T.ATTN_NORM, i)),
                "attn": blocks.load_attention(w, i),
                "ffn_norm": w(name(T.FFN_NORM, i)),
                "gate": w(name(T.FFN_GATE, i)),
                "up": w(name(T.FFN_UP, i)),
                "down": w(name(T.FFN_DOWN, i)),
            }
            for i in range(p.layers)
        ]

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            h = B.rms_norm(x, layer["attn_norm"], p.norm_eps)
            h = blocks.attention(B, h, layer["attn"], batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope)
            x = B.add(x, h)
            h = B.rms_norm(x, layer["ffn_norm"], p.norm_eps)
            x = B.add(x, blocks.swiglu(B, h, layer["gate"], layer["up"], layer["down"]))
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.embedding)

    # -- test models: leat.testing.write_tiny_gguf and the conformance kit use these ----------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> ExampleParams:
        params = ExampleParams(layers=2, width=64, ffn=96, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        return dataclasses.replace(params, **overrides)

    @classmethod
    def tensor_shapes(cls, p: ExampleParams) -> dict[str, tuple[int, ...]]:
        shapes = {name(T.TOKEN_EMBD): (p.vocab, p.width), name(T.OUTPUT_NORM): (p.width,)}
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
    def write_metadata(cls, writer: gguf.GGUFWriter, p: ExampleParams) -> None:
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
        writer.add_vocab_size(p.vocab)
