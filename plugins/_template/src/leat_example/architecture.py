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
from leat.hparams import DecoderParams, key, tensor_rows

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclass(frozen=True, kw_only=True)
class ExampleParams(DecoderParams):
    """Each field names its GGUF key: reading a file and writing a test file's metadata follow from this.
    DecoderParams declares layers, context, width, ffn, heads, kv_heads, head_dim and norm_eps as most families
    state them; a field redeclared here (context, for its default) keeps its place."""

    context: int = key(K.LLM.CONTEXT_LENGTH, 2048)
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))


class Example(Architecture):
    names = ("example",)
    Params = ExampleParams

    @classmethod
    def kv_layouts(cls, p: ExampleParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        # each tensor with the shape these hyperparameters give it: tensor_shapes (test files) is recorded from this
        self.embedding = w(name(T.TOKEN_EMBD), (p.vocab, p.width))
        self.output_norm = w(name(T.OUTPUT_NORM), (p.width,))
        self.rope = RopeSpec(p.head_dim, p.rope_base, True, 1.0, None)  # neox-style: halves rotated together
        self.layers = [
            blocks.DecoderLayer(
                attn_norm=w(name(T.ATTN_NORM, i), (p.width,)),
                attn=blocks.load_attention(w, i, p.width, p.heads, p.kv_heads, p.head_dim),
                ffn_norm=w(name(T.FFN_NORM, i), (p.width,)),
                mlp=blocks.load_mlp(w, i, p.width, p.ffn),  # ffn_gate, ffn_up, ffn_down
            )
            for i in range(p.layers)
        ]

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):  # pre-norm attention, then a pre-norm SwiGLU MLP
            x = blocks.decoder_layer(B, x, layer, batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope, p.norm_eps)
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.embedding)

    # -- test models: leat.testing.write_tiny_gguf and the conformance kit use this, with tensor_shapes and
    # write_metadata that Architecture derives from load_weights and ExampleParams ------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> ExampleParams:
        params = ExampleParams(layers=2, width=64, ffn=96, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        return dataclasses.replace(params, **overrides)
