"""DeepSeek V2 / V3 (``deepseek2``): multi-head latent attention, leading dense layers, then MoE with shared experts.

As llama.cpp's src/models/deepseek2.cpp computes it:

* Attention is MLA (:mod:`leat.mla`), always in the absorbed form, so the KV cache holds one latent and
  one rope key per token and layer. RoPE on the rope dims is llama.cpp's NORM kind (adjacent pairs).
* Scores are scaled by ``mscale^2 / sqrt(nope + rope)``. With YaRN (``rope.scaling.type`` yarn),
  ``mscale = 1 + 0.1 * mscale_all_dim * ln(factor)``, where the file stores 0.1 * mscale_all_dim as
  ``rope.scaling.yarn_log_multiplier``; the rotation's own magnitude then nets to 1 (llama.cpp's
  [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]). The arithmetic below follows llama.cpp's step by step.
* The first ``leading_dense_block_count`` layers have a SwiGLU MLP; the others route each token to
  ``expert_used_count`` experts (softmax or sigmoid gating, ``exp_probs_b`` selection bias, group-limited
  routing, optional normalization and scaling of the weights: :mod:`leat.moe`) and add shared experts,
  a SwiGLU MLP ``expert_shared_count`` experts wide.
* Without ``attention.q_lora_rank`` (or with 0), queries come from ``attn_q`` (DeepSeek-V2-Lite).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import gguf
from leat import blocks, mla
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat.moe import MoESpec, MoEWeights, load_moe, moe_shapes
from leat.rope import ggml_rope

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor
GATING = {int(gguf.ExpertGatingFuncType.SOFTMAX): "softmax", int(gguf.ExpertGatingFuncType.SIGMOID): "sigmoid"}


@dataclass(frozen=True)
class DeepSeek2Params:
    layers: int
    width: int
    vocab: int
    heads: int
    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v: int
    ffn: int  # leading dense layers
    expert_ffn: int
    experts: int
    experts_used: int
    shared_experts: int
    dense_layers: int = 1
    gating: str = "softmax"
    groups: int = 0
    groups_used: int = 0
    weights_norm: bool = False
    weights_scale: float = 0.0  # 0: none
    selection_bias: bool = False  # exp_probs_b
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_scaling: str = "none"  # "none", "linear" or "yarn"
    rope_factor: float = 0.0
    yarn_context: int = 0  # rope.scaling.original_context_length (0: the context length)
    yarn_log_mul: float = 0.0  # as stored: 0.1 * mscale_all_dim
    context: int = 4096
    tied: bool = False
    split_kv_b: bool = True  # attn_k_b + attn_v_b (MLA GGUFs), else the older attn_kv_b

    @property
    def mla(self) -> mla.MLADims:
        return mla.MLADims(self.heads, self.q_rank, self.kv_rank, self.nope, self.rope, self.v)


@dataclass
class Layer:
    attn_norm: Any
    attn: mla.MLAWeights
    ffn_norm: Any
    gate: Any = None  # dense layers
    up: Any = None
    down: Any = None
    experts: MoEWeights | None = None
    shared_gate: Any = None
    shared_up: Any = None
    shared_down: Any = None


class DeepSeek2(Architecture):
    names = ("deepseek2",)

    @classmethod
    def read_params(cls, file: ModelFile) -> DeepSeek2Params:
        rope = int(file.get(K.Rope.DIMENSION_COUNT))
        split = name(T.ATTN_KV_B, 0) not in file.tensors
        # MLA GGUFs describe the absorbed MQA head in key/value_length and the real heads in the _mla keys
        key = file.get(K.Attention.KEY_LENGTH_MLA) if split else file.get(K.Attention.KEY_LENGTH)
        value = file.get(K.Attention.VALUE_LENGTH_MLA) if split else file.get(K.Attention.VALUE_LENGTH)
        gating = int(file.get(K.LLM.EXPERT_GATING_FUNC, gguf.ExpertGatingFuncType.SOFTMAX))
        if gating not in GATING:
            raise ModelFileError(f"{file.path}: expert_gating_func {gating} is not softmax (1) or sigmoid (2)")
        return DeepSeek2Params(
            layers=int(file.get(K.LLM.BLOCK_COUNT)),
            width=int(file.get(K.LLM.EMBEDDING_LENGTH)),
            vocab=file.tensor(name(T.TOKEN_EMBD)).shape[0],
            heads=int(file.get(K.Attention.HEAD_COUNT)),
            q_rank=int(file.get(K.Attention.Q_LORA_RANK, 0)),
            kv_rank=int(file.get(K.Attention.KV_LORA_RANK)),
            nope=int(key) - rope,
            rope=rope,
            v=int(value),
            ffn=int(file.get(K.LLM.FEED_FORWARD_LENGTH)),
            expert_ffn=int(file.get(K.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            experts=int(file.get(K.LLM.EXPERT_COUNT)),
            experts_used=int(file.get(K.LLM.EXPERT_USED_COUNT)),
            shared_experts=int(file.get(K.LLM.EXPERT_SHARED_COUNT)),
            dense_layers=int(file.get(K.LLM.LEADING_DENSE_BLOCK_COUNT, 0)),
            gating=GATING[gating],
            groups=int(file.get(K.LLM.EXPERT_GROUP_COUNT, 0)),
            groups_used=int(file.get(K.LLM.EXPERT_GROUP_USED_COUNT, 0)),
            weights_norm=bool(file.get(K.LLM.EXPERT_WEIGHTS_NORM, False)),
            weights_scale=float(file.get(K.LLM.EXPERT_WEIGHTS_SCALE, 0.0)),
            selection_bias=name(T.FFN_EXP_PROBS_B, int(file.get(K.LLM.LEADING_DENSE_BLOCK_COUNT, 0)), "bias")
            in file.tensors,
            norm_eps=float(file.get(K.Attention.LAYERNORM_RMS_EPS)),
            rope_base=float(file.get(K.Rope.FREQ_BASE, 10000.0)),
            rope_scaling=str(file.get(K.Rope.SCALING_TYPE, "linear" if file.get(K.Rope.SCALING_FACTOR, 0) else "none")),
            rope_factor=float(file.get(K.Rope.SCALING_FACTOR, 0.0) or 0.0),
            yarn_context=int(file.get(K.Rope.SCALING_ORIG_CTX_LEN, 0)),
            yarn_log_mul=float(file.get(K.Rope.SCALING_YARN_LOG_MUL, 0.0)),
            context=int(file.get(K.LLM.CONTEXT_LENGTH, 4096)),
            tied=name(T.OUTPUT) not in file.tensors,
            split_kv_b=split,
        )

    @property
    def vocab_size(self) -> int:
        return self.params.vocab

    @classmethod
    def kv_layouts(cls, p: DeepSeek2Params) -> list[KVLayout]:
        return [p.mla.layout()] * p.layers

    @classmethod
    def rope_and_scale(cls, p: DeepSeek2Params) -> tuple[RopeSpec, float]:
        """The RoPE of q_rope and k_rope, and the attention score scale, as llama.cpp derives them."""
        freq_scale = 1.0 / p.rope_factor if p.rope_scaling != "none" and p.rope_factor else 1.0
        ext_factor = 1.0 if p.rope_scaling == "yarn" else 0.0
        log_mul = p.yarn_log_mul / 0.1  # llama.cpp cancels the converter's factor 0.1
        attn_factor = 1.0  # llama-context.cpp: cparams.yarn_attn_factor
        if ext_factor:
            factor = 1.0 / freq_scale

            def mscale(m: float) -> float:
                return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

            if log_mul:
                attn_factor = mscale(log_mul if log_mul != 1.0 else 1.0) / mscale(log_mul)
            else:
                attn_factor = mscale(1.0)
            attn_factor /= 1.0 + 0.1 * math.log(factor)
        context = p.yarn_context or p.context
        spec = ggml_rope(p.rope, p.rope_base, False, freq_scale, ext_factor, attn_factor, context, 32.0, 1.0)
        # deepseek2.cpp: cancel the YaRN adjustment, then pre-scale kq by mscale^2
        attn_factor_org = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
        mscale_kq = attn_factor_org * (1.0 + 0.1 * log_mul * math.log(1.0 / freq_scale))
        return spec, mscale_kq * mscale_kq / math.sqrt(p.nope + p.rope)

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD))
        self.output_norm = w(name(T.OUTPUT_NORM))
        self.output = self.embedding if p.tied else w(name(T.OUTPUT))
        self.rope, self.scale = self.rope_and_scale(p)
        self.moe = MoESpec(
            p.experts,
            p.experts_used,
            p.gating,
            p.weights_norm,
            p.weights_scale or 1.0,
            groups=p.groups,
            groups_used=p.groups_used,
        )
        self.layers = []
        for i in range(p.layers):
            layer = Layer(w(name(T.ATTN_NORM, i)), mla.load_mla(w, i, p.mla), w(name(T.FFN_NORM, i)))
            if i < p.dense_layers:
                layer.gate, layer.up, layer.down = (w(name(t, i)) for t in (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN))
            else:
                layer.experts = load_moe(w, i)
                layer.shared_gate, layer.shared_up, layer.shared_down = (
                    w(name(t, i)) for t in (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP)
                )
            self.layers.append(layer)

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            h = B.rms_norm(x, layer.attn_norm, p.norm_eps)
            x = B.add(x, mla.mla_attention(B, h, layer.attn, p.mla, batch, kv, i, self.rope, self.scale, p.norm_eps))
            h = B.rms_norm(x, layer.ffn_norm, p.norm_eps)
            if layer.experts is None:
                h = blocks.swiglu(B, h, layer.gate, layer.up, layer.down)
            else:
                shared = blocks.swiglu(B, h, layer.shared_gate, layer.shared_up, layer.shared_down)
                h = B.add(B.moe(h, layer.experts, self.moe), shared)
            x = B.add(x, h)
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.output)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> DeepSeek2Params:
        params = DeepSeek2Params(
            layers=3,
            width=64,
            vocab=300,
            heads=4,
            q_rank=24,
            kv_rank=32,
            nope=16,
            rope=8,
            v=16,
            ffn=128,
            expert_ffn=32,
            experts=8,
            experts_used=2,
            shared_experts=1,
            context=256,
        )
        return dataclasses.replace(params, **overrides)

    @classmethod
    def tensor_shapes(cls, p: DeepSeek2Params) -> dict[str, tuple[int, ...]]:
        shapes = {name(T.TOKEN_EMBD): (p.vocab, p.width), name(T.OUTPUT_NORM): (p.width,)}
        if not p.tied:
            shapes[name(T.OUTPUT)] = (p.vocab, p.width)
        for i in range(p.layers):
            shapes[name(T.ATTN_NORM, i)] = (p.width,)
            shapes |= mla.mla_shapes(i, p.width, p.mla, p.split_kv_b)
            shapes[name(T.FFN_NORM, i)] = (p.width,)
            if i < p.dense_layers:
                shapes |= {
                    name(T.FFN_GATE, i): (p.ffn, p.width),
                    name(T.FFN_UP, i): (p.ffn, p.width),
                    name(T.FFN_DOWN, i): (p.width, p.ffn),
                }
                continue
            shapes |= moe_shapes(i, p.width, p.expert_ffn, p.experts, selection_bias=p.selection_bias)
            shared = p.expert_ffn * p.shared_experts
            shapes |= {
                name(T.FFN_GATE_SHEXP, i): (shared, p.width),
                name(T.FFN_UP_SHEXP, i): (shared, p.width),
                name(T.FFN_DOWN_SHEXP, i): (p.width, shared),
            }
        return shapes

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, p: DeepSeek2Params) -> None:
        writer.add_block_count(p.layers)
        writer.add_context_length(p.context)
        writer.add_embedding_length(p.width)
        writer.add_feed_forward_length(p.ffn)
        writer.add_head_count(p.heads)
        writer.add_vocab_size(p.vocab)
        writer.add_layer_norm_rms_eps(p.norm_eps)
        writer.add_rope_freq_base(p.rope_base)
        writer.add_rope_dimension_count(p.rope)
        writer.add_leading_dense_block_count(p.dense_layers)
        writer.add_q_lora_rank(p.q_rank)
        writer.add_kv_lora_rank(p.kv_rank)
        if p.split_kv_b:  # as the current converter: one absorbed KV head, real heads in the _mla keys
            writer.add_head_count_kv(1)
            writer.add_key_length(p.kv_rank + p.rope)
            writer.add_value_length(p.kv_rank)
            writer.add_key_length_mla(p.nope + p.rope)
            writer.add_value_length_mla(p.v)
        else:
            writer.add_head_count_kv(p.heads)
            writer.add_key_length(p.nope + p.rope)
            writer.add_value_length(p.v)
        writer.add_expert_feed_forward_length(p.expert_ffn)
        writer.add_expert_count(p.experts)
        writer.add_expert_used_count(p.experts_used)
        writer.add_expert_shared_count(p.shared_experts)
        writer.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID if p.gating == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
        )
        if p.weights_norm:
            writer.add_expert_weights_norm(True)
        if p.weights_scale:
            writer.add_expert_weights_scale(p.weights_scale)
        if p.groups:
            writer.add_expert_group_count(p.groups)
            writer.add_expert_group_used_count(p.groups_used)
        if p.rope_scaling != "none":
            writer.add_rope_scaling_type(gguf.RopeScalingType(p.rope_scaling))
            writer.add_rope_scaling_factor(p.rope_factor)
            if p.yarn_context:
                writer.add_rope_scaling_orig_ctx_len(p.yarn_context)
            if p.yarn_log_mul:
                writer.add_rope_scaling_yarn_log_mul(p.yarn_log_mul)
