"""The gated delta-net: linear attention with a recurrent state per sequence (Qwen3.5's and Qwen3-Next's linear
layers), as :meth:`leat.backend.Backend.gated_delta_net` runs it, and its reference in numpy.

Per token, as llama.cpp's ``ggml_ssm_conv`` and ``ggml_gated_delta_net`` compute it: the qkv projection passes a
depthwise causal convolution over the last ``kernel`` tokens (the slot's state keeps the ``kernel - 1`` before a
step), then SiLU, and splits into q and k [k_heads, head_dim] and v [v_heads, head_dim]. q and k are L2-normed
(``x / sqrt(sum(x^2) + eps)``) and q scaled by ``1 / sqrt(head_dim)``; value head h reads key head ``h % k_heads``.
With the decay ``g = exp(softplus(alpha + dt_bias) * a)`` and ``b = sigmoid(beta)`` per value head, the state
S [v_heads, head_dim (value), head_dim (key)] becomes ``S * g``, then ``S + outer(b * (v - S k), k)``, and the
output is ``S q`` [v_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class DeltaNet:
    """One gated delta-net layer: its heads, and the small weights the recurrence reads, on the host in float32
    (backends take them as they like): ``conv`` [channels, kernel] with channels the q, k and v widths in that
    order, ``dt_bias`` and ``a`` (negative decay rates) [v_heads]."""

    k_heads: int
    v_heads: int
    head_dim: int
    conv: np.ndarray
    dt_bias: np.ndarray
    a: np.ndarray
    eps: float

    @property
    def kernel(self) -> int:
        return int(self.conv.shape[1])

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """What one slot keeps: the convolution's last inputs [kernel - 1, channels], the state [v_heads, d, d]."""
        return (self.kernel - 1, int(self.conv.shape[0])), (self.v_heads, self.head_dim, self.head_dim)


def run(
    net: DeltaNet, mixed: np.ndarray, alpha: np.ndarray, beta: np.ndarray, tail: np.ndarray, state: np.ndarray
) -> np.ndarray:
    """One sequence's tokens through ``net`` in the dtype of ``state``: ``mixed`` [t, channels] (the qkv projection),
    ``alpha`` and ``beta`` [t, v_heads] (theirs); ``tail`` and ``state`` (:attr:`DeltaNet.state_shapes`) are the
    sequence's, updated in place. Returns [t, v_heads, head_dim]."""
    dtype, t, d = state.dtype, len(mixed), net.head_dim
    padded = np.concatenate([tail, mixed.astype(dtype)])
    conv = net.conv.astype(dtype)
    x = sum(padded[j : j + t] * conv[:, j] for j in range(net.kernel))
    tail[:] = padded[t:]
    x = x / (1 + np.exp(-x))
    width = net.k_heads * d
    heads = np.arange(net.v_heads) % net.k_heads
    q = x[:, :width].reshape(t, net.k_heads, d)[:, heads]
    k = x[:, width : 2 * width].reshape(t, net.k_heads, d)[:, heads]
    v = x[:, 2 * width :].reshape(t, net.v_heads, d)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + net.eps) / np.sqrt(d)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + net.eps)
    decay = np.exp(np.logaddexp(0, alpha.astype(dtype) + net.dt_bias) * net.a.astype(dtype))
    b = 1 / (1 + np.exp(-beta.astype(dtype)))
    out = np.empty((t, net.v_heads, d), dtype)
    for i in range(t):
        state *= decay[i, :, None, None]
        delta = (v[i] - np.einsum("hvk,hk->hv", state, k[i])) * b[i, :, None]
        state += delta[:, :, None] * k[i][:, None, :]
        out[i] = np.einsum("hvk,hk->hv", state, q[i])
    return out
