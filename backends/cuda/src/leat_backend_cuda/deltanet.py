"""The gated delta-net's recurrent state on the CUDA backend (``kernels/deltanet.cu``): Qwen3.5's linear layers.

Each recurrent layer keeps, per slot, the convolution's last ``kernel - 1`` inputs and the delta-net state in device
memory (made on the layer's first call, with the KV cache: ``KVCache.recurrent``). Two launches per layer: the
convolution (which also moves each slot's window on) and the recurrence; both read each token's slot and position
from the step's device arrays (``_token_rows``), so a decode step's graph replays them for whichever slots its
batch holds. A row continues its slot's state (a row at position 0 starts from zeros); the positions each slot has
taken in are checked on the host: by the op when it runs eagerly, by ``run`` (``_replaying``) before a graph
replays it. Prefill runs one warp per (value head, 32 state rows) through the chunk's tokens in order: correct,
and far from the device's peak on long prompts (a chunkwise form is the next step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from leat.batch import Batch, Row
from leat.deltanet import DeltaNet
from leat.errors import LeatError

from leat_backend_cuda.driver import DeviceArray, Memory, Module
from leat_backend_cuda.moe import _ready

STATE_DIMS = (8, 16, 32, 64, 128)  # head sizes instantiated (deltanet_recur's D: a lane keeps D floats)
CONV_KERNELS = (2, 3, 4)  # convolution widths instantiated
DELTANET_KERNELS = (
    ["sigmoid_mul"] + [f"deltanet_conv<{k}>" for k in CONV_KERNELS] + [f"deltanet_recur<{d}>" for d in STATE_DIMS]
)


def programs() -> list[tuple[str, list[str]]]:
    return [("deltanet.cu", DELTANET_KERNELS)]


@dataclass
class Recurrent:
    """One recurrent layer's states: ``tails`` [slots, kernel - 1, channels], ``states`` [slots, v_heads, d key,
    d value] (transposed: see deltanet.cu), and the positions each slot has taken in (host)."""

    tails: Memory
    states: Memory
    taken: np.ndarray


class RecurrentOps:
    """``gated_delta_net`` and ``sigmoid_mul`` for :class:`~leat_backend_cuda.backend.CUDABackend` (a mixin: it uses
    the backend's device, pools, module cache and ``_token_rows``)."""

    def _deltanet_module(self) -> Module:
        return self._module("deltanet", "deltanet.cu", DELTANET_KERNELS, {})

    def sigmoid_mul(self, gate: Any, x: Any) -> DeviceArray:
        gate, x = _ready(gate), _ready(x)
        out, n = self._empty(x.shape), x.size
        grid = (max(1, min(-(-n // 256), 8 * self.device.sm_count)),)
        self._deltanet_module()["sigmoid_mul"](grid, 256, gate, x, out, n, x.shape[-1], gate.shape[-1])
        return out

    def _net_weights(self, net: DeltaNet) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
        nets = self.__dict__.setdefault("_deltanets", weakref.WeakKeyDictionary())
        if net not in nets:
            nets[net] = tuple(self._permanent(w, "F32") for w in (net.conv, net.dt_bias, net.a))
        return nets[net]

    def _recurrent(self, kv: Any, layer: int, net: DeltaNet) -> Recurrent:
        if layer not in kv.recurrent:
            if self._capturing:
                raise LeatError(f"recurrent layer {layer}'s state was not made before the graph capture")
            memories = []
            for shape in net.state_shapes:
                memory = Memory(kv.slots * int(np.prod(shape)) * 4)
                self.device.fill(memory.ptr, 0, memory.nbytes)
                self.allocations.kv += memory.nbytes
                memories.append(memory)
            kv.recurrent[layer] = Recurrent(*memories, np.zeros(kv.slots, np.int64))
        return kv.recurrent[layer]

    def _continue(self, kv: Any, layers: list[int], rows: list[Row]) -> None:
        """Check that each row starts a sequence or continues its slot's, then count its tokens as taken in."""
        for layer in layers:
            taken = kv.recurrent[layer].taken
            for row in rows:
                if row.start not in (0, taken[row.slot]):
                    raise LeatError(
                        f"slot {row.slot} of recurrent layer {layer} holds the state after {taken[row.slot]} "
                        f"positions, and a recurrent state cannot continue at position {row.start}"
                    )
        for layer in layers:
            for row in rows:
                kv.recurrent[layer].taken[row.slot] = row.start + len(row.tokens)

    def _replaying(self, kv: Any, batch: Batch) -> None:
        """A graph is about to replay ``batch``: its rows continue every recurrent layer's states."""
        if getattr(kv, "recurrent", None):
            self._continue(kv, list(kv.recurrent), batch.rows)

    def gated_delta_net(
        self, mixed: Any, alpha: Any, beta: Any, net: DeltaNet, kv: Any, layer: int, batch: Batch
    ) -> DeviceArray:
        mixed, alpha, beta = _ready(mixed), _ready(alpha), _ready(beta)
        d, kernel, channels = net.head_dim, net.kernel, int(net.conv.shape[0])
        if d not in STATE_DIMS or kernel not in CONV_KERNELS:
            raise LeatError(
                f"the cuda backend's gated delta-net takes heads of {STATE_DIMS} and convolutions of {CONV_KERNELS} "
                f"tokens, not {d} and {kernel}: run this model with --backend cpu"
            )
        conv, dt_bias, a = self._net_weights(net)
        state = self._recurrent(kv, layer, net)
        if self._pool is self.pool:  # not a graph's capture (nor the eager run before it): run() checks replays
            self._continue(kv, [layer], batch.rows)
        slots, positions, _ = self._token_rows(batch)
        n, ops = len(batch), self._deltanet_module()
        x, out = self._empty((n, channels)), self._empty((n, net.v_heads, d))
        ops[f"deltanet_conv<{kernel}>"](
            (-(-channels // 128), n), 128, mixed, conv, slots, positions, state.tails, x, n, channels
        )
        grid = (n, net.v_heads, -(-d // 32))
        ops[f"deltanet_recur<{d}>"](
            grid, 32, x, alpha, beta, dt_bias, a, slots, positions, state.states, out, n, net.k_heads, net.v_heads,
            float(net.eps),
        )  # fmt: skip
        return out
