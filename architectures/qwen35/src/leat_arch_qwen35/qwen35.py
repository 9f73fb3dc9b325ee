"""Qwen3.5 (``qwen35``): gated delta-net linear-attention layers beside gated full-attention layers.

As llama.cpp's src/models/qwen35.cpp computes it:

* Each layer is pre-norm: ``x + mixer(rms_norm(x))``, then ``x + swiglu(rms_norm(x))`` (``post_attention_norm`` is
  the MLP's norm). ``attention.recurrent_layers`` flags the linear layers; without it every
  ``full_attention_interval``-th layer (default 4) is full attention, the others linear.
* A linear layer (:mod:`leat.deltanet`): ``attn_qkv`` feeds the convolution and the recurrence, whose output per value
  head is RMS-normed by ``ssm_norm`` and gated by ``silu(attn_gate x)`` before ``ssm_out``. Its heads and sizes are
  the ``ssm.*`` keys: ``group_count`` key heads, ``time_step_rank`` value heads, ``state_size`` each head's size.
* A full layer projects q and a gate together (``attn_q`` holds, per head, q's rows then the gate's), RMS-norms q and
  k per head, rotates them by IMRoPE (Qwen3-VL's interleaved M-RoPE: text positions are the same in its t, h and w
  sections, so it is NEOX RoPE over ``rope.dimension_count`` dimensions, where pairs outside the sections stay
  unrotated), and multiplies the attention's output by ``sigmoid(gate)`` before ``attn_output``.

Qwen3.5 MoE (``qwen35moe``, :class:`Qwen35Moe`) has the same layers with a MoE MLP.

The last ``nextn_predict_layers`` blocks (``block_count`` counts them) are multi-token-prediction layers
(:mod:`leat.nextn`; llama.cpp's ``graph_mtp``): a full-attention layer of the family (its MLP or MoE) between the
nextn projections. A forward pass runs the layers before them, as llama.cpp does; the ``mtp`` proposer drafts with
them.

The linear layers keep a recurrent state per sequence (:meth:`leat.backend.Backend.gated_delta_net`), so a backend
must keep one; it rewinds only into a verified draft (past a rejected one), so the engine reuses no prefix and keeps
no sessions for these models.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from leat import blocks, moe, nextn
from leat.architecture import Architecture, Weights
from leat.backend import Backend, KVLayout, RopeSpec
from leat.batch import Batch
from leat.deltanet import DeltaNet
from leat.errors import BackendUnavailable
from leat.hparams import DecoderParams, derived, key, tensor_rows
from leat.modelfile import ModelFile

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor
# llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS; the gguf package this project pins does not export it yet
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"


@dataclass(frozen=True, kw_only=True)
class Qwen35Params(DecoderParams):
    context: int = key(K.LLM.CONTEXT_LENGTH, 4096)
    rope_dims: int = key(K.Rope.DIMENSION_COUNT, missing=lambda v: v["head_dim"])
    rope_base: float = key(K.Rope.FREQ_BASE, 10000000.0)
    rope_sections: tuple[int, ...] = key(K.Rope.DIMENSION_SECTIONS, (11, 11, 10, 0))
    conv_kernel: int = key(K.SSM.CONV_KERNEL)
    state_size: int = key(K.SSM.STATE_SIZE)
    k_heads: int = key(K.SSM.GROUP_COUNT)
    v_heads: int = key(K.SSM.TIME_STEP_RANK)
    inner: int = key(K.SSM.INNER_SIZE, missing=lambda v: v["v_heads"] * v["state_size"])
    interval: int = key(K.LLM.FULL_ATTENTION_INTERVAL, 4)
    recurrent_layers: tuple[bool, ...] | None = key(RECURRENT_LAYERS, None)
    nextn_layers: int | None = key(K.LLM.NEXTN_PREDICT_LAYERS, None)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, True)

    @property
    def trunk(self) -> int:
        """The layers a forward pass runs: all but the multi-token-prediction ones."""
        return self.layers - (self.nextn_layers or 0)

    def linear(self, layer: int) -> bool:
        if layer >= self.trunk:
            return False  # a multi-token-prediction layer is full attention
        if self.recurrent_layers is not None:
            return bool(self.recurrent_layers[layer])
        return (layer + 1) % self.interval != 0


@dataclass
class FullAttention:
    q: Any
    gate: Any
    k: Any
    v: Any
    o: Any
    q_norm: Any
    k_norm: Any
    cache: int  # the layer's index in the KV cache


@dataclass
class LinearAttention:
    qkv: Any
    z: Any
    alpha: Any
    beta: Any
    norm: Any
    out: Any
    net: DeltaNet


@dataclass
class Layer:
    attn_norm: Any
    mixer: FullAttention | LinearAttention
    ffn_norm: Any
    mlp: tuple[Any, Any, Any]  # qwen35moe: the shared expert's
    experts: moe.MoEWeights | None = None
    shared_gate: Any = None  # [1, width]: the shared expert's output is scaled by sigmoid(x . shared_gate)


class Qwen35(nextn.WithNextN, Architecture):
    names = ("qwen35",)
    Params = Qwen35Params
    recurrent = True

    def __init__(self, file: ModelFile, backend: Backend):
        if not backend.recurrent_state:
            raise BackendUnavailable(
                f"{file.path}: {file.architecture}'s linear-attention layers keep a recurrent state per sequence, "
                f"which the {backend.name} backend does not keep yet: run this model with --backend cpu"
            )
        super().__init__(file, backend)

    @classmethod
    def kv_layouts(cls, p: Qwen35Params) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim) for i in range(p.trunk) if not p.linear(i)]

    def nextn_kv_layouts(self) -> list[KVLayout]:
        return [KVLayout(self.params.kv_heads, self.params.head_dim)] * min(1, self.params.nextn_layers or 0)

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        self.rope = RopeSpec(p.rope_dims, p.rope_base, True, freq_factors=imrope_factors(p.rope_dims, p.rope_sections))
        self.layers = [self.load_layer(w, i) for i in range(p.trunk)]
        for i in range(p.trunk, p.layers):  # multi-token prediction: a full-attention layer and the nextn projections
            self.load_layer(nextn.Unloaded(w), i)
            nextn.skip_nextn(w, i, p.width)
        self._nextn = None

    def load_layer(self, w: Weights | nextn.Unloaded, i: int) -> Layer:
        """Layer i; a full one's KV is the i-th full layer's of the cache (a nextn layer's: its own cache's first)."""
        p = self.params
        full = [j for j in range(p.trunk) if not p.linear(j)]
        cache = full.index(i) if i in full else 0
        return Layer(
            attn_norm=w(name(T.ATTN_NORM, i), (p.width,)),
            mixer=self.load_linear(w, i) if p.linear(i) else self.load_full(w, i, cache),
            ffn_norm=w(name(T.ATTN_POST_NORM, i), (p.width,)),
            mlp=self.load_mlp(w, i),
        )

    def load_mlp(self, w: Weights | nextn.Unloaded, i: int) -> tuple[Any, Any, Any]:
        return blocks.load_mlp(w, i, self.params.width, self.params.ffn)

    def feed_forward(self, x: Any, layer: Layer) -> Any:
        return blocks.swiglu(self.backend, x, *layer.mlp)

    def load_full(self, w: Weights | nextn.Unloaded, i: int, cache: int) -> FullAttention:
        p = self.params
        d, kv = p.head_dim, p.kv_heads * p.head_dim
        shape = (2 * p.heads * d, p.width)
        rows = np.arange(2 * p.heads * d).reshape(p.heads, 2, d)  # per head: q's rows, then the gate's
        return FullAttention(
            q=w.rows(name(T.ATTN_Q, i), shape, rows[:, 0].ravel()),
            gate=w.rows(name(T.ATTN_Q, i), shape, rows[:, 1].ravel()),
            k=w(name(T.ATTN_K, i), (kv, p.width)),
            v=w(name(T.ATTN_V, i), (kv, p.width)),
            o=w(name(T.ATTN_OUT, i), (p.width, p.heads * d)),
            q_norm=w(name(T.ATTN_Q_NORM, i), (d,)),
            k_norm=w(name(T.ATTN_K_NORM, i), (d,)),
            cache=cache,
        )

    def load_linear(self, w: Weights, i: int) -> LinearAttention:
        p = self.params
        channels = 2 * p.k_heads * p.state_size + p.inner
        net = DeltaNet(
            p.k_heads,
            p.v_heads,
            p.state_size,
            conv=w.host(name(T.SSM_CONV1D, i), (channels, p.conv_kernel)),
            dt_bias=w.host(name(T.SSM_DT, i, "bias"), (p.v_heads,)),
            a=w.host(gguf.TENSOR_NAMES[T.SSM_A].format(bid=i), (p.v_heads,)),
            eps=p.norm_eps,
        )
        return LinearAttention(
            qkv=w(name(T.ATTN_QKV, i), (channels, p.width)),
            z=w(name(T.ATTN_GATE, i), (p.inner, p.width)),
            alpha=w(name(T.SSM_ALPHA, i), (p.v_heads, p.width)),
            beta=w(name(T.SSM_BETA, i), (p.v_heads, p.width)),
            norm=w(name(T.SSM_NORM, i), (p.state_size,)),
            out=w(name(T.SSM_OUT, i), (p.width, p.inner)),
            net=net,
        )

    def attention(self, x: Any, a: FullAttention, batch: Batch, kv: Any) -> Any:
        B, p, n = self.backend, self.params, len(batch)
        q = B.rms_norm(B.reshape(B.matmul(x, a.q), (n, p.heads, p.head_dim)), a.q_norm, p.norm_eps)
        k = B.rms_norm(B.reshape(B.matmul(x, a.k), (n, p.kv_heads, p.head_dim)), a.k_norm, p.norm_eps)
        v = B.reshape(B.matmul(x, a.v), (n, p.kv_heads, p.head_dim))
        q, k = B.rope(q, batch.positions, self.rope), B.rope(k, batch.positions, self.rope)
        out = B.attention(q, k, v, kv, a.cache, batch, p.head_dim**-0.5)
        return B.matmul(B.sigmoid_mul(B.matmul(x, a.gate), out), a.o)

    def linear(self, x: Any, a: LinearAttention, i: int, batch: Batch, kv: Any) -> Any:
        B, p, n = self.backend, self.params, len(batch)
        out = B.gated_delta_net(B.matmul(x, a.qkv), B.matmul(x, a.alpha), B.matmul(x, a.beta), a.net, kv, i, batch)
        z = B.reshape(B.matmul(x, a.z), (n, p.v_heads, p.state_size))
        out = B.silu_mul(z, B.rms_norm(out, a.norm, p.norm_eps))
        return B.matmul(B.reshape(out, (n, p.inner)), a.out)

    def forward(self, batch: Batch, kv: Any) -> Any:
        return self.backend.matmul(self.hidden(batch, kv), self.output)

    def block(self, x: Any, layer: Layer, batch: Batch, kv: Any, i: int) -> Any:
        B, p = self.backend, self.params
        h, m = B.rms_norm(x, layer.attn_norm, p.norm_eps), layer.mixer
        x = B.add(
            x, self.attention(h, m, batch, kv) if isinstance(m, FullAttention) else self.linear(h, m, i, batch, kv)
        )
        return B.add(x, self.feed_forward(B.rms_norm(x, layer.ffn_norm, p.norm_eps), layer))

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
    def tiny(cls, **overrides: Any) -> Qwen35Params:
        """Qwen3.5-0.8B's shape, small: 4 layers, the fourth full attention (4 heads of 32, 2 KV heads, IMRoPE over 16
        of them), the others gated delta-nets (2 key heads and 4 value heads of 16, a convolution over 4 tokens)."""
        params = Qwen35Params(
            layers=4, width=64, ffn=96, heads=4, kv_heads=2, head_dim=32, rope_dims=16, rope_sections=(3, 3, 2, 0),
            conv_kernel=4, state_size=16, k_heads=2, v_heads=4, inner=64, vocab=300, context=256, norm_eps=1e-6,
        )  # fmt: skip
        return dataclasses.replace(params, **overrides)


@dataclass(frozen=True, kw_only=True)
class Qwen35MoeParams(Qwen35Params):
    ffn: int = key(K.LLM.FEED_FORWARD_LENGTH, 0)
    experts: int = key(K.LLM.EXPERT_COUNT)
    experts_used: int = key(K.LLM.EXPERT_USED_COUNT)
    expert_ffn: int = key(K.LLM.EXPERT_FEED_FORWARD_LENGTH)
    shared_ffn: int = key(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)


class Qwen35Moe(Qwen35):
    """Qwen3.5 MoE (``qwen35moe``): each layer's MLP is softmax-routed experts (the chosen weights renormalised)
    plus a shared expert whose output is scaled by ``sigmoid(x . ffn_gate_inp_shexp)``, as Qwen3-Next's."""

    names = ("qwen35moe",)
    Params = Qwen35MoeParams

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.routing = moe.MoESpec(p.experts, p.experts_used, "softmax", normalize=True)
        super().load_weights(w)
        for i, layer in enumerate(self.layers):  # after every layer's other tensors: the tiny files' recorded order
            self.load_experts(w, i, layer)

    def load_layer(self, w: Weights | nextn.Unloaded, i: int) -> Layer:
        layer = super().load_layer(w, i)
        return self.load_experts(w, i, layer) if i >= self.params.trunk else layer

    def load_experts(self, w: Weights | nextn.Unloaded, i: int, layer: Layer) -> Layer:
        p = self.params
        layer.experts = moe.load_moe(w, i, p.width, p.expert_ffn, p.experts, False, False)
        gate = name(T.FFN_GATE_INP_SHEXP, i)
        layer.shared_gate = w.array(gate, w.host(gate, (p.width,)).reshape(1, p.width))
        return layer

    def load_mlp(self, w: Weights | nextn.Unloaded, i: int) -> tuple[Any, Any, Any]:
        return blocks.load_mlp(w, i, self.params.width, self.params.shared_ffn, blocks.SHARED_EXPERTS)

    def feed_forward(self, x: Any, layer: Layer) -> Any:
        B = self.backend
        shared = B.sigmoid_mul(B.matmul(x, layer.shared_gate), super().feed_forward(x, layer))
        return B.add(B.moe(x, layer.experts, self.routing), shared)

    @classmethod
    def tiny(cls, **overrides: Any) -> Qwen35MoeParams:
        """Qwen35.tiny()'s layers with 8 experts of 32, 2 per token, and a shared expert of 48."""
        base = dataclasses.asdict(Qwen35.tiny()) | {"ffn": 0}
        params = Qwen35MoeParams(**base, experts=8, experts_used=2, expert_ffn=32, shared_ffn=48)
        return dataclasses.replace(params, **overrides)


def imrope_factors(dims: int, sections: tuple[int, ...]) -> np.ndarray | None:
    """Frequency factors that leave unrotated the pairs IMRoPE gives its fourth (extra) section, whose position is 0
    for text (as ggml_mrope_cache_init picks each pair's section); None where every pair rotates."""
    total = sum(sections)
    if total == 0:
        return None
    s = np.arange(dims // 2) % total
    rotated = ((s % 3 == 0) & (s < 3 * sections[0])) | ((s % 3 == 1) & (s < 3 * sections[1]))
    rotated |= (s % 3 == 2) & (s < 3 * sections[2])
    return None if rotated.all() else np.where(rotated, 1.0, 1e30)
