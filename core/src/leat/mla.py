"""Multi-head latent attention (DeepSeek V2/V3), as llama.cpp's src/models/deepseek2.cpp computes it.

Each token's keys and values come from one compressed latent: ``attn_kv_a_mqa`` projects x to
``[latent (kv_rank), k_rope (rope)]``, the latent is RMS-normed (``attn_kv_a_norm``) and k_rope, shared
by all heads, is rotated. Queries come from x through ``attn_q`` or the low-rank pair ``attn_q_a`` ->
``attn_q_a_norm`` -> ``attn_q_b``, and split per head into ``[q_nope (nope), q_rope (rope)]``.

In the absorbed form the key up-projection ``attn_k_b`` [heads, kv_rank, nope] is folded into the
queries (``q_latent = k_b[h] @ q_nope``), so attention runs against the cached latents themselves, one
shared "KV head" of ``kv_rank + rope`` entries per token (:meth:`~leat.backend.Backend.mla_attention`);
the result, still latent, is decompressed per head with ``attn_v_b`` [heads, v, kv_rank]. The cache
holds ``kv_rank + rope`` numbers per token and layer instead of ``heads * (nope + rope + v)``.

Older GGUFs carry the unsplit ``attn_kv_b`` [heads * (nope + v), kv_rank] instead of k_b and v_b
(llama.cpp then runs plain multi-head attention); it is split and transposed on the host at load, so
those files use the same latent cache. Projections whose outputs llama.cpp splits with views
(``attn_q``/``attn_q_b`` into nope and rope parts, ``attn_kv_a_mqa`` into latent and rope key) are split
by rows at load instead, which works for every quant type (rows are independent blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from leat.backend import Backend, KVLayout, RopeSpec
from leat.batch import Batch
from leat.blocks import layer_tensor
from leat.modelfile import Tensor

T = gguf.MODEL_TENSOR
name = layer_tensor


@dataclass(frozen=True)
class MLADims:
    heads: int
    q_rank: int  # 0: queries straight from attn_q
    kv_rank: int
    nope: int  # per-head key dims without RoPE
    rope: int  # RoPE dims, of the per-head query part and of the shared key part
    v: int  # per-head value dims after decompression

    def layout(self, window: int | None = None) -> KVLayout:
        return KVLayout(1, self.kv_rank + self.rope, self.kv_rank, window=window, latent=True)


@dataclass
class MLAWeights:
    q_a: Any  # None when queries come straight from x
    q_a_norm: Any
    q_nope: Any  # rows of attn_q / attn_q_b: [heads * nope, q_rank or d]
    q_rope: Any  # [heads * rope, q_rank or d]
    kv_latent: Any  # rows of attn_kv_a_mqa: [kv_rank, d]
    k_rope: Any  # [rope, d]
    kv_norm: Any
    k_b: Any  # [heads, kv_rank, nope]
    v_b: Any  # [heads, v, kv_rank]
    o: Any


def upload_rows(weights: Any, tensor_name: str, rows: np.ndarray) -> Any:
    """Upload only ``rows`` (first axis) of a 2-D tensor, in its stored type."""
    tensor = weights.file.tensor(tensor_name)
    weights.used.add(tensor_name)
    data = np.asarray(tensor.data).reshape(tensor.shape[0], -1)[rows]
    return weights.backend.upload(Tensor(tensor_name, tensor.qtype, (len(rows), *tensor.shape[1:]), data))


def upload_array(weights: Any, tensor_name: str, values: np.ndarray) -> Any:
    values = np.ascontiguousarray(values, dtype=np.float32)
    return weights.backend.upload(Tensor(tensor_name, gguf.GGMLQuantizationType.F32, values.shape, values))


def load_mla(weights: Any, layer: int, d: MLADims) -> MLAWeights:
    per_head = np.arange(d.heads)[:, None] * (d.nope + d.rope)
    q_name = name(T.ATTN_Q_B if d.q_rank else T.ATTN_Q, layer)
    kv_a = name(T.ATTN_KV_A_MQA, layer)
    if weights.has(name(T.ATTN_KV_B, layer)):
        kv_b = weights.host(name(T.ATTN_KV_B, layer)).reshape(d.heads, d.nope + d.v, d.kv_rank)
        k_b = upload_array(weights, name(T.ATTN_K_B, layer), kv_b[:, : d.nope].transpose(0, 2, 1))
        v_b = upload_array(weights, name(T.ATTN_V_B, layer), kv_b[:, d.nope :])
    else:
        k_b, v_b = weights(name(T.ATTN_K_B, layer)), weights(name(T.ATTN_V_B, layer))
    return MLAWeights(
        q_a=weights(name(T.ATTN_Q_A, layer)) if d.q_rank else None,
        q_a_norm=weights(name(T.ATTN_Q_A_NORM, layer)) if d.q_rank else None,
        q_nope=upload_rows(weights, q_name, (per_head + np.arange(d.nope)).ravel()),
        q_rope=upload_rows(weights, q_name, (per_head + d.nope + np.arange(d.rope)).ravel()),
        kv_latent=upload_rows(weights, kv_a, np.arange(d.kv_rank)),
        k_rope=upload_rows(weights, kv_a, d.kv_rank + np.arange(d.rope)),
        kv_norm=weights(name(T.ATTN_KV_A_NORM, layer)),
        k_b=k_b,
        v_b=v_b,
        o=weights(name(T.ATTN_OUT, layer)),
    )


def mla_shapes(layer: int, width: int, d: MLADims, split: bool = True) -> dict[str, tuple[int, ...]]:
    """The attention tensors of one layer (numpy-order shapes); ``split``: attn_k_b/attn_v_b, else attn_kv_b."""
    q_out = d.heads * (d.nope + d.rope)
    if d.q_rank:
        shapes = {
            name(T.ATTN_Q_A, layer): (d.q_rank, width),
            name(T.ATTN_Q_A_NORM, layer): (d.q_rank,),
            name(T.ATTN_Q_B, layer): (q_out, d.q_rank),
        }
    else:
        shapes = {name(T.ATTN_Q, layer): (q_out, width)}
    shapes |= {
        name(T.ATTN_KV_A_MQA, layer): (d.kv_rank + d.rope, width),
        name(T.ATTN_KV_A_NORM, layer): (d.kv_rank,),
        name(T.ATTN_OUT, layer): (width, d.heads * d.v),
    }
    if split:
        shapes |= {
            name(T.ATTN_K_B, layer): (d.heads, d.kv_rank, d.nope),
            name(T.ATTN_V_B, layer): (d.heads, d.v, d.kv_rank),
        }
    else:
        shapes[name(T.ATTN_KV_B, layer)] = (d.heads * (d.nope + d.v), d.kv_rank)
    return shapes


def mla_attention(
    B: Backend,
    x: Any,
    w: MLAWeights,
    d: MLADims,
    batch: Batch,
    kv: Any,
    layer: int,
    rope: RopeSpec,
    scale: float,
    norm_eps: float,
) -> Any:
    """One layer's latent attention, absorbed form: x [n, width] -> [n, width]."""
    n = len(batch)
    xq = x if w.q_a is None else B.rms_norm(B.matmul(x, w.q_a), w.q_a_norm, norm_eps)
    q_nope = B.reshape(B.matmul(xq, w.q_nope), (n, d.heads, d.nope))
    q_rope = B.rope(B.reshape(B.matmul(xq, w.q_rope), (n, d.heads, d.rope)), batch.positions, rope)
    latent = B.rms_norm(B.matmul(x, w.kv_latent), w.kv_norm, norm_eps)
    k_rope = B.rope(B.reshape(B.matmul(x, w.k_rope), (n, 1, d.rope)), batch.positions, rope)
    q_latent = B.head_matmul(q_nope, w.k_b)
    out = B.mla_attention(q_latent, q_rope, latent, B.reshape(k_rope, (n, d.rope)), kv, layer, batch, scale)
    out = B.head_matmul(out, w.v_b)
    return B.matmul(B.reshape(out, (n, d.heads * d.v)), w.o)
