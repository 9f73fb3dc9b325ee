"""GLM-4.5 (``glm4moe``: GLM-4.5, GLM-4.5-Air, GLM-4.6): GQA attention with q/k/v biases and partial NEOX RoPE,
leading dense layers, then MoE with shared experts.

As llama.cpp's src/models/glm4-moe.cpp computes it:

* Attention: q, k and v with biases (``attention_bias``), an optional per-head RMSNorm of q and k (GLM-4.5 355B),
  RoPE of the NEOX kind on the first ``rope.dimension_count`` dimensions (half the head), scores scaled by
  1/sqrt(head size); the head size is ``attention.key_length``, set apart from the width.
* The feed-forward's norm is ``post_attention_norm``. The first ``leading_dense_block_count`` layers have a SwiGLU
  MLP; the others route each token to ``expert_used_count`` experts (sigmoid gating unless the file says otherwise,
  the ``exp_probs_b`` selection bias, optional normalization and ``expert_weights_scale``, group-limited routing where
  the file has expert groups: :mod:`leat.moe`) and add shared experts, a SwiGLU MLP ``expert_shared_count`` experts
  wide.
* The last ``nextn_predict_layers`` blocks (``block_count`` counts them) are multi-token-prediction layers
  (:mod:`leat.nextn`): a forward pass runs only the layers before them, as llama.cpp does; the ``mtp`` proposer
  drafts with the first, whose weights load only then.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gguf
from leat import blocks, nextn
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout
from leat.batch import Batch
from leat.hparams import DecoderParams, derived, has_tensor, key, tensor_rows
from leat.moe import MoESpec, load_moe
from leat.rope import rope_from_metadata

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor
GATING = {int(gguf.ExpertGatingFuncType.SOFTMAX): "softmax", int(gguf.ExpertGatingFuncType.SIGMOID): "sigmoid"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Glm4MoeParams(DecoderParams):
    rope_dims: int = key(K.Rope.DIMENSION_COUNT, missing=lambda v: v["head_dim"])
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    experts: int = key(K.LLM.EXPERT_COUNT)
    experts_used: int = key(K.LLM.EXPERT_USED_COUNT)
    expert_ffn: int = key(K.LLM.EXPERT_FEED_FORWARD_LENGTH)
    shared_experts: int = key(K.LLM.EXPERT_SHARED_COUNT)
    dense_layers: int = key(K.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    gating_func: int = key(K.LLM.EXPERT_GATING_FUNC, int(gguf.ExpertGatingFuncType.SIGMOID))
    weights_norm: bool = key(K.LLM.EXPERT_WEIGHTS_NORM, False)
    weights_scale: float | None = key(K.LLM.EXPERT_WEIGHTS_SCALE, None)
    groups: int | None = key(K.LLM.EXPERT_GROUP_COUNT, None)
    groups_used: int | None = key(K.LLM.EXPERT_GROUP_USED_COUNT, None)
    nextn_layers: int = key(K.LLM.NEXTN_PREDICT_LAYERS, 0)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, False)
    qkv_bias: bool = derived(has_tensor(name(T.ATTN_Q, 0, "bias")), True)
    qk_norm: bool = derived(has_tensor(name(T.ATTN_Q_NORM, 0)), False)

    @property
    def trunk(self) -> int:
        """The layers a forward pass runs: all but the multi-token-prediction ones."""
        return self.layers - self.nextn_layers


class Glm4Moe(nextn.WithNextN, Architecture):
    names = ("glm4moe",)
    Params = Glm4MoeParams

    @classmethod
    def kv_layouts(cls, p: Glm4MoeParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim)] * p.trunk

    def nextn_kv_layouts(self) -> list[KVLayout]:
        return [KVLayout(self.params.kv_heads, self.params.head_dim)] * min(1, self.params.nextn_layers)

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        self.rope = rope_from_metadata(self.file, p.rope_dims, neox=True)
        groups = {"groups": p.groups or 0, "groups_used": p.groups_used or 0}
        gating = GATING[p.gating_func]
        self.moe = MoESpec(p.experts, p.experts_used, gating, p.weights_norm, p.weights_scale or 1.0, **groups)
        self.layers = [self.load_layer(w, i) for i in range(p.trunk)]
        for i in range(p.trunk, p.layers):  # multi-token prediction: a MoE layer and the nextn projections
            self.load_layer(nextn.Unloaded(w), i)
            nextn.skip_nextn(w, i, p.width)
        self._nextn = None

    def load_layer(self, w: Weights | nextn.Unloaded, i: int) -> blocks.DecoderLayer:
        p = self.params
        attn_norm = w(name(T.ATTN_NORM, i), (p.width,))
        attn = blocks.load_attention(
            w, i, p.width, p.heads, p.kv_heads, p.head_dim, qkv_bias=p.qkv_bias, qk_norm=p.qk_norm
        )
        ffn_norm = w(name(T.ATTN_POST_NORM, i), (p.width,))
        if i < p.dense_layers:
            return blocks.DecoderLayer(attn_norm, attn, ffn_norm, blocks.load_mlp(w, i, p.width, p.ffn))
        experts = load_moe(w, i, p.width, p.expert_ffn, p.experts, False, True)
        shared = blocks.load_mlp(w, i, p.width, p.expert_ffn * p.shared_experts, blocks.SHARED_EXPERTS)
        return blocks.DecoderLayer(attn_norm, attn, ffn_norm, shared, experts)

    def forward(self, batch: Batch, kv: Any) -> Any:
        return self.backend.matmul(self.hidden(batch, kv), self.output)

    def block(self, x: Any, layer: blocks.DecoderLayer, batch: Batch, kv: Any, i: int) -> Any:
        """Pre-norm attention, then a SwiGLU MLP or MoE + shared experts."""
        p = self.params
        return blocks.decoder_layer(
            self.backend, x, layer, batch, kv, i, p.heads, p.kv_heads, p.head_dim, self.rope, p.norm_eps, self.moe
        )

    def trunk(self, batch: Batch, kv: Any) -> Any:
        x = self.backend.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            x = self.block(x, layer, batch, kv, i)
        return x

    def hidden(self, batch: Batch, kv: Any) -> Any:
        B = self.backend
        return B.rms_norm(B.take_rows(self.trunk(batch, kv), batch.logit_index), self.output_norm, self.params.norm_eps)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> Glm4MoeParams:
        """GLM-4.5-Air's shape, small: 3 layers (1 dense, 2 MoE of 8 experts, top 2, one shared expert), 4 heads of
        16 over a width of 48 with 2 KV heads, RoPE on half of each head, q/k/v biases, sigmoid gating with
        normalized weights scaled by 2.5, an untied output."""
        params = Glm4MoeParams(
            layers=3, width=48, ffn=96, heads=4, kv_heads=2, head_dim=16, rope_dims=8, vocab=300, context=256,
            experts=8, experts_used=2, expert_ffn=32, shared_experts=1, dense_layers=1, weights_norm=True,
            weights_scale=2.5,
        )  # fmt: skip
        return dataclasses.replace(params, **overrides)
