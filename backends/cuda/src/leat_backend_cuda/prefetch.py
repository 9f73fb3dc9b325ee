"""Weights asked into the L2 cache ahead of the products that read them, in captured decode steps.

A one-token decode step alternates products, which wait on DRAM, with kernels that barely touch it (RoPE and the
cache write, attention, its combine): while those run, DRAM is idle. A captured step is the same launches in the
same order every time, so the order in which it reads its weights is known: the eager run before a capture
records it (:meth:`Schedule.read`, :meth:`Schedule.point`), and each prefetch point of the captured run then asks
the L2 cache for the next ``budget`` bytes of that order not asked for yet (the ``prefetch_l2`` kernel, one
``cp.async.bulk.prefetch.L2`` a range). A prefetch is a hint: nothing waits for it and no value depends on it.

A product launch reads its segments (q, k, v of one launch) one after another and, within a segment, its
regions side by side (the gate and up matrices of the gated unit; the planes of a planar type), from their first
rows to their last: the byte stream is cut in that order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

#: bytes a prefetch range is cut into (one bulk prefetch a thread; 16-byte multiples, as the instruction asks)
RANGE_BYTES = int(os.environ.get("LEAT_CUDA_PREFETCH_RANGE_KB", "64")) * 1024


@dataclass
class Read:
    """One product launch's weights: segments read one after another, each a list of (address, bytes) regions
    read side by side at the same pace."""

    segments: list[list[tuple[int, int]]]

    def segment_bytes(self) -> list[int]:
        return [sum(size for _, size in regions) for regions in self.segments]


@dataclass
class Schedule:
    """A decode step's weight reads and prefetch points, in launch order; :meth:`ranges` turns them into what
    each point asks for. ``budget``: bytes the L2 cache is asked to hold ahead of the products reading them."""

    budget: int
    events: list[Read | int] = field(default_factory=list)  # a Read, or a point's index
    points: int = 0

    def read(self, read: Read) -> None:
        self.events.append(read)

    def point(self) -> None:
        self.events.append(self.points)
        self.points += 1

    def ranges(self) -> list[list[tuple[int, int]]]:
        """For each point, in order, the (address, bytes) ranges it asks for: the byte stream of the reads after
        it, from where the previous points stopped asking up to ``budget`` bytes past the point."""
        spans: list[tuple[int, int, list[tuple[int, int]]]] = []  # (stream start, bytes, regions) per segment
        at_point: list[int] = []
        stream = 0
        for event in self.events:
            if isinstance(event, Read):
                for regions, size in zip(event.segments, event.segment_bytes()):
                    if size:
                        spans.append((stream, size, regions))
                        stream += size
            else:
                at_point.append(stream)
        asked, out = 0, []
        for start in at_point:
            end = min(stream, start + self.budget)
            out.append(_cut(spans, max(asked, start), end))
            asked = max(asked, end)
        return out


def _cut(spans: list[tuple[int, int, list[tuple[int, int]]]], begin: int, end: int) -> list[tuple[int, int]]:
    """The regions' bytes of stream positions [begin, end), as ranges of at most RANGE_BYTES (16-byte aligned)."""
    out: list[tuple[int, int]] = []
    for start, size, regions in spans:
        lo, hi = max(begin, start), min(end, start + size)
        if lo >= hi:
            continue
        for address, length in regions:
            first = address + (length * (lo - start) // size) // 16 * 16
            last = address + (length * (hi - start) // size) // 16 * 16
            for at in range(first, last, RANGE_BYTES):
                out.append((at, min(RANGE_BYTES, last - at)))
    return out
