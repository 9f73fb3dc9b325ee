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
* The last ``nextn_predict_layers`` blocks (``block_count`` counts them) are multi-token-prediction layers
  (:mod:`leat.nextn`): a forward pass runs the layers before them, as llama.cpp does; the ``mtp`` proposer drafts
  with the first, whose weights load only then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf
from leat import blocks, mla, nextn
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.hparams import REQUIRED, derived, key, tensor_rows
from leat.modelfile import ModelFile
from leat.moe import MoESpec, MoEWeights, load_moe
from leat.rope import ggml_rope

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor
GATING = {int(gguf.ExpertGatingFuncType.SOFTMAX): "softmax", int(gguf.ExpertGatingFuncType.SIGMOID): "sigmoid"}


def mla_key(gguf_key: str) -> Any:
    """A reader: ``gguf_key``, required in MLA GGUFs (attn_k_b and attn_v_b), None where older files lack it."""
    return lambda file, values: file.get(gguf_key, *(() if values["split_kv_b"] else (None,)))


@dataclass(frozen=True, kw_only=True)
class DeepSeek2Params:
    """Hyperparameters as the file states them, in the converter's order; ``None`` = key absent.

    MLA GGUFs (attn_k_b and attn_v_b) describe the absorbed attention as one MQA head (``kv_heads`` 1,
    ``key_length`` kv_rank + rope, ``value_length`` kv_rank) and the real heads in the ``_mla`` keys; older files
    (attn_kv_b) describe the real heads in key_length and value_length. :attr:`nope` and :attr:`v` read either.
    """

    layers: int = key(K.LLM.BLOCK_COUNT)
    context: int = key(K.LLM.CONTEXT_LENGTH, 4096)
    width: int = key(K.LLM.EMBEDDING_LENGTH)
    ffn: int = key(K.LLM.FEED_FORWARD_LENGTH)  # leading dense layers
    heads: int = key(K.Attention.HEAD_COUNT)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-6, missing=REQUIRED)
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    rope: int = key(K.Rope.DIMENSION_COUNT)  # RoPE dims of each query head and of the shared key part
    dense_layers: int = key(K.LLM.LEADING_DENSE_BLOCK_COUNT, 1, missing=0)
    q_rank: int = key(K.Attention.Q_LORA_RANK, 0)  # 0: queries straight from attn_q
    kv_rank: int = key(K.Attention.KV_LORA_RANK)
    split_kv_b: bool = derived(lambda file, values: name(T.ATTN_KV_B, 0) not in file.tensors, True)
    kv_heads: int = key(
        K.Attention.HEAD_COUNT_KV, missing=lambda values: 1 if values["split_kv_b"] else values["heads"]
    )
    key_length: int = key(K.Attention.KEY_LENGTH)
    value_length: int = key(K.Attention.VALUE_LENGTH)
    key_length_mla: int | None = key(K.Attention.KEY_LENGTH_MLA, None, read=mla_key(K.Attention.KEY_LENGTH_MLA))
    value_length_mla: int | None = key(K.Attention.VALUE_LENGTH_MLA, None, read=mla_key(K.Attention.VALUE_LENGTH_MLA))
    expert_ffn: int = key(K.LLM.EXPERT_FEED_FORWARD_LENGTH)
    experts: int = key(K.LLM.EXPERT_COUNT)
    experts_used: int = key(K.LLM.EXPERT_USED_COUNT)
    shared_experts: int = key(K.LLM.EXPERT_SHARED_COUNT)
    gating_func: int = key(K.LLM.EXPERT_GATING_FUNC, int(gguf.ExpertGatingFuncType.SOFTMAX))
    weights_norm: bool | None = key(K.LLM.EXPERT_WEIGHTS_NORM, None)
    weights_scale: float | None = key(K.LLM.EXPERT_WEIGHTS_SCALE, None)
    groups: int | None = key(K.LLM.EXPERT_GROUP_COUNT, None)  # group-limited routing
    groups_used: int | None = key(K.LLM.EXPERT_GROUP_USED_COUNT, None)
    # DeepSeek V3's exp_probs_b: a selection bias on the first MoE layer, and so on every one
    selection_bias: bool = derived(
        lambda file, values: name(T.FFN_EXP_PROBS_B, values["dense_layers"], "bias") in file.tensors, False
    )
    rope_scaling: str | None = key(K.Rope.SCALING_TYPE, None)  # None: linear with a factor, else none
    rope_factor: float | None = key(K.Rope.SCALING_FACTOR, None)
    yarn_context: int | None = key(K.Rope.SCALING_ORIG_CTX_LEN, None)  # None: the context length
    yarn_log_mul: float | None = key(K.Rope.SCALING_YARN_LOG_MUL, None)  # as stored: 0.1 * mscale_all_dim
    tied: bool = derived(lambda file, values: name(T.OUTPUT) not in file.tensors, False)
    nextn_layers: int | None = key(K.LLM.NEXTN_PREDICT_LAYERS, None)

    @property
    def trunk(self) -> int:
        """The layers a forward pass runs: all but the multi-token-prediction ones."""
        return self.layers - (self.nextn_layers or 0)

    @property
    def nope(self) -> int:
        """Per-head key dims without RoPE."""
        return (self.key_length_mla if self.split_kv_b else self.key_length) - self.rope

    @property
    def v(self) -> int:
        """Per-head value dims after decompression."""
        return self.value_length_mla if self.split_kv_b else self.value_length

    @property
    def scaling(self) -> str:
        """The RoPE scaling kind: "none", "linear" or "yarn"."""
        return self.rope_scaling or ("linear" if self.rope_factor else "none")

    @property
    def mla(self) -> mla.MLADims:
        return mla.MLADims(self.heads, self.q_rank, self.kv_rank, self.nope, self.rope, self.v)


@dataclass
class Layer:
    attn_norm: Any
    attn: mla.MLAWeights
    ffn_norm: Any
    mlp: tuple[Any, Any, Any]  # (gate, up, down): the dense MLP, or the shared experts beside `experts`
    experts: MoEWeights | None = None


class DeepSeek2(nextn.WithNextN, Architecture):
    names = ("deepseek2",)
    Params = DeepSeek2Params

    @classmethod
    def read_params(cls, file: ModelFile) -> DeepSeek2Params:
        p = super().read_params(file)
        if p.gating_func not in GATING:
            raise ModelFileError(f"{file.path}: expert_gating_func {p.gating_func} is not softmax (1) or sigmoid (2)")
        return p

    @classmethod
    def kv_layouts(cls, p: DeepSeek2Params) -> list[KVLayout]:
        return [p.mla.layout()] * p.trunk

    def nextn_kv_layouts(self) -> list[KVLayout]:
        return [self.params.mla.layout()] * min(1, self.params.nextn_layers or 0)

    @classmethod
    def rope_and_scale(cls, p: DeepSeek2Params) -> tuple[RopeSpec, float]:
        """The RoPE of q_rope and k_rope, and the attention score scale, as llama.cpp derives them."""
        freq_scale = 1.0 / p.rope_factor if p.scaling != "none" and p.rope_factor else 1.0
        ext_factor = 1.0 if p.scaling == "yarn" else 0.0
        log_mul = (p.yarn_log_mul or 0.0) / 0.1  # llama.cpp cancels the converter's factor 0.1
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
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        self.rope, self.scale = self.rope_and_scale(p)
        gating = GATING[p.gating_func]
        groups = {"groups": p.groups or 0, "groups_used": p.groups_used or 0}
        self.moe = MoESpec(p.experts, p.experts_used, gating, bool(p.weights_norm), p.weights_scale or 1.0, **groups)
        self.layers = [self.load_layer(w, i) for i in range(p.trunk)]
        for i in range(p.trunk, p.layers):
            self.load_layer(nextn.Unloaded(w), i)
            nextn.skip_nextn(w, i, p.width)
        self._nextn = None

    def load_layer(self, w: Weights | nextn.Unloaded, i: int) -> Layer:
        p = self.params
        attn_norm = w(name(T.ATTN_NORM, i), (p.width,))
        attn = mla.load_mla(w, i, p.mla, p.width, p.split_kv_b)
        ffn_norm = w(name(T.FFN_NORM, i), (p.width,))
        if i < p.dense_layers:
            return Layer(attn_norm, attn, ffn_norm, blocks.load_mlp(w, i, p.width, p.ffn))
        experts = load_moe(w, i, p.width, p.expert_ffn, p.experts, False, p.selection_bias)
        shared = blocks.load_mlp(w, i, p.width, p.expert_ffn * p.shared_experts, blocks.SHARED_EXPERTS)
        return Layer(attn_norm, attn, ffn_norm, shared, experts)

    def block(self, x: Any, layer: Layer, batch: Batch, kv: Any, i: int) -> Any:
        B, p = self.backend, self.params
        h = B.rms_norm(x, layer.attn_norm, p.norm_eps)
        x = B.add(x, mla.mla_attention(B, h, layer.attn, p.mla, batch, kv, i, self.rope, self.scale, p.norm_eps))
        h = B.rms_norm(x, layer.ffn_norm, p.norm_eps)
        return B.add(x, blocks.feed_forward(B, h, layer.mlp, layer.experts, self.moe))

    def trunk(self, batch: Batch, kv: Any) -> Any:
        x = self.backend.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            x = self.block(x, layer, batch, kv, i)
        return x

    def forward(self, batch: Batch, kv: Any) -> Any:
        B = self.backend
        return B.matmul(
            B.rms_norm(B.take_rows(self.trunk(batch, kv), batch.logit_index), self.output_norm, self.params.norm_eps),
            self.output,
        )

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, nope: int = 16, v: int = 16, gating: str = "softmax", **overrides: Any) -> DeepSeek2Params:
        """3 layers (1 dense, 2 MoE), width 64, 4 heads; ``nope`` and ``v`` (the real heads' key dims without RoPE
        and value dims) and ``gating`` go into the keys that state them."""
        shape = {"layers": 3, "width": 64, "vocab": 300, "heads": 4, "q_rank": 24, "kv_rank": 32, "rope": 8, "ffn": 128}
        experts = {"expert_ffn": 32, "experts": 8, "experts_used": 2, "shared_experts": 1, "context": 256}
        values: dict[str, Any] = shape | experts | overrides
        values["gating_func"] = next(number for number, kind in GATING.items() if kind == gating)
        rope, kv_rank = values["rope"], values["kv_rank"]
        if values.get("split_kv_b", True):  # as the current converter: one absorbed KV head, real heads in _mla
            values |= {"kv_heads": 1, "key_length": kv_rank + rope, "value_length": kv_rank}
            values |= {"key_length_mla": nope + rope, "value_length_mla": v}
        else:
            values |= {"kv_heads": values["heads"], "key_length": nope + rope, "value_length": v}
        return DeepSeek2Params(**values)
