"""The KV page budget: one :class:`~leat.kvpool.PagePool` per window group, and the pages each request holds.

Layers are grouped by their sliding window, each group with its own pages (:func:`leat.backend.window_groups`). A
request is admitted only when its page-rounded worst case (prompt + max_tokens) can be reserved, so nothing runs out
of memory mid-request. A windowed group gives a page back once every query still to come is past it, so it holds
only about a window's worth per request. Pages are shared (a reused prompt prefix, a session) until a row writes
into one, which is then copied first (copy-on-write).

The budget reaches the device only through :class:`DevicePages` (copying a page, writing a slot's page table), so
it can be tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from leat.errors import LeatError
from leat.kvpool import PagePool


class DevicePages(Protocol):
    """The device's side of the pages: :class:`PageBudget` copies pages and writes page tables; sessions read
    and write page contents (:class:`leat.sessions.SessionKV`)."""

    def copy_page(self, source: int, target: int, group: int) -> None: ...

    def set_pages(self, slot: int, pages: np.ndarray, group: int) -> None: ...

    def read_pages(self, pages: list[int], group: int) -> list[np.ndarray]: ...

    def write_pages(self, pages: list[int], contents: list[np.ndarray], group: int) -> None: ...


@dataclass
class BackendPages:
    """:class:`DevicePages` of a backend's KV cache (see :class:`leat.backend.Backend` for each call)."""

    backend: Any
    kv: Any

    def copy_page(self, source: int, target: int, group: int) -> None:
        self.backend.copy_page(self.kv, source, target, group=group)

    def set_pages(self, slot: int, pages: np.ndarray, group: int) -> None:
        self.backend.set_pages(self.kv, slot, pages, group=group)

    def read_pages(self, pages: list[int], group: int) -> list[np.ndarray]:
        return self.backend.read_pages(self.kv, pages, group=group)

    def write_pages(self, pages: list[int], contents: list[np.ndarray], group: int) -> None:
        self.backend.write_pages(self.kv, pages, contents, group=group)


@dataclass
class RowPages:
    """What one request holds of the budget."""

    pages: list[list[int]] = field(default_factory=list)  # per group, in position order; -1: behind the window
    reserved: list[int] = field(default_factory=list)  # per group: pages promised but not yet taken
    prefix_keys: list[bytes] = field(default_factory=list)  # of its prompt's full pages
    tables_stale: bool = True  # its slot's page table in the backend is another request's until first written


def window_pages(window: int, span: int, page_size: int) -> int:
    """The most pages a row holds at once in a group of this window: those its window reaches behind a step's
    first position, and those of the step's own ``span`` positions (the most one step writes for a row)."""
    return -(-(window - 1 + span) // page_size) + 1


def size_kv(
    group_bytes: Sequence[float],
    windows: Sequence[int | None],
    *,
    slots: int,
    page_size: int,
    span: int,
    model_context: int,
    max_context: int | None,
    budget: float,
) -> tuple[int, list[int], str]:
    """Context, page counts per group and a line that says so: the largest context (up to ``max_context``, given)
    whose KV for every slot fits ``budget`` bytes, windowed groups counted at the pages their window needs,
    whatever the context. ``group_bytes``: each group's KV bytes per token."""
    full = sum(b for b, window in zip(group_bytes, windows) if window is None)
    windowed = sum(
        b * window_pages(w, span, page_size) * page_size for b, w in zip(group_bytes, windows) if w is not None
    )
    room = budget / slots - windowed  # bytes per slot left for the full-attention groups
    fits = (int(room // full) if full else model_context) if room >= 0 else 0
    fits -= fits % page_size
    context = min(max_context or model_context, model_context)
    if fits < min(context, page_size):
        raise LeatError(
            f"KV for {slots} slots does not fit in {budget / 2**30:.2f} GiB "
            f"({sum(group_bytes):.0f} bytes per token); lower --batch-size"
        )
    if max_context is None:
        context = min(context, fits)
    per_slot = -(-context // page_size)
    pages = [slots * (per_slot if w is None else min(per_slot, window_pages(w, span, page_size))) for w in windows]
    kinds = ", ".join(f"{n} for {'full attention' if w is None else f'window {w}'}" for n, w in zip(pages, windows))
    mib = sum(n * page_size * b for n, b in zip(pages, group_bytes)) / 2**20
    plan = f"context {context} tokens x {slots} slots, KV pages of {page_size} tokens: {kinds} ({mib:.1f} MiB)"
    return context, pages, plan


class PageBudget:
    """The page pools of every window group (``windows[g]``: None for full attention, first) and what is reserved
    of them. ``span`` is the most positions one step writes for a row."""

    def __init__(
        self, pages: Sequence[int], windows: Sequence[int | None], page_size: int, span: int, device: DevicePages
    ):
        self.pools = [PagePool(count, page_size) for count in pages]
        self.windows = list(windows)
        self.page_size = page_size
        self.span = span
        self.device = device
        # called when a reservation finds too few pages: frees what it can (idle sessions, but never ``keep``)
        # until ``fits()`` says the reservation fits
        self.make_room: Callable[[Callable[[], bool], Any], None] = lambda fits, keep: None

    def window_pages(self, window: int) -> int:
        return window_pages(window, self.span, self.page_size)

    def prefix_keys(self, client: str | None, tokens: Sequence[int]) -> list[bytes]:
        return self.pools[0].prefix_keys(client, tokens)

    # -- sharing ---------------------------------------------------------------------------------------
    def reusable(self, length: int, has: Callable[[int, int], bool]) -> bool:
        """Whether a row can continue at position ``length`` with the pages ``has(group, index)`` says are
        held: a full-attention group needs every page before it, a windowed group those under its window."""
        size = self.page_size
        for group, window in enumerate(self.windows):
            first = 0 if window is None else max(0, length - window + 1) // size
            if not all(has(group, i) for i in range(first, -(-length // size))):
                return False
        return True

    def lookup(self, keys: list[bytes]) -> tuple[int, list[list[int]]]:
        """The longest cached prefix of whole pages that every group can continue from (a windowed group's pages
        may be evicted while the full group's stay), in tokens, and each group's pages of it, shared to the caller."""
        size = self.page_size
        count = min((p.cached_prefix(keys) for p, w in zip(self.pools, self.windows) if w is None), default=len(keys))
        while count and not self.reusable(count * size, lambda g, i: keys[i] in self.pools[g].cached):
            count -= 1
        shared = []
        for pool, window in zip(self.pools, self.windows):
            first = 0 if window is None else max(0, count * size - window + 1) // size
            shared.append([-1] * first + pool.lookup(keys[first:count]))
        return count * size, shared

    def share(self, pages: list[list[int]]) -> list[list[int]]:
        """Another reference to each group's pages (-1 stays -1)."""
        return [[pool.share(p) if p >= 0 else -1 for p in held] for pool, held in zip(self.pools, pages)]

    def share_continuation(self, pages: list[list[int]], length: int) -> list[list[int]]:
        """Another reference to the pages that a row continuing at position ``length`` reads: all of a
        full-attention group's before it, a windowed group's under its window (-1 for those behind it)."""
        size, count = self.page_size, -(-length // self.page_size)
        behind = [0 if w is None else max(0, length - w + 1) // size for w in self.windows]
        return self.share([[-1] * b + held[b:count] for b, held in zip(behind, pages)])

    def drop(self, pages: list[list[int]]) -> None:
        for pool, held in zip(self.pools, pages):
            for page in held:
                if page >= 0:
                    pool.drop(page)

    # -- reserving -------------------------------------------------------------------------------------
    def fits(self, needs: list[int]) -> bool:
        return all(pool.available() >= need for pool, need in zip(self.pools, needs))

    def reserve_pages(self, needs: list[int], keep: Any = None) -> bool:
        """Reserve ``needs[g]`` pages of each group, having :attr:`make_room` (but for ``keep``) when they do not
        fit; False, with nothing reserved, when they still do not."""
        if not self.fits(needs):
            self.make_room(lambda: self.fits(needs), keep)
            if not self.fits(needs):
                return False
        for pool, need in zip(self.pools, needs):
            pool.reserve(need)
        return True

    def reserve(
        self,
        tokens: int,
        shared: list[list[int]],
        copy: bool = False,
        lent: list[list[int]] | None = None,
        keep: Any = None,
    ) -> RowPages | None:
        """The pages of a row of up to ``tokens`` positions that starts with ``shared`` (pages it reuses, held by
        it now): those reserved for the rest, one more when the last shared page is partly filled (``copy``: it
        is copied before writing). ``lent``: another holder's pages (a session's) whose windowed ones it lets go
        of once the row is admitted. None, and ``shared`` dropped, when the rest does not fit."""
        total = -(-tokens // self.page_size)
        needs = [total - len(held) + copy for held in shared]
        for group, (pool, window, held) in enumerate(zip(self.pools, self.windows, shared)):
            if window is not None:
                # At most a window's pages are held at once (those behind it go back as it moves), the shared ones
                # among them. Those only it holds (the lender lets go of its windowed pages) or the prefix cache
                # besides were available, and are again when the window passes them.
                other = set(lent[group]) if lent is not None else set()
                alone = [p for p in held if p >= 0 and pool.refs[p] - (p in other) - (p in pool.cache_key) == 1]
                needs[group] = min(needs[group], self.window_pages(window) - len(alone))
        if not self.reserve_pages(needs, keep):
            self.drop(shared)
            return None
        return RowPages(shared, needs)

    def allocate(self, held: Sequence[Sequence[bool] | np.ndarray], keep: Any = None) -> list[list[int]] | None:
        """Fresh pages per group where ``held`` (a bool per page, as a list or a numpy array) says (-1 elsewhere), as
        a hibernated session restored needs them; None when they do not fit."""
        if not self.reserve_pages([int(np.count_nonzero(kept)) for kept in held], keep):
            return None
        return [[pool.take() if kept else -1 for kept in mask] for pool, mask in zip(self.pools, held)]

    # -- a row's pages as it runs ----------------------------------------------------------------------
    def pages_for(self, row: RowPages, slot: int, filled: int, end: int) -> None:
        """Give ``row`` (in batch slot ``slot``, ``filled`` positions in the KV) pages up to position ``end``
        (exclusive), copying a shared page before writing, and give back windowed pages that no query from
        position ``filled`` on reads. The device's page table is written only where the row's pages changed."""
        size = self.page_size
        for group, (pool, window, pages) in enumerate(zip(self.pools, self.windows, row.pages)):
            changed = row.tables_stale
            if window is not None:
                # a rejected draft rewinds no further back than filled, so these stay unread
                i = max(0, filled - window + 1) // size - 1
                while i >= 0 and pages[i] >= 0:
                    pool.remember(row.prefix_keys[i : i + 1], pages[i : i + 1])  # a prompt page stays reusable
                    row.reserved[group] += pool.give_back(pages[i])
                    pages[i], changed = -1, True
                    i -= 1
            first = filled // size
            if first < len(pages) and pool.refs[pages[first]] > 1:
                copy = self._take(row, group)
                self.device.copy_page(pages[first], copy, group)
                row.reserved[group] += pool.give_back(pages[first])
                pages[first], changed = copy, True
            while len(pages) * size < end:
                pages.append(self._take(row, group))
                changed = True
            if changed:
                self.device.set_pages(slot, np.asarray(pages, dtype=np.int32), group)
        row.tables_stale = False

    def _take(self, row: RowPages, group: int) -> int:
        if row.reserved[group] <= 0:
            # a windowed prefix page it counted as its own went on to be shared, so its window's worth of pages
            # is short by one: reserve another now
            if not self.reserve_pages([int(g == group) for g in range(len(self.pools))]):
                raise LeatError("KV pages ran out: lower --batch-size or start with --kv-full-windows")
            row.reserved[group] += 1
        row.reserved[group] -= 1
        return self.pools[group].take()

    def remember(self, row: RowPages, filled: int) -> None:
        """Offer the row's full pages (of its first ``filled`` positions) to the prefix cache."""
        full = filled // self.page_size
        for pool, pages in zip(self.pools, row.pages):
            pool.remember(row.prefix_keys[:full], pages[:full])

    def release(self, row: RowPages) -> None:
        """Give back what the row holds and what is reserved for it."""
        self.drop(row.pages)
        for pool, reserved in zip(self.pools, row.reserved):
            pool.release(reserved)
        row.pages, row.reserved = [], []

    def stats(self) -> dict[str, Any]:
        return {
            "kv_pages_total": sum(pool.pages for pool in self.pools),
            "kv_pages_used": sum(pool.used() for pool in self.pools),
            "kv_pages_free": sum(len(pool.free) for pool in self.pools),
            "kv_pages_cached": sum(len(pool.cached) for pool in self.pools),
            "kv_groups": [
                {"window": w, "pages_total": pool.pages, "pages_used": pool.used(), "pages_cached": len(pool.cached)}
                for pool, w in zip(self.pools, self.windows)
            ],
        }
