"""The page budget alone, without a model: reserving, sharing, copy-on-write, windowed give-back, prefix lookup and
refusal when full, over a full-attention group and a windowed one (the engine-level equivalents are in
test_kv_groups.py)."""

import pytest
from leat.errors import LeatError
from leat.pages import PageBudget, RowPages, size_kv, window_pages

SIZE, WINDOW, SPAN = 4, 8, 4
BOUND = window_pages(WINDOW, SPAN, SIZE)  # ceil((8 - 1 + 4) / 4) + 1 = 4


class FakeDevice:
    """Records what the budget asks of the device."""

    def __init__(self):
        self.copies: list[tuple[int, int, int]] = []  # (group, source, target)
        self.tables: dict[tuple[int, int], list[int]] = {}  # (slot, group) -> pages
        self.writes = 0

    def copy_page(self, source, target, group):
        self.copies.append((group, source, target))

    def set_pages(self, slot, pages, group):
        self.tables[slot, group] = pages.tolist()
        self.writes += 1


def budget(full=12, windowed=2 * BOUND):
    return PageBudget([full, windowed], [None, WINDOW], SIZE, SPAN, FakeDevice())


def run(b, row, slot, start, end, step=SPAN):
    """Advance ``row`` from position ``start`` to ``end``, ``step`` positions at a time, as the scheduler does."""
    for filled in range(start, end, step):
        b.pages_for(row, slot, filled, min(filled + step, end))


def settled(b):
    for pool in b.pools:
        assert pool.reserved == 0
        assert sorted(pool.free + list(pool.cached.values())) == list(range(pool.pages))
        assert all(pool.refs[p] == 1 for p in pool.cached.values())


def test_sizing_counts_windowed_groups_at_their_window():
    bytes_per_token = [100.0, 50.0]
    context, pages, plan = size_kv(
        bytes_per_token,
        [None, WINDOW],
        slots=2,
        page_size=SIZE,
        span=SPAN,
        model_context=64,
        max_context=None,
        budget=2 * (100 * 40 + 50 * BOUND * SIZE),
    )
    assert context == 40 and pages == [2 * 10, 2 * BOUND]
    assert "window 8" in plan and "context 40 tokens x 2 slots" in plan
    context, pages, _ = size_kv(
        bytes_per_token, [None, WINDOW], slots=2, page_size=SIZE, span=SPAN, model_context=64, max_context=8, budget=1e9
    )
    assert context == 8 and pages == [2 * 2, 2 * 2]  # a windowed group never holds more than the context
    with pytest.raises(LeatError, match="lower --batch-size"):
        size_kv(
            bytes_per_token, [None], slots=4, page_size=SIZE, span=SPAN, model_context=64, max_context=None, budget=100
        )


def test_a_row_reserves_its_worst_case_and_gives_it_all_back():
    b = budget()
    row = b.reserve(18, [[], []])
    assert row.reserved == [5, BOUND]  # 18 tokens: 5 pages of full attention, a window's worth of the other
    assert [pool.reserved for pool in b.pools] == [5, BOUND]
    run(b, row, slot=0, start=0, end=18)
    assert len(row.pages[0]) == 5 and -1 not in row.pages[0]
    assert b.pools[0].reserved == 0
    assert b.device.tables[0, 0] == row.pages[0] and b.device.tables[0, 1] == row.pages[1]
    b.release(row)
    assert row.pages == [] and b.pools[0].used() == b.pools[1].used() == 0
    settled(b)


def test_refused_when_full_with_nothing_taken():
    b = budget(full=8)
    first = b.reserve(20, [[], []])
    assert first is not None
    held = [[b.pools[0].take(from_reservation=False)], []]  # a shared page the refused row would have reused
    assert b.reserve(20, held) is None
    assert b.pools[0].refs[held[0][0]] == 0  # the refusal dropped what it was given
    assert [pool.reserved for pool in b.pools] == [5, BOUND]


def test_make_room_is_asked_before_refusing():
    b = budget(full=8)
    idle = b.reserve(20, [[], []])
    asked = []

    def make_room(fits, keep):
        asked.append((fits(), keep))
        b.release(idle)

    b.make_room = make_room
    row = b.reserve(20, [[], []], keep="mine")
    assert row is not None and asked == [(False, "mine")]


def test_windowed_pages_go_back_behind_the_window():
    b = budget(full=16)
    row = b.reserve(60, [[], []])
    peak = 0
    for filled in range(0, 60, SPAN):
        b.pages_for(row, 0, filled, filled + SPAN)
        peak = max(peak, b.pools[1].used())
    assert peak <= BOUND  # about a window's pages, however long the row
    assert sum(p >= 0 for p in row.pages[1]) <= BOUND and len(row.pages[1]) == 15
    assert row.pages[1][: 60 // SIZE - BOUND] == [-1] * (15 - BOUND)
    assert b.pools[0].used() == 15  # the full-attention group holds every position
    b.release(row)
    settled(b)


def test_page_tables_are_written_only_when_pages_change():
    b = budget()
    row = b.reserve(8, [[], []])
    b.pages_for(row, 0, 0, 1)
    writes = b.device.writes
    b.pages_for(row, 0, 1, 2)  # the same page
    assert b.device.writes == writes
    b.pages_for(row, 0, 4, 5)  # a new one, in each group
    assert b.device.writes == writes + 2


def test_a_shared_page_is_copied_before_writing():
    b = budget()
    first = b.reserve(10, [[], []])
    run(b, first, 0, 0, 10)
    shared = b.share([held[:3] for held in first.pages])  # a fork: 10 tokens, its third page partly filled
    second = b.reserve(16, shared, copy=True)
    b.pages_for(second, 1, 10, 11)
    for group in (0, 1):
        source, target = first.pages[group][2], second.pages[group][2]
        assert target != source and (group, source, target) in b.device.copies
        assert b.pools[group].refs[source] == 1  # the first row's alone again
    assert second.pages[0][:2] == first.pages[0][:2]  # whole pages before it stay shared
    b.release(first)
    b.release(second)
    settled(b)


def test_prefix_lookup_shares_cached_pages_per_client():
    b = budget()
    prompt = list(range(13))
    row = b.reserve(13, [[], []])
    row.prefix_keys = b.prefix_keys("alice", prompt)
    run(b, row, 0, 0, 13)
    b.remember(row, 13)
    b.release(row)
    reuse, shared = b.lookup(b.prefix_keys("alice", prompt[:12]))
    assert reuse == 12 and len(shared[0]) == 3 and -1 not in shared[0]
    assert all(b.pools[0].refs[p] == 2 for p in shared[0])  # the cache's and the caller's
    assert b.lookup(b.prefix_keys("bob", prompt[:12])) == (0, [[], []])
    b.drop(shared)
    settled(b)


def test_lookup_needs_every_group_to_continue():
    b = budget()
    prompt = list(range(12))
    row = b.reserve(12, [[], []])
    row.prefix_keys = b.prefix_keys(None, prompt)
    run(b, row, 0, 0, 12)
    b.remember(row, 12)
    b.release(row)
    windowed = b.pools[1]
    evicted = next(iter(windowed.cached.values()))  # the least recently used: the prompt's first page
    taken = [windowed.take(from_reservation=False) for _ in range(len(windowed.free) + 1)]
    assert evicted not in windowed.cached.values()
    reuse, shared = b.lookup(b.prefix_keys(None, prompt))
    assert reuse == 12 and shared[1][0] == -1  # continuing at 12 reads only the window's pages 1 and 2
    b.drop(shared)
    for _ in range(2):  # evicting those as well leaves nothing every group can continue from
        taken.append(windowed.take(from_reservation=False))
    assert b.lookup(b.prefix_keys(None, prompt)) == (0, [[], []])
    assert len(b.pools[0].cached) == 3  # though the full-attention group still has all of it


def test_a_continuation_keeps_only_the_window_it_reads():
    b = budget()
    row = b.reserve(20, [[], []])
    run(b, row, 0, 0, 20)
    kept = b.share_continuation(row.pages, 18)
    assert kept[0] == row.pages[0][:5]
    assert kept[1][:2] == [-1, -1] and kept[1][2:] == row.pages[1][2:5]  # positions 11 on are under the window
    b.release(row)
    b.drop(kept)
    settled(b)


def test_allocate_gives_fresh_pages_where_held():
    b = budget()
    pages = b.allocate([[True, True, False], [False, True, True]])
    assert [p >= 0 for p in pages[0]] == [True, True, False] and [p >= 0 for p in pages[1]] == [False, True, True]
    assert [pool.reserved for pool in b.pools] == [0, 0] and b.pools[0].used() == 2
    assert b.allocate([[True] * 13, []]) is None  # more than the group has
    b.drop(pages)
    settled(b)


def test_row_pages_start_empty():
    row = RowPages()
    assert row.pages == [] and row.reserved == [] and row.tables_stale
