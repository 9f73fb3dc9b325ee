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

from leat.architecture import Weights
from leat.backend import Backend, KVLayout, RopeSpec
from leat.batch import Batch
from leat.blocks import layer_tensor

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


def load_mla(weights: Weights, layer: int, d: MLADims, width: int, split: bool = True) -> MLAWeights:
    """One layer's attention tensors, with their shapes for model width ``width``; ``split``: the file has attn_k_b
    and attn_v_b (MLA GGUFs), else the older attn_kv_b, split and transposed here."""
    per_head = np.arange(d.heads)[:, None] * (d.nope + d.rope)
    q_a = weights(name(T.ATTN_Q_A, layer), (d.q_rank, width)) if d.q_rank else None
    q_a_norm = weights(name(T.ATTN_Q_A_NORM, layer), (d.q_rank,)) if d.q_rank else None
    q_name, q_shape = (
        name(T.ATTN_Q_B if d.q_rank else T.ATTN_Q, layer),
        (d.heads * (d.nope + d.rope), d.q_rank or width),
    )
    kv_a, kv_a_shape = name(T.ATTN_KV_A_MQA, layer), (d.kv_rank + d.rope, width)
    w = MLAWeights(
        q_a=q_a,
        q_a_norm=q_a_norm,
        q_nope=weights.rows(q_name, q_shape, (per_head + np.arange(d.nope)).ravel()),
        q_rope=weights.rows(q_name, q_shape, (per_head + d.nope + np.arange(d.rope)).ravel()),
        kv_latent=weights.rows(kv_a, kv_a_shape, np.arange(d.kv_rank)),
        k_rope=weights.rows(kv_a, kv_a_shape, d.kv_rank + np.arange(d.rope)),
        kv_norm=weights(name(T.ATTN_KV_A_NORM, layer), (d.kv_rank,)),
        k_b=None,
        v_b=None,
        o=weights(name(T.ATTN_OUT, layer), (width, d.heads * d.v)),
    )
    if split:
        w.k_b = weights(name(T.ATTN_K_B, layer), (d.heads, d.kv_rank, d.nope))
        w.v_b = weights(name(T.ATTN_V_B, layer), (d.heads, d.v, d.kv_rank))
    else:
        kv_b = weights.host(name(T.ATTN_KV_B, layer), (d.heads * (d.nope + d.v), d.kv_rank))
        kv_b = kv_b.reshape(d.heads, d.nope + d.v, d.kv_rank)
        w.k_b = weights.array(name(T.ATTN_K_B, layer), kv_b[:, : d.nope].transpose(0, 2, 1))
        w.v_b = weights.array(name(T.ATTN_V_B, layer), kv_b[:, d.nope :])
    return w


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
