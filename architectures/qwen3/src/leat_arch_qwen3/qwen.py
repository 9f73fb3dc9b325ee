"""Qwen (Qwen2/2.5, Qwen3, Qwen3-MoE): pre-norm blocks, GQA attention with NEOX RoPE, SwiGLU or MoE MLP.

Particular to this family: Qwen3's per-head RMSNorm of q and k before RoPE (``attn_q_norm``,
``attn_k_norm``) and a head size set apart from width / heads; Qwen2's q/k/v biases; Qwen3-MoE's
feed-forward, a softmax router over stacked experts whose top-k weights are renormalised to sum to 1
(llama.cpp hard-codes that for qwen3moe, whatever ``expert_weights_norm`` says). RoPE scaling (YaRN for
long contexts) follows the file's ``rope.scaling.*`` keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
from leat import blocks, moe
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout
from leat.batch import Batch
from leat.hparams import REQUIRED, DecoderParams, derived, has_tensor, key, tensor_rows, with_tensor
from leat.rope import rope_from_metadata

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor
EXPERTS = name(T.FFN_GATE_EXP, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QwenParams(DecoderParams):
    ffn: int = key(K.LLM.FEED_FORWARD_LENGTH, 0)  # 0: no dense MLP (Qwen3-MoE)
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-6, missing=REQUIRED)
    rope_base: float = key(K.Rope.FREQ_BASE, 1000000.0, missing=10000.0)
    rope_scaling: str | None = key(K.Rope.SCALING_TYPE, None)  # "yarn" for long contexts
    yarn_factor: float | None = key(K.Rope.SCALING_FACTOR, None)
    yarn_context: int | None = key(K.Rope.SCALING_ORIG_CTX_LEN, None)
    # Qwen3-MoE: every layer's MLP is a mixture of `experts`, `experts_used` per token
    experts: int | None = key(K.LLM.EXPERT_COUNT, None, read=with_tensor(EXPERTS, K.LLM.EXPERT_COUNT))
    experts_used: int | None = key(K.LLM.EXPERT_USED_COUNT, None, read=with_tensor(EXPERTS, K.LLM.EXPERT_USED_COUNT))
    expert_ffn: int | None = key(
        K.LLM.EXPERT_FEED_FORWARD_LENGTH, None, read=with_tensor(EXPERTS, K.LLM.EXPERT_FEED_FORWARD_LENGTH)
    )
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, True)
    output_bias: bool = derived(has_tensor(name(T.OUTPUT, suffix="bias")), False)  # some Qwen2 files
    qk_norm: bool = derived(has_tensor(name(T.ATTN_Q_NORM, 0)), True)  # Qwen3: RMSNorm of each q and k head
    qkv_bias: bool = derived(has_tensor(name(T.ATTN_Q, 0, "bias")), False)  # Qwen2: q, k and v biases


class Qwen3(Architecture):
    names = ("qwen3",)
    Params = QwenParams

    @classmethod
    def kv_layouts(cls, p: QwenParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        self.output_bias = w(name(T.OUTPUT, suffix="bias"), (p.vocab,)) if p.output_bias else None
        self.rope = rope_from_metadata(self.file, p.head_dim, neox=True)
        self.experts = moe.MoESpec(p.experts, p.experts_used, "softmax", normalize=True) if p.experts else None
        self.layers = [self.load_layer(w, i) for i in range(p.layers)]

    def load_layer(self, w: Weights, i: int) -> blocks.DecoderLayer:
        p = self.params
        q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
        attn_norm = w(name(T.ATTN_NORM, i), (p.width,))
        attn = blocks.load_attention(w, i, p.width, p.heads, p.kv_heads, p.head_dim)
        ffn_norm = w(name(T.FFN_NORM, i), (p.width,))
        # after ffn_norm: the tensor order of the test files llama.cpp's references were recorded on
        if p.qkv_bias:
            attn.q_bias, attn.k_bias, attn.v_bias = (
                w(name(t, i, "bias"), (n,)) for t, n in ((T.ATTN_Q, q), (T.ATTN_K, kv), (T.ATTN_V, kv))
            )
        if p.qk_norm:
            attn.q_norm, attn.k_norm = (w(name(t, i), (p.head_dim,)) for t in (T.ATTN_Q_NORM, T.ATTN_K_NORM))
        if p.experts:
            experts = moe.load_moe(w, i, p.width, p.expert_ffn, p.experts, False, False)
            return blocks.DecoderLayer(attn_norm, attn, ffn_norm, experts=experts)
        return blocks.DecoderLayer(attn_norm, attn, ffn_norm, blocks.load_mlp(w, i, p.width, p.ffn))

    def forward(self, batch: Batch, kv: Any) -> Any:
        return self.backend.matmul(self.hidden(batch, kv), self.output, self.output_bias)

    def hidden(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):  # pre-norm attention, then a SwiGLU MLP or MoE
            x = blocks.decoder_layer(
                B, x, layer, batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope, p.norm_eps, self.experts
            )
        return B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> QwenParams:
        # head_dim 16 with width 48 / 4 heads = 12: Qwen3 sets its head size apart from the width
        params = QwenParams(layers=2, width=48, ffn=96, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        params = dataclasses.replace(params, **overrides)
        return dataclasses.replace(params, rope_scaling="yarn") if params.yarn_factor else params


class Qwen3Moe(Qwen3):
    names = ("qwen3moe",)

    @classmethod
    def tiny(cls, **overrides: Any) -> QwenParams:
        return super().tiny(**{"experts": 8, "experts_used": 2, "expert_ffn": 32, **overrides})


class Qwen2(Qwen3):
    names = ("qwen2",)

    @classmethod
    def tiny(cls, **overrides: Any) -> QwenParams:
        # Qwen2's attention output is width x width: head_dim * heads must equal the width
        return super().tiny(**{"width": 64, "qk_norm": False, "qkv_bias": True, **overrides})
