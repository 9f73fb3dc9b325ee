"""Building blocks shared by architectures: attention with RoPE and GQA, gated MLPs, the pre-norm decoder layer.

Each block is a function of a backend ``B`` and backend arrays, so architectures compose them
without copying each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from leat.backend import Backend, RopeSpec
from leat.batch import Batch
from leat.modelfile import ModelFile

K = gguf.Keys
T = gguf.MODEL_TENSOR
#: The GGUF kinds of a gated MLP's gate, up and down projections, and of the shared experts beside a MoE's routed ones.
MLP = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)
SHARED_EXPERTS = (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP)


@dataclass
class AttentionWeights:
    q: Any
    k: Any
    v: Any
    o: Any
    q_bias: Any = None
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None
    q_norm: Any = None  # per-head RMSNorm of q and k (Qwen3, Gemma 3)
    k_norm: Any = None


@dataclass
class DecoderLayer:
    """One pre-norm decoder layer's weights (:func:`decoder_layer`): ``attn_norm`` before the attention, ``ffn_norm``
    before the feed-forward, which is a SwiGLU ``mlp`` (gate, up, down), routed ``experts``
    (:class:`leat.moe.MoEWeights`), or both: the MLP then as the shared experts beside the routed ones."""

    attn_norm: Any
    attn: AttentionWeights
    ffn_norm: Any
    mlp: tuple[Any, Any, Any] | None = None
    experts: Any = None


def layer_tensor(kind: gguf.MODEL_TENSOR, layer: int | None = None, suffix: str = "weight") -> str:
    """The GGUF name of a tensor, e.g. ``blk.3.attn_q.weight``."""
    name = gguf.TENSOR_NAMES[kind]
    return (name.format(bid=layer) if layer is not None else name) + f".{suffix}"


def load_attention(
    weights,
    layer: int,
    width: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
) -> AttentionWeights:
    """One layer's attention projections (q, k, v, o), then the biases and per-head q/k norms the flags ask for."""
    q, kv = heads * head_dim, kv_heads * head_dim

    def bias(kind: gguf.MODEL_TENSOR, size: int, present: bool) -> Any:
        return weights(layer_tensor(kind, layer, "bias"), (size,)) if present else None

    return AttentionWeights(
        q=weights(layer_tensor(T.ATTN_Q, layer), (q, width)),
        k=weights(layer_tensor(T.ATTN_K, layer), (kv, width)),
        v=weights(layer_tensor(T.ATTN_V, layer), (kv, width)),
        o=weights(layer_tensor(T.ATTN_OUT, layer), (width, q)),
        q_bias=bias(T.ATTN_Q, q, qkv_bias),
        k_bias=bias(T.ATTN_K, kv, qkv_bias),
        v_bias=bias(T.ATTN_V, kv, qkv_bias),
        o_bias=bias(T.ATTN_OUT, width, o_bias),
        q_norm=weights(layer_tensor(T.ATTN_Q_NORM, layer), (head_dim,)) if qk_norm else None,
        k_norm=weights(layer_tensor(T.ATTN_K_NORM, layer), (head_dim,)) if qk_norm else None,
    )


def load_embedding_and_output(weights: Any, vocab: int, width: int, tied: bool) -> tuple[Any, Any, Any]:
    """The token embedding [vocab, width], the final norm [width] and the output matrix [vocab, width] (the embedding
    itself when ``tied``: the file has no ``output.weight``)."""
    embedding = weights(layer_tensor(T.TOKEN_EMBD), (vocab, width))
    output_norm = weights(layer_tensor(T.OUTPUT_NORM), (width,))
    return embedding, output_norm, embedding if tied else weights(layer_tensor(T.OUTPUT), (vocab, width))


def load_mlp(
    weights: Any, layer: int, width: int, ffn: int, kinds: tuple[gguf.MODEL_TENSOR, ...] = MLP
) -> tuple[Any, Any, Any]:
    """A gated MLP's gate and up [ffn, width] and down [width, ffn] by their GGUF ``kinds`` (:data:`MLP`, or
    :data:`SHARED_EXPERTS` for a MoE's shared experts, ``ffn`` then their count times the experts' size)."""
    gate, up, down = (layer_tensor(kind, layer) for kind in kinds)
    return weights(gate, (ffn, width)), weights(up, (ffn, width)), weights(down, (width, ffn))


def rope_scale(file: ModelFile) -> float:
    """Linear RoPE scaling as a position multiplier (1.0 when the file asks for none)."""
    kind = file.get(K.Rope.SCALING_TYPE, "none")
    factor = float(file.get(K.Rope.SCALING_FACTOR, 0.0) or 0.0)
    if kind == "linear" and factor > 0:
        return 1.0 / factor
    return 1.0


def attention(
    B: Backend,
    x: Any,
    w: AttentionWeights,
    batch: Batch,
    kv: Any,
    layer: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rope: RopeSpec,
    norm_eps: float = 1e-6,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: Any = None,
) -> Any:
    """Self-attention of one layer: projections (with the biases ``w`` has), per-head q/k RMSNorm when ``w`` has
    it, RoPE by ``rope`` (a family with per-layer RoPE passes the layer's), cached GQA attention scaled by ``scale``
    (default 1/sqrt(head_dim)) with the scores' ``softcap`` and the heads' ``sinks`` as :meth:`Backend.attention`
    takes them, then the output projection."""
    n = len(batch)
    q, k, v = B.matmuls(x, (w.q, w.k, w.v), (w.q_bias, w.k_bias, w.v_bias))
    q = B.reshape(q, (n, heads, head_dim))
    k, v = B.reshape(k, (n, kv_heads, head_dim)), B.reshape(v, (n, kv_heads, head_dim))
    if w.q_norm is not None:
        q = B.rms_norm(q, w.q_norm, norm_eps)
        k = B.rms_norm(k, w.k_norm, norm_eps)
    q = B.rope(q, batch.positions, rope)
    k = B.rope(k, batch.positions, rope)
    out = B.attention(q, k, v, kv, layer, batch, head_dim**-0.5 if scale is None else scale, softcap, sinks)
    return B.matmul(out, w.o, w.o_bias)


def swiglu(B: Backend, x: Any, gate: Any, up: Any, down: Any) -> Any:
    return B.matmul(B.silu_mul(*B.matmuls(x, (gate, up))), down)


def feed_forward(B: Backend, x: Any, mlp: tuple[Any, Any, Any] | None, experts: Any = None, moe: Any = None) -> Any:
    """The SwiGLU ``mlp``, the routed ``experts`` (:meth:`Backend.moe` with the :class:`leat.moe.MoESpec` ``moe``), or
    their sum where a layer has both (the MLP as shared experts, as llama.cpp adds them)."""
    dense = None if mlp is None else swiglu(B, x, *mlp)
    if experts is None:
        return dense
    routed = B.moe(x, experts, moe)
    return routed if dense is None else B.add(routed, dense)


def decoder_layer(
    B: Backend,
    x: Any,
    layer: DecoderLayer,
    batch: Batch,
    kv: Any,
    index: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rope: RopeSpec,
    norm_eps: float,
    moe: Any = None,
    sinks: Any = None,
) -> Any:
    """A pre-norm block, layer ``index`` of the KV cache: ``x + attention(rms_norm(x))``, then that plus
    ``feed_forward(rms_norm(it))`` (:func:`attention` with the heads' ``sinks``, :func:`feed_forward` routing by
    ``moe``)."""
    h = B.rms_norm(x, layer.attn_norm, norm_eps)
    x = B.add(x, attention(B, h, layer.attn, batch, kv, index, heads, kv_heads, head_dim, rope, norm_eps, sinks=sinks))
    h = B.rms_norm(x, layer.ffn_norm, norm_eps)
    return B.add(x, feed_forward(B, h, layer.mlp, layer.experts, moe))


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Weights for tiny test models: norms near 1, everything else small and centred."""
    if name.startswith("rope_freqs"):  # Llama 3 style: low frequencies stretched up to 8x
        return np.linspace(1.0, 8.0, shape[0], dtype=np.float32)
    if name.endswith(".ssm_a"):  # a state-space layer's decay rates, -exp(A_log), are negative
        return -np.exp(0.5 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("norm.weight"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    fan_in = shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
