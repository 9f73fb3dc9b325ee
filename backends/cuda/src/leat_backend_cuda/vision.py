"""What images need on the CUDA backend (``kernels/vision.cu``): ``layer_norm``, gelu without an up projection, and
attention over rows marked ``bidirectional`` (an image's span in a prompt, a vision encoder's patches).

A bidirectional row's tokens write their K and V (ops.cu's ``kv_write``, as every row does), then each attends from
its window's start, counted from its own position as in causal attention, through the row's last position. Such
batches run eagerly (``CUDABackend.run`` captures no graph of them): an image comes once per prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from leat.batch import Batch
from leat.errors import LeatError

from leat_backend_cuda.driver import DeviceArray, Module
from leat_backend_cuda.moe import _ready

OPEN_LANES = (1, 2, 4, 8)  # dims per lane instantiated (DL): head dimensions up to 256
KV_KINDS = ("float", "u16", "i8")
VISION_KERNELS = ["layer_norm", "gelu"] + [f"attention_open<{kv}, {dl}>" for kv in KV_KINDS for dl in OPEN_LANES]


def programs() -> list[tuple[str, list[str]]]:
    return [("vision.cu", VISION_KERNELS)]


def last_positions(batch: Batch) -> np.ndarray:
    """Per token, the last position it attends to: its row's last in a bidirectional row, else its own."""
    return np.concatenate(
        [
            np.full(len(r.tokens), r.start + len(r.tokens) - 1)
            if r.bidirectional
            else r.start + np.arange(len(r.tokens))
            for r in batch.rows
        ]
    )


class VisionOps:
    """``layer_norm``, gelu alone and bidirectional attention for :class:`~leat_backend_cuda.backend.CUDABackend`
    (a mixin); the backend's ``gelu_mul`` and ``attention`` hand over to :meth:`_gelu` and :meth:`_attend_open`."""

    def _vision_module(self) -> Module:
        return self._module("vision", "vision.cu", VISION_KERNELS, {})

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> DeviceArray:
        x = _ready(x)
        cols = x.shape[-1]
        out = self._empty(x.shape)
        threads = max(32, min(256, -(-cols // 32) * 32))
        self._vision_module()["layer_norm"]((x.size // cols,), threads, x, weight, bias, out, cols, float(eps))
        return out

    def _gelu(self, gate: Any) -> DeviceArray:
        gate = _ready(gate)
        out = self._empty(gate.shape)
        n = gate.size
        self._vision_module()["gelu"]((max(1, min(-(-n // 256), 8 * self.device.sm_count)),), 256, gate, out, n)
        return out

    def _attend_open(
        self, q: Any, k: Any, v: Any, kv: Any, layer: int, batch: Batch, scale: float, softcap: float, sinks: Any
    ) -> DeviceArray:
        q, k, v = _ready(q), _ready(k), _ready(v)
        n, heads, dk = q.shape
        kv_heads, dv = v.shape[1], v.shape[2]
        dl = next((d for d in OPEN_LANES if 32 * d >= max(dk, dv)), None)
        if dl is None:
            raise LeatError(f"attention heads of {max(dk, dv)} dimensions exceed the kernel's {32 * OPEN_LANES[-1]}")
        slots, positions, _ = self._token_rows(batch)
        _, (kind, cache, per_slot) = self._write_kv(k, v, kv, layer, slots, positions)
        out = self._empty((n, heads * dv))
        sizes = (n, heads, kv_heads, dk, dv, per_slot, kv.page_size, kv.layouts[layer].window or 0)
        last = self._ints(last_positions(batch))
        kernel = self._vision_module()[f"attention_open<{kind}, {dl}>"]
        kernel(
            (-(-n * heads // 4),),
            128,
            q,
            *cache,
            slots,
            positions,
            last,
            out,
            *sizes,
            float(scale),
            float(softcap),
            sinks,
        )
        return out
