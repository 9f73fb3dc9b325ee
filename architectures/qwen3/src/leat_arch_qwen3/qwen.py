"""Qwen (Qwen2/2.5, Qwen3, Qwen3-MoE): pre-norm blocks, GQA attention with NEOX RoPE, SwiGLU or MoE MLP.

Particular to this family: Qwen3's per-head RMSNorm of q and k before RoPE (``attn_q_norm``,
``attn_k_norm``) and a head size set apart from width / heads; Qwen2's q/k/v biases; Qwen3-MoE's
feed-forward, a softmax router over stacked experts whose top-k weights are renormalised to sum to 1
(llama.cpp hard-codes that for qwen3moe, whatever ``expert_weights_norm`` says). RoPE scaling (YaRN for
long contexts) follows the file's ``rope.scaling.*`` keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gguf
from leat import blocks, moe
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout
from leat.batch import Batch
from leat.modelfile import ModelFile
from leat.rope import rope_from_metadata

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclass(frozen=True)
class QwenParams:
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    norm_eps: float = 1e-6
    rope_base: float = 1000000.0
    context: int = 4096
    tied: bool = True
    qk_norm: bool = True  # Qwen3: RMSNorm of each q and k head
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    experts: int = 0  # Qwen3-MoE: every layer's MLP is a mixture of `experts`, `experts_used` per token
    experts_used: int = 0
    expert_ffn: int = 0
    yarn_factor: float = 0.0  # rope.scaling.type yarn with this factor over yarn_context positions
    yarn_context: int = 0


@dataclass
class Layer:
    attn_norm: Any
    attn: blocks.AttentionWeights
    ffn_norm: Any
    mlp: tuple[Any, Any, Any] | moe.MoEWeights  # (gate, up, down) or the experts


class Qwen3(Architecture):
    names = ("qwen3",)

    @classmethod
    def read_params(cls, file: ModelFile) -> QwenParams:
        width = int(file.get(K.LLM.EMBEDDING_LENGTH))
        heads = int(file.get(K.Attention.HEAD_COUNT))
        moe_layer = name(T.FFN_GATE_EXP, 0) in file.tensors
        yarn = file.get(K.Rope.SCALING_TYPE, "none") == "yarn"
        return QwenParams(
            layers=int(file.get(K.LLM.BLOCK_COUNT)),
            width=width,
            ffn=int(file.get(K.LLM.FEED_FORWARD_LENGTH, 0)),
            heads=heads,
            kv_heads=int(file.get(K.Attention.HEAD_COUNT_KV, heads)),
            head_dim=int(file.get(K.Attention.KEY_LENGTH, width // heads)),
            vocab=file.tensor(name(T.TOKEN_EMBD)).shape[0],
            norm_eps=float(file.get(K.Attention.LAYERNORM_RMS_EPS)),
            rope_base=float(file.get(K.Rope.FREQ_BASE, 10000.0)),
            context=int(file.get(K.LLM.CONTEXT_LENGTH, 4096)),
            tied=name(T.OUTPUT) not in file.tensors,
            qk_norm=name(T.ATTN_Q_NORM, 0) in file.tensors,
            qkv_bias=name(T.ATTN_Q, 0, "bias") in file.tensors,
            experts=int(file.get(K.LLM.EXPERT_COUNT)) if moe_layer else 0,
            experts_used=int(file.get(K.LLM.EXPERT_USED_COUNT)) if moe_layer else 0,
            expert_ffn=file.tensor(name(T.FFN_GATE_EXP, 0)).shape[1] if moe_layer else 0,
            yarn_factor=float(file.get(K.Rope.SCALING_FACTOR)) if yarn else 0.0,
            yarn_context=int(file.get(K.Rope.SCALING_ORIG_CTX_LEN, 0)) if yarn else 0,
        )

    @property
    def vocab_size(self) -> int:
        return self.params.vocab

    @classmethod
    def kv_layouts(cls, p: QwenParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.layers

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD))
        self.output_norm = w(name(T.OUTPUT_NORM))
        self.output = self.embedding if p.tied else w(name(T.OUTPUT))
        self.output_bias = w(name(T.OUTPUT, suffix="bias"), optional=True)  # some Qwen2 files
        self.rope = rope_from_metadata(self.file, p.head_dim, neox=True)
        self.experts = moe.MoESpec(p.experts, p.experts_used, "softmax", normalize=True) if p.experts else None
        self.layers = [
            Layer(
                attn_norm=w(name(T.ATTN_NORM, i)),
                attn=blocks.load_attention(w, i),
                ffn_norm=w(name(T.FFN_NORM, i)),
                mlp=self.load_mlp(w, i),
            )
            for i in range(p.layers)
        ]

    def load_mlp(self, w: Weights, i: int) -> tuple[Any, Any, Any] | moe.MoEWeights:
        if self.params.experts:
            return moe.load_moe(w, i)
        return w(name(T.FFN_GATE, i)), w(name(T.FFN_UP, i)), w(name(T.FFN_DOWN, i))

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            h = B.rms_norm(x, layer.attn_norm, p.norm_eps)
            h = blocks.attention(
                B, h, layer.attn, batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope, norm_eps=p.norm_eps
            )
            x = B.add(x, h)
            h = B.rms_norm(x, layer.ffn_norm, p.norm_eps)
            h = B.moe(h, layer.mlp, self.experts) if self.experts else blocks.swiglu(B, h, *layer.mlp)
            x = B.add(x, h)
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.output, self.output_bias)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> QwenParams:
        # head_dim 16 with width 48 / 4 heads = 12: Qwen3 sets its head size apart from the width
        params = QwenParams(layers=2, width=48, ffn=96, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        return dataclasses.replace(params, **overrides)

    @classmethod
    def tensor_shapes(cls, p: QwenParams) -> dict[str, tuple[int, ...]]:
        shapes = {name(T.TOKEN_EMBD): (p.vocab, p.width), name(T.OUTPUT_NORM): (p.width,)}
        if not p.tied:
            shapes[name(T.OUTPUT)] = (p.vocab, p.width)
        q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
        for i in range(p.layers):
            shapes |= {
                name(T.ATTN_NORM, i): (p.width,),
                name(T.ATTN_Q, i): (q, p.width),
                name(T.ATTN_K, i): (kv, p.width),
                name(T.ATTN_V, i): (kv, p.width),
                name(T.ATTN_OUT, i): (p.width, q),
                name(T.FFN_NORM, i): (p.width,),
            }
            if p.qkv_bias:
                shapes |= {name(T.ATTN_Q, i, "bias"): (q,), name(T.ATTN_K, i, "bias"): (kv,)}
                shapes |= {name(T.ATTN_V, i, "bias"): (kv,)}
            if p.qk_norm:
                shapes |= {name(T.ATTN_Q_NORM, i): (p.head_dim,), name(T.ATTN_K_NORM, i): (p.head_dim,)}
            if p.experts:
                shapes |= moe.moe_shapes(i, p.width, p.expert_ffn, p.experts)
            else:
                shapes |= {name(T.FFN_GATE, i): (p.ffn, p.width), name(T.FFN_UP, i): (p.ffn, p.width)}
                shapes |= {name(T.FFN_DOWN, i): (p.width, p.ffn)}
        return shapes

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, p: QwenParams) -> None:
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
        if p.yarn_factor:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(p.yarn_factor)
            writer.add_rope_scaling_orig_ctx_len(p.yarn_context)
        if p.experts:
            writer.add_expert_count(p.experts)
            writer.add_expert_used_count(p.experts_used)
            writer.add_expert_feed_forward_length(p.expert_ffn)
        writer.add_vocab_size(p.vocab)


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
