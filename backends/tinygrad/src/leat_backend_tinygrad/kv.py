"""The paged KV cache of the tinygrad backend: storage per layer on the device, page copies, the host
round trip of sessions, and the writes and gathers attention makes.

Storage rows are ``page * page_size + offset``; a slot's page table maps its positions to pages. KV writes
are ``assign``s into a shrunk view whose start is a bound tinygrad Variable (``kv_at``), so one compiled
kernel serves every position; a prompt chunk takes one write per run of pages that lie next to each other
in storage. q8_0 storage keeps int8 quants and one float16 scale per 32 values, rounded as ggml does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from leat.backend import KVPages
from tinygrad import Tensor, UOp, dtypes


@dataclass
class KVCache(KVPages):
    # per layer: [pages * page_size, kv_heads, dim] (float32, float16, or int8 for q8_0)
    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)
    dtype: str = "f32"
    k_scale: list[Tensor] = field(default_factory=list)  # q8_0: one f16 scale per 32 values
    v_scale: list[Tensor] = field(default_factory=list)
    # per recurrent layer (Backend.gated_delta_net): each slot's convolution inputs [slots, kernel - 1, channels] and
    # delta-net state [slots, v_heads, d, d] on the device, and the positions each slot has taken in (host)
    recurrent: dict[int, tuple[Tensor, Tensor, np.ndarray]] = field(default_factory=dict)
    # per (recurrent layer, slot): its last verified draft (start, net, state before it, its inputs), to rewind into
    drafts: dict[tuple[int, int], tuple] = field(default_factory=dict)

    def storages(self, group: int | None = None) -> list[Tensor]:
        """Every layer's storage, or only that of ``group``'s layers."""
        layers = range(len(self.k)) if group is None else self.layers_of(group)
        return [kind[layer] for kind in (self.k, self.v, self.k_scale, self.v_scale) if kind for layer in layers]


def _q8_0(x: Tensor) -> tuple[Tensor, Tensor]:
    """GGUF Q8_0 of the last axis in blocks of 32: d = max|x| / 127 (stored f16), q = round(x / d) half away from 0."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().max(axis=-1, keepdim=True) / 127
    scaled = (d > 0).where(blocks / d.maximum(1e-30), 0)
    q = scaled.sign() * (scaled.abs() + 0.5).floor()
    return q.cast(dtypes.int8).reshape(x.shape), d[..., 0].cast(dtypes.float16)


def _from_q8_0(q: Tensor, d: Tensor) -> Tensor:
    blocks = q.reshape(*q.shape[:-1], -1, 32).cast(dtypes.float32) * d.cast(dtypes.float32).unsqueeze(-1)
    return blocks.reshape(q.shape)


class PagedKV:
    """The Backend's KV methods for :class:`~leat_backend_tinygrad.backend.TinygradBackend` (a mixin: it uses
    the backend's ``device``, ``allocations``, ``_tensor``, ``_kv_at`` and ``_step``)."""

    def allocate_kv(self, layouts, slots, context, pages=None, page_size=16, dtype="f32", groups=None) -> KVCache:
        if dtype not in ("f32", "f16", "q8_0"):
            raise ValueError(f"KV dtype must be f32, f16 or q8_0, not {dtype!r}")
        kv = KVCache.create(layouts, slots, context, pages, page_size, groups, dtype=dtype)
        storage = {"f32": dtypes.float32, "f16": dtypes.float16, "q8_0": dtypes.int8}[dtype]
        for layer, layout in enumerate(layouts):
            dims = (layout.head_dim, layout.stored_value_dim)
            if dtype == "q8_0" and any(d % 32 for d in dims):
                raise ValueError(f"q8_0 KV needs head dimensions that are multiples of 32, not {dims[0]}")
            shapes = [(kv.layer_pages(layer) * page_size, layout.kv_heads, d) for d in dims]
            kv.k.append(Tensor.zeros(*shapes[0], dtype=storage, device=self.device).contiguous().realize())
            kv.v.append(Tensor.zeros(*shapes[1], dtype=storage, device=self.device).contiguous().realize())
            if dtype == "q8_0":
                for scales, (rows, heads, d) in ((kv.k_scale, shapes[0]), (kv.v_scale, shapes[1])):
                    scales.append(
                        Tensor.zeros(rows, heads, d // 32, dtype=dtypes.float16, device=self.device)
                        .contiguous()
                        .realize()
                    )
        self.allocations.kv += sum(t.nbytes() for t in kv.storages())
        return kv

    def kv_budget_bytes(self) -> int:
        if self.device.split(":")[0] in ("CPU", "PYTHON"):
            try:
                with open("/proc/meminfo") as f:
                    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
                return info["MemAvailable"] // 4
            except (OSError, KeyError, ValueError):
                pass
        return 2 << 30

    def _page_rows(self, kv: KVCache, pages: list[int]) -> np.ndarray:
        return (np.asarray(pages)[:, None] * kv.page_size + np.arange(kv.page_size)[None, :]).reshape(-1)

    def copy_page(self, kv: KVCache, source: int, target: int, group: int = 0) -> None:
        size = kv.page_size
        for storage in kv.storages(group):
            if storage.shape[-1]:
                storage[target * size : (target + 1) * size].assign(
                    storage[source * size : (source + 1) * size].contiguous()
                ).realize()

    def read_pages(self, kv: KVCache, pages: list[int], group: int = 0) -> list[np.ndarray]:
        rows = self._page_rows(kv, pages)
        out = []
        for storage in kv.storages(group):
            host = storage.numpy()
            out.append(host[rows].reshape(len(pages), kv.page_size, *host.shape[1:]))
        return out

    def write_pages(self, kv: KVCache, pages: list[int], contents: list[np.ndarray], group: int = 0) -> None:
        size = kv.page_size
        for storage, values in zip(kv.storages(group), contents, strict=True):
            if not storage.shape[-1]:
                continue
            for page, block in zip(pages, values):
                storage[page * size : (page + 1) * size].assign(self._tensor(block).cast(storage.dtype)).realize()

    def _write(self, storage: Tensor, at: int | UOp, values: Tensor, keep: Tensor | None = None) -> None:
        """values into storage rows at..at+len (one kernel for every ``at``: it is a bound variable); where ``keep``
        ([len, 1, 1] bool) is False, the row keeps what it holds."""
        start = self._kv_at.bind(at) if isinstance(at, int) else at
        values = values.cast(storage.dtype)
        if keep is not None:
            values = keep.where(values, storage[start : start + values.shape[0]])
        storage[start : start + values.shape[0]].assign(values).realize()

    def _store(self, kv: KVCache, layer: int, which: str, row, span: slice, values: Tensor, at=None) -> None:
        """Write one row's keys or values at its positions, page run by page run (a jitted decode row: its
        one token at ``at``, a bound Variable)."""
        storage = (kv.k if which == "k" else kv.v)[layer]
        scales = (kv.k_scale if which == "k" else kv.v_scale)[layer] if kv.dtype == "q8_0" else None
        if at is not None:
            chunk, step, keep = values[span], self._step, None
            if step is not None and step.valid is not None:  # a padded chunk: storage rows past its tokens kept
                keep = Tensor.arange(chunk.shape[0]).reshape(-1, 1, 1) < step.valid.reshape(1, 1, 1)
            self._put(storage, scales, at, chunk, keep)
            return
        size, table = kv.page_size, kv.table(layer)[row.slot]
        position, end, done = row.start, row.start + len(row.tokens), 0
        while position < end:
            page = int(table[position // size])
            if page < 0:
                raise ValueError(f"slot {row.slot} has no page for position {position}")
            # one write for a run of pages that lie next to each other in storage (a fresh pool hands
            # them out in order): each write is a realize, scheduled in Python
            run, last = min(size - position % size, end - position), page
            while position + run < end and int(table[(position + run) // size]) == last + 1:
                last += 1
                run = min(run + size, end - position)
            chunk = values[span.start + done : span.start + done + run]
            self._put(storage, scales, page * size + position % size, chunk)
            position, done = position + run, done + run

    def _put(self, storage: Tensor, scales: Tensor | None, at, chunk: Tensor, keep: Tensor | None = None) -> None:
        """Write rows at ``at``: the values, or a q8_0 cache's quants and their scales (rows where ``keep`` is False
        kept as they are)."""
        if scales is None:
            self._write(storage, at, chunk, keep)
        else:
            q, d = _q8_0(chunk)
            self._write(storage, at, q, keep)
            self._write(scales, at, d, keep)

    def _gather(
        self, kv: KVCache, layer: int, which: str, slot: int, table: Tensor | None = None, dtype=None
    ) -> Tensor:
        """The slot's cached keys or values in position order, all its pages: [pages_per_slot * page_size, heads, dim]
        (through ``table``, its page-table row on the device, when given), as float32 or ``dtype``."""
        storage = (kv.k if which == "k" else kv.v)[layer]
        if table is None:
            table = self._tensor(np.maximum(kv.table(layer)[slot], 0).astype(np.int32))
        size, rows, heads, dim = kv.page_size, *storage.shape
        pages = storage.reshape(rows // size, size * heads * dim)[table]
        if kv.dtype == "q8_0":
            scales = (kv.k_scale if which == "k" else kv.v_scale)[layer]
            s = scales.reshape(rows // size, size * heads * dim // 32)[table]
            values = _from_q8_0(pages.reshape(-1, heads, dim), s.reshape(-1, heads, dim // 32))
        else:
            values = pages.reshape(-1, heads, dim)
        return values.cast(dtype or dtypes.float32)
