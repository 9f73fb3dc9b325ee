"""A prompt chunk's attention probabilities as one tinygrad kernel of our own (a UOp program, ``Tensor.custom_kernel``,
as ``norm.py``).

``p[h, i, t] = exp(s[h, i, t] - m) / (sum_t exp(s[h, i, t] - m) + exp(sink[h] - m))`` where ``s`` is the chunk's
scores times ``scale`` (soft-capped where a cap is given), -inf where key position t is past query i's own position
or, in a windowed layer, ``window`` or more positions before it, and ``m`` the row's max (with the sink, where sinks
are given). tinygrad's own schedule of these Tensor ops is three kernels over the scores (the max, the exponents'
sum, the probabilities), the first two reductions a thread group of few threads looping over a row's values: on
the H200 the 8B file's 512-token chunk spent 10.8 ms of its ~112 in them (docs/benchmarks.md, eighteenth session).
Here a thread group (a CUDA block) is a row: each of its ``lanes(total)`` threads loads its values once (neighbouring
threads neighbouring values: one 128-byte load a warp), the group takes their max and then their exponents' sum
(``lanesum.py``: warp shuffles on CUDA, local memory elsewhere), and each thread writes the probabilities of the
values it holds. Devices without local memory (tinygrad's CPU device) keep the Tensor ops.
"""

from __future__ import annotations

import math

from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.dtype import DType
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from leat_backend_tinygrad import lanesum

FEWEST_LANES, MOST_LANES = 32, 128  # threads a row
FEW_VALUES, MOST_VALUES = 16, 64  # values a thread: lanes double while past FEW_VALUES; past MOST_VALUES, no kernel


def lanes(total: int) -> int | None:
    """Threads of a row of ``total`` values: 32, doubled (up to 128) while a thread would hold more than FEW_VALUES;
    None where a thread would hold more than MOST_VALUES (a long context keeps tinygrad's kernels)."""
    n = FEWEST_LANES
    while -(-total // n) > FEW_VALUES and n < MOST_LANES:
        n *= 2
    return n if -(-total // n) <= MOST_VALUES else None


def applies(device: str, total: int) -> bool:
    """Whether a chunk attending ``total`` key positions takes the kernel: a device with local memory, few enough."""
    return Device[device].renderer.has_local and lanes(total) is not None


def _kernel(kv_heads, group, length, total, offset, scale, softcap, window, sinks, kind: DType, lane_sum: str):
    n = lanes(total)
    assert n is not None
    per = -(-total // n)

    def fxn(out: UOp, scores: UOp, positions: UOp, *sink: UOp) -> UOp:
        kv_head, g = UOp.range(kv_heads, 0, AxisType.GLOBAL), UOp.range(group, 1, AxisType.GLOBAL)
        query = UOp.range(length, 2, AxisType.GLOBAL)
        threads = lanesum.Lanes.make((n,), 3, lane_sum, True)
        lane = threads.at(0)
        own = positions[query + offset].cast(dtypes.weakint)
        keys = [lane + s * n for s in range(per)]  # the thread's key positions: neighbouring lanes, neighbours
        inside = [None if (s + 1) * n <= total else t < total for s, t in enumerate(keys)]  # the last may pass total
        values = []
        for t, within in zip(keys, inside):
            seen = t <= own
            if window is not None:
                seen = seen & (t > own - window)
            x = scores[kv_head, g, query, t.valid(seen if within is None else seen & within)] * scale  # none unseen
            if softcap is not None:
                x = (x / softcap).tanh() * softcap
            values.append((seen if within is None else seen & within).where(x, -math.inf))
        peak = values[0]
        for v in values[1:]:
            peak = peak.maximum(v)
        peak = threads.reduce(peak, op=Ops.MAX)
        if sinks:
            peak = peak.maximum(sink[0][kv_head * group + g])
        exps = [(v - peak).exp() for v in values]
        denominator = threads.reduce(sum(exps[1:], exps[0]), after=True)  # reads the max's result
        if sinks:
            denominator = denominator + (sink[0][kv_head * group + g] - peak).exp()
        inverse = 1.0 / denominator
        stores = []
        for t, within, e in zip(keys, inside, exps):
            at = t if within is None else t.valid(within)
            stores.append(out[kv_head, g, query, at].store((e * inverse).cast(kind)))
        return UOp.sink(
            UOp.group(*stores).end(kv_head, g, query, *threads.threads()),
            arg=KernelInfo(name=f"softmax_{kv_heads * group}_{length}_{total}", opts_to_apply=()),
        )

    return fxn


def probabilities(
    scores: Tensor,
    positions: Tensor,
    offset: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    kind: DType = dtypes.float32,
) -> Tensor:
    """``kind`` [kv_heads, group, length, total]: each query's attention probabilities over key positions 0 ..
    total - 1, for each query head (a KV head's GQA group of them).

    ``scores`` [kv_heads, group, length, total] float32, q . k before ``scale`` (a product's output as it is: a
    reshape of it made contiguous would be a copy); ``positions`` int32, query i's position at ``offset + i`` (it
    sees key positions up to its own, or its last ``window`` of them); ``sinks`` [kv_heads * group] float32, each
    head's extra logit in its softmax's denominator. Every row sees at least its own position."""
    kv_heads, group, length, total = scores.shape
    out = Tensor.empty(kv_heads, group, length, total, dtype=kind, device=scores.device)
    extra = [sinks.reshape(kv_heads * group).cast(dtypes.float32).contiguous()] if sinks is not None else []
    lane_sum = lanesum.mode(scores.device)
    fxn = _kernel(kv_heads, group, length, total, offset, scale, softcap, window, sinks is not None, kind, lane_sum)
    inputs = (scores.cast(dtypes.float32).contiguous(), positions.cast(dtypes.int32).contiguous(), *extra)
    return out.custom_kernel(*inputs, fxn=fxn)[0]
