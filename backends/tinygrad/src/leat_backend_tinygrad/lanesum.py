"""Sums (and maxima) over the threads ("lanes") of a thread group that share a result, in few steps instead of
tinygrad's GROUP_REDUCE.

tinygrad lowers a GROUP_REDUCE over n threads to: each thread's value into local memory, a barrier, then every thread
loads all n values and adds them (one thread stores the result). That is n local loads a thread for each sum: for
``gemv.py``'s gated unit (64 lanes an output, four sums a thread: gate and up of two outputs) 256 loads a thread, 512
load instructions a thread group of two warps, for ~9 KB of weights; for ``norm.py``'s row of 4096 (128 lanes) a
chain of 128 dependent loads in the one thread group of a decode step's norm; ``softmax.py``'s rows take a max and
then a sum over the same lanes (which tinygrad's GROUP_REDUCE cannot chain: ``Lanes.reduce``'s ``after``).

Here (``MODES``): the lanes of a result within one warp (32 threads) add their values as a butterfly, log2(lanes)
exchanges with the lane whose index differs in one bit, after which every lane holds the sum ("shuffle": CUDA's
``__shfl_xor_sync``, a register exchange; "local": the same exchanges through local memory, for any device with thread
groups, which is how the butterfly's arithmetic is tested on tinygrad's PYTHON device); a result of more lanes than a
warp adds its warps' sums with a GROUP_REDUCE over the warps (2 or 4 loads a thread). "group" keeps tinygrad's
GROUP_REDUCE over all lanes. The lanes of a result must be the group's fastest thread indices: tinygrad makes the
ranges of the lowest ids the fastest (``codegen/gpudims.py``: threadIdx.x first, merged dims whole), so the lanes'
ranges take ids below the warps' and any other thread range's, and a result's lanes in a warp are one aligned run of
a power of two (its butterfly never leaves it). The default is "shuffle" where the renderer is CUDA's, else "group"
(``LEAT_TINYGRAD_LANE_SUM`` chooses; devices without thread groups always reduce in a loop).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from tinygrad import Device, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.renderer.cstyle import CUDARenderer
from tinygrad.uop.ops import AxisType, Ops

WARP = 32  # threads of a warp (NVIDIA's; the butterfly stays within 32 lanes on any device)
MODES = ("shuffle", "local", "group")
_SHUFFLE = "__shfl_xor_sync({mask:#x}u, {{0}}, {bit})"
SLOTS = 1000  # our buffers' slots start here, our loops' ids at 2 SLOTS (tinygrad numbers its own by axis id, below)


def mode(device: str) -> str:
    """The way lanes are summed on ``device``: ``LEAT_TINYGRAD_LANE_SUM`` if set, else "shuffle" where the renderer is
    CUDA's, else "group" (always on a device without thread groups, where the lanes are a loop)."""
    renderer = Device[device].renderer
    chosen = os.environ.get("LEAT_TINYGRAD_LANE_SUM", "shuffle" if isinstance(renderer, CUDARenderer) else "group")
    if chosen not in MODES:
        raise ValueError(f"LEAT_TINYGRAD_LANE_SUM={chosen!r}: use one of {', '.join(MODES)}")
    if not renderer.has_local:
        return "group"  # no thread groups: the lanes are a loop whatever the setting
    if chosen == "shuffle" and not isinstance(renderer, CUDARenderer):
        raise ValueError(f"LEAT_TINYGRAD_LANE_SUM=shuffle needs CUDA's renderer, not {type(renderer).__name__}")
    return chosen


@dataclass
class Lanes:
    """The lanes of a result: ``ranges`` its thread ranges within a warp, outermost first (every lane's, as a
    GROUP_REDUCE's or a loop's, in "group" mode or without thread groups), ``warps`` a GROUP_REDUCE range over its
    warps where it has several (the caller's outermost range split in two), ``sizes`` the caller's ranges' sizes;
    ``outer`` the thread group's other thread ranges (its other results), which "local" mode's slots tell apart."""

    mode: str
    ranges: list[UOp]
    warps: UOp | None
    sizes: tuple[int, ...]
    outer: list[UOp] = field(default_factory=list)
    slots: int = 0  # local and register buffers made

    @staticmethod
    def make(sizes: tuple[int, ...], first_id: int, kind: str, local: bool) -> Lanes:
        """Ranges for lanes of ``sizes`` (outermost first) with ids from ``first_id`` up, the innermost the lowest:
        ``first_id + len(sizes)`` is the first id not taken. ``kind``: one of MODES, "group" where the lanes are not
        a power of two; ``local``: the device has thread groups (else every lane range is a loop)."""
        count = math.prod(sizes)
        warps = max(count // WARP, 1)
        # the butterfly needs a power of two of lanes, the warps a split of the outermost range; else the group reduce
        if not local or kind == "group" or count & (count - 1) or sizes[0] % warps:
            axis = AxisType.GROUP_REDUCE if local else AxisType.REDUCE
            ranges = [UOp.range(n, first_id + len(sizes) - 1 - i, axis) for i, n in enumerate(sizes)]
            return Lanes("group" if local else "loop", ranges, None, sizes)
        inner = (sizes[0] // warps, *sizes[1:])
        ranges = [UOp.range(n, first_id + len(inner) - 1 - i, AxisType.LOCAL) for i, n in enumerate(inner)]
        warp = UOp.range(warps, first_id + len(inner), AxisType.GROUP_REDUCE) if warps > 1 else None
        return Lanes(kind, ranges, warp, sizes)

    def at(self, i: int) -> UOp:
        """The caller's range ``i`` (of ``sizes``), as an index (the outermost put together from its two parts)."""
        if self.warps is not None and i == 0:
            return self.warps * (self.sizes[0] // _size(self.warps)) + self.ranges[0]
        return self.ranges[i]

    def gate(self, index: UOp, condition: UOp | None = None) -> UOp:
        """``index`` gated for a result's store: to ``condition`` where given and, where every lane holds the sum
        (the butterfly), to the result's first lane in its warp (a GROUP_REDUCE gates its own stores)."""
        if self.mode in ("shuffle", "local"):
            for r in self.ranges:
                condition = r.eq(0) if condition is None else condition & r.eq(0)
        return index if condition is None else index.valid(condition)

    def threads(self) -> tuple[UOp, ...]:
        """Every range of the lanes (a store of each lane's own values ends them all)."""
        return (*self.ranges, *([self.warps] if self.warps is not None else []))

    def ends(self) -> tuple[UOp, ...]:
        """The lane ranges a result's store must end (a reduce ends its own)."""
        return tuple(self.ranges) if self.mode in ("shuffle", "local") else ()

    def sum(self, value: UOp, *loops: UOp) -> UOp:
        """``value`` (a lane's float32) summed over ``loops`` (REDUCE ranges of the lane's own) and the lanes."""
        return self.reduce(value, *loops)

    def reduce(self, value: UOp, *loops: UOp, op: Ops = Ops.ADD, after: bool = False) -> UOp:
        """``value`` (a lane's float32) reduced by ``op`` (ADD or MAX) over ``loops`` (REDUCE ranges of the lane's own)
        and the lanes. ``after``: ``value`` reads an earlier reduce over these lanes, so this one's last step over
        threads is a loop of its own (tinygrad merges the loops of two group reduces over the same threads, and
        one that reads the other's result then fails in ``merge_reduce_ends``)."""
        if self.mode == "loop":
            assert not after, "a reduce after another over the same loop ranges: tinygrad merges their loops"
            return value.reduce(*loops, *self.ranges, arg=op)
        if self.mode == "group" and not after:
            return value.reduce(*loops, *self.ranges, arg=op)
        ones = {r: r.const_like(0) for r in loops if _size(r) == 1}  # a range of one: its only index, no reduce
        value, loops = value.substitute(ones) if ones else value, tuple(r for r in loops if r not in ones)
        total = value.reduce(*loops, arg=op) if loops else value
        if self.mode == "group":  # every lane's value to local memory, then each thread reduces them all
            return self._across(total, list(self.ranges), op)
        within = math.prod(_size(r) for r in self.ranges)
        bit = 1
        while bit < within:
            total = total.alu(op, self._exchange(total, bit))
            bit *= 2
        if self.warps is None:
            return total
        return self._across(total, [self.warps], op) if after else total.reduce(self.warps, arg=op)

    def _slot(self) -> int:
        self.slots += 1
        return SLOTS + self.slots - 1

    def _placement(self) -> tuple[UOp, list[UOp], int]:
        """A thread's slot in a local buffer of one value a thread (its lanes' index lowest, the innermost range
        fastest, then the warp, then the other thread ranges), those ranges, and their count."""
        threads = [*reversed(self.ranges), *([self.warps] if self.warps is not None else []), *self.outer]
        here, stride = None, 1
        for r in threads:
            here = r * stride if here is None else here + r * stride
            stride *= _size(r)
        assert here is not None
        return here, threads, stride

    def _across(self, value: UOp, over: list[UOp], op: Ops) -> UOp:
        """``value`` reduced by ``op`` across the threads of ranges ``over`` (the others' alike): each thread's value
        into local memory, then each thread reduces those of its ``over`` fellows in a loop of fresh ranges."""
        here, threads, count = self._placement()
        slot = self._slot()
        shared = UOp.placeholder((count,), dtypes.float32, slot, AddrSpace.LOCAL)
        written = shared.index(here).store(value).end(*threads)
        loops = [UOp.range(_size(r), 2 * SLOTS + 8 * slot + i, AxisType.REDUCE) for i, r in enumerate(over)]
        at = here.substitute(dict(zip(over, loops)))
        return shared.after(written).index(at).reduce(*loops, arg=op)

    def _exchange(self, value: UOp, bit: int) -> UOp:
        """The value of the lane (of the same result and warp) whose index differs from this one's in ``bit``."""
        if self.mode == "shuffle":
            # the value put in a register of its own and loaded from it: tinygrad gives a CUSTOM op's operand no load
            # (a reduce's result would be its register's address) nor takes it out of a one-wide vector (an ALU's)
            register = UOp.placeholder((1,), dtypes.float32, self._slot(), AddrSpace.REG)
            loaded = register.after(register.index(0).store(value)).index(0).load()
            # the mask names the warp's threads: all 32, or a thread group of fewer (a partial warp's others do not exist)
            threads = math.prod(_size(r) for r in (*self.threads(), *self.outer))
            mask = (1 << threads) - 1 if threads < WARP else 0xFFFFFFFF
            return UOp(Ops.CUSTOM, dtypes.float32, (loaded,), arg=_SHUFFLE.format(mask=mask, bit=bit))
        # through local memory: the partner's slot is this one's with the lanes' index's bit flipped
        here, threads, count = self._placement()
        linear = None
        for r in self.ranges:
            linear = r if linear is None else linear * _size(r) + r
        assert linear is not None
        shared = UOp.placeholder((count,), dtypes.float32, self._slot(), AddrSpace.LOCAL)
        written = shared.index(here).store(value).end(*threads)
        return shared.after(written).index(here - linear + (linear ^ bit))


def _size(r: UOp) -> int:
    return int(r.vmax) + 1
