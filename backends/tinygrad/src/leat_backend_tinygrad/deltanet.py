"""The gated delta-net (:mod:`leat.deltanet`) as tinygrad Tensor operations: a chunk of tokens at once, no loop over them.

Per value head, with the state entering the chunk ``S0`` [d (value), d (key)], the decays' running sums
``G_i = sum_{j<=i} log g_j`` and ``R_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above the diagonal), the token-by-token
recurrence of :func:`leat.deltanet.run` unrolls (the chunkwise form of the gated delta rule) to

* ``u_i = b_i (v_i - g_i S_{i-1} k_i)``, the rows of ``U = (I + M)^-1 (b * V - b * exp(G) * K S0^T)`` with
  ``M_ij = b_i R_ij (k_i . k_j)`` for ``j < i``: a unit lower-triangular system, inverted by doubling blocks
  (``_unit_lower_inverse``);
* the outputs ``O = exp(G) * Q S0^T + (R * Q K^T) U``;
* the state after the chunk ``exp(G_t) S0 + U^T (R_t. * K)``.

Tokens past ``valid`` (a padded prefill chunk's) get ``g = 1`` and ``b = 0``: they leave the state as it was.

:class:`RecurrentState` is the backend's ``gated_delta_net``, the states kept with the KV cache
(:class:`~leat_backend_tinygrad.kv.KVCache`'s ``recurrent``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from leat.batch import Batch, Row
from leat.deltanet import DeltaNet
from leat.errors import LeatError
from tinygrad import Tensor


def _block_diagonal(m: Tensor, size: int) -> Tensor:
    """The diagonal blocks [..., P / size, size, size] of m [..., P, P] (movement ops only: the (b, b) block of the
    [nb * nb] blocks is at b * (nb + 1))."""
    *lead, p, _ = m.shape
    nb = p // size
    blocks = m.reshape(*lead, nb, size, nb, size).permute(*range(len(lead)), -4, -2, -3, -1)
    flat = blocks.reshape(*lead, nb * nb, size, size).pad(((0, 0),) * len(lead) + ((0, nb), (0, 0), (0, 0)))
    return flat.reshape(*lead, nb, nb + 1, size, size)[..., 0, :, :]


def _unit_lower_inverse(m: Tensor) -> Tensor:
    """(I + m)^-1 for m [..., t, t] strictly lower triangular: block inverses of twice the size from the last ones,
    ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``, over t padded to a power of two (log2 t steps)."""
    *lead, t, _ = m.shape
    p = 1 << max(t - 1, 0).bit_length()
    if p > t:
        m = m.pad(((0, 0),) * len(lead) + ((0, p - t), (0, p - t)))
    x, s = Tensor.ones(*lead, p, 1, 1, device=m.device), 1
    while s < p:
        below = _block_diagonal(m, 2 * s)[..., s:, :s]  # [..., p / 2s, s, s]
        pairs = x.reshape(*lead, p // (2 * s), 2, s, s)
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
        top = first.pad(((0, 0),) * (len(lead) + 2) + ((0, s),))
        x = top.cat((-(second @ below @ first)).cat(second, dim=-1), dim=-2).contiguous()
        s *= 2
    return x.reshape(*lead, p, p)[..., :t, :t]


def conv_silu(padded: Tensor, conv: Tensor, t: int) -> Tensor:
    """The depthwise causal convolution and SiLU: padded [..., kernel - 1 + t, channels] (the state's last inputs, then
    the chunk's), conv [channels, kernel] -> [..., t, channels]."""
    kernel = conv.shape[1]
    x = sum((padded[..., j : j + t, :] * conv[:, j] for j in range(1, kernel)), padded[..., :t, :] * conv[:, 0])
    return x.silu()


def chunk(
    net: DeltaNet, x: Tensor, alpha: Tensor, beta: Tensor, dt_bias: Tensor, a: Tensor, s0: Tensor, valid=None
) -> tuple[Tensor, Tensor]:
    """x [r, t, channels] (after conv_silu), alpha and beta [r, t, v_heads], s0 [r, v_heads, d, d] -> the outputs
    [r, t, v_heads, d] and the state after the chunk; ``valid`` (a [1] Tensor) the real tokens of a padded chunk."""
    r, t, _ = x.shape
    kh, h, d = net.k_heads, net.v_heads, net.head_dim
    width = kh * d

    def heads(y: Tensor, n: int) -> Tensor:  # [r, t, n * d] -> [r, h, t, d]; value head i reads key head i % kh
        y = y.reshape(r, t, n, d)
        return (y.repeat(1, 1, h // n, 1) if n != h else y).permute(0, 2, 1, 3)

    q, k, v = heads(x[..., :width], kh), heads(x[..., width : 2 * width], kh), heads(x[..., 2 * width :], h)
    q = q / ((q * q).sum(-1, keepdim=True) + net.eps).sqrt() / math.sqrt(d)
    k = k / ((k * k).sum(-1, keepdim=True) + net.eps).sqrt()
    z = alpha + dt_bias
    log_g = (z.maximum(0) + ((-z.abs()).exp() + 1).log()) * a  # softplus(z) * a, [r, t, h]
    b = beta.sigmoid()
    if valid is not None:
        real = (Tensor.arange(t) < valid).reshape(1, t, 1)
        log_g, b = real.where(log_g, 0), real.where(b, 0)
    if t == 1:  # a decode step: the recurrence itself, S = g S + outer(b (v - g S k), k), out = S q
        g, b = log_g.exp().reshape(r, h, 1, 1), b.reshape(r, h, 1, 1)
        q, k, v = q.reshape(r, h, 1, d), k.reshape(r, h, 1, d), v.reshape(r, h, d, 1)
        state = g * s0
        state = state + b * (v - (state * k).sum(-1, keepdim=True)) * k
        return (state * q).sum(-1).reshape(r, 1, h, d), state
    g_sum = log_g.permute(0, 2, 1).cumsum(-1)  # [r, h, t]
    b = b.permute(0, 2, 1)
    i, j = Tensor.arange(t).reshape(t, 1), Tensor.arange(t).reshape(1, t)
    decay = (j <= i).where(g_sum.unsqueeze(-1) - g_sum.unsqueeze(-2), -math.inf).exp()  # R [r, h, t, t]
    m = (j < i).where(b.unsqueeze(-1) * decay * (k @ k.transpose(-1, -2)), 0)
    gamma = g_sum.exp().unsqueeze(-1)
    s0t = s0.transpose(-1, -2)  # [r, h, key, value]
    u = _unit_lower_inverse(m) @ (b.unsqueeze(-1) * (v - gamma * (k @ s0t)))
    out = gamma * (q @ s0t) + (decay * (q @ k.transpose(-1, -2))) @ u
    last = decay[..., t - 1, :].unsqueeze(-1)  # R_t. [r, h, t, 1]
    state = gamma[..., t - 1, :].unsqueeze(-1) * s0 + u.transpose(-1, -2) @ (last * k)
    return out.permute(0, 2, 1, 3), state


class RecurrentState:
    """Backend.gated_delta_net for :class:`~leat_backend_tinygrad.backend.TinygradBackend` (a mixin: it uses the
    backend's ``device``, ``allocations``, ``_tensor``, ``_values``, ``_nets`` and ``_stepping``).

    Eagerly, each row reads its slot's state (zeros at position 0) and writes it back once the outputs are realized.
    In a jitted step (:meth:`run`) the slot is a bound Variable and a row at position 0 is told by the step's
    positions; the writes wait for the step's output (``_Step.pending``), and run() checks and advances the
    positions taken for the whole step. A verified draft (a row of several tokens that wants every position's logits)
    runs eagerly and keeps the state before it and its inputs (``KVCache.drafts``); a later row starting inside it
    rewinds the slot's state to there first, by running the kept prefix again from the kept state."""

    def _net(self, net: DeltaNet) -> tuple[Tensor, Tensor, Tensor]:
        if net not in self._nets:
            self._nets[net] = tuple(
                self._tensor(np.array(w, np.float32)).realize() for w in (net.conv, net.dt_bias, net.a)
            )
        return self._nets[net]

    def _drafting(self, row: Row) -> bool:
        """Whether the row may be a verified draft, which a later row may rewind into: several tokens that want every
        position's logits, other than a jitted prefill chunk's length (a prompt's, as Model.logits asks)."""
        return row.all_logits and len(row.tokens) > 1 and len(row.tokens) not in self.prefill_lengths

    def _enter(self, kv: Any, layers: list[int], rows: list[Row]) -> None:
        """Check that each row starts a sequence, continues its slot's state or starts inside its last verified draft
        (the state then rewound to there)."""
        for layer in layers:
            taken = kv.recurrent[layer][2]
            for row in rows:
                if row.start in (0, taken[row.slot]):
                    continue
                draft = kv.drafts.get((layer, row.slot))
                if draft is None or not draft[0] < row.start < taken[row.slot]:
                    raise LeatError(
                        f"slot {row.slot} of recurrent layer {layer} holds the state after {taken[row.slot]} "
                        f"positions, and a recurrent state cannot continue at position {row.start}"
                    )
                self._rewind(kv, layer, row.slot, row.start - draft[0], draft)

    def _rewind(self, kv: Any, layer: int, slot: int, kept: int, draft: tuple) -> None:
        """The slot's state after the first ``kept`` tokens of its last verified draft."""
        _, net, tail, state, mixed, alpha, beta = draft
        conv, dt_bias, a = self._net(net)
        tails, states, taken = kv.recurrent[layer]
        padded = tail.cat(mixed[:kept].unsqueeze(0), dim=1)
        x = conv_silu(padded, conv, kept)
        _, new = chunk(net, x, alpha[:kept].unsqueeze(0), beta[:kept].unsqueeze(0), dt_bias, a, state)
        new_tail, new = padded[:, kept : kept + net.kernel - 1].contiguous(), new.contiguous()
        Tensor.realize(new_tail, new)
        tails[slot : slot + 1].assign(new_tail).realize()
        states[slot : slot + 1].assign(new).realize()
        taken[slot] = draft[0] + kept

    def _took(self, kv: Any, layers: list[int], rows: list[Row]) -> None:
        for layer in layers:
            for row in rows:
                kv.recurrent[layer][2][row.slot] = row.start + len(row.tokens)
                if not self._drafting(row):
                    kv.drafts.pop((layer, row.slot), None)

    def gated_delta_net(
        self, mixed: Any, alpha: Any, beta: Any, net: DeltaNet, kv: Any, layer: int, batch: Batch
    ) -> Tensor:
        mixed, alpha, beta = self._values(mixed), self._values(alpha), self._values(beta)
        conv, dt_bias, a = self._net(net)
        if layer not in kv.recurrent:
            shapes = net.state_shapes
            zeros = [Tensor.zeros(kv.slots, *shape, device=self.device).contiguous().realize() for shape in shapes]
            kv.recurrent[layer] = (*zeros, np.zeros(kv.slots, np.int64))
            self.allocations.kv += sum(t.nbytes() for t in zeros)
        tails, states, _ = kv.recurrent[layer]
        step = self._stepping(batch)
        if step is None:
            self._enter(kv, [layer], batch.rows)
        # rows of one length go together (a decode step's); others one by one
        same = len({len(row.tokens) for row in batch.rows}) == 1
        groups = [list(range(len(batch.rows)))] if same else [[i] for i in range(len(batch.rows))]
        outs, writes, drafts = [], [], {}
        for group in groups:
            t, kernel = len(batch.rows[group[0]].tokens), net.kernel
            spans = [slice(int(batch.offsets[i]), int(batch.offsets[i]) + t) for i in group]
            where = [step.slots[i] if step else batch.rows[i].slot for i in group]
            tail, state = [tails[s : s + 1] for s in where], [states[s : s + 1] for s in where]
            for n, i in enumerate(group):
                if step is not None:  # the step's positions say whether the row starts a sequence
                    fresh = step.positions[int(batch.offsets[i])] == 0
                    tail[n], state[n] = fresh.where(0, tail[n]), fresh.where(0, state[n])
                elif batch.rows[i].start == 0:
                    tail[n], state[n] = tail[n].zeros_like(), state[n].zeros_like()
                if step is None and self._drafting(row := batch.rows[i]):  # the state before it, and its inputs
                    kept = (tail[n], state[n], mixed[spans[n]], alpha[spans[n]], beta[spans[n]])
                    drafts[row.slot] = (row.start, net, *(x.clone() for x in kept))  # copies, not views
            padded = Tensor.cat(*(p.cat(mixed[s].unsqueeze(0), dim=1) for p, s in zip(tail, spans)))
            x = conv_silu(padded, conv, t)
            alphas, betas = (Tensor.stack(*(y[s] for s in spans)) for y in (alpha, beta))
            valid = step.valid if step is not None else None
            out, new = chunk(net, x, alphas, betas, dt_bias, a, Tensor.cat(*state), valid)
            kept = padded[:, t : t + kernel - 1] if valid is None else padded[:, valid + Tensor.arange(kernel - 1)]
            outs.append(out.reshape(len(group) * t, net.v_heads, net.head_dim))
            for n, s in enumerate(where):
                writes += [
                    (tails[s : s + 1], kept[n : n + 1].contiguous()),
                    (states[s : s + 1], new[n : n + 1].contiguous()),
                ]
        out = (outs[0] if len(outs) == 1 else outs[0].cat(*outs[1:])).contiguous()
        kept = [x for draft in drafts.values() for x in draft[2:]]
        Tensor.realize(out, *(value for _, value in writes), *kept)  # they read the states before they are written
        if step is not None:
            step.pending += writes
            return out
        for target, value in writes:
            target.assign(value).realize()
        self._took(kv, [layer], batch.rows)
        kv.drafts.update({(layer, slot): draft for slot, draft in drafts.items()})
        return out
