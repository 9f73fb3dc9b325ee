"""Sessions' pages without a model: kept after a request, reused, forked, hibernated and restored, and given up
for room, on a :class:`PageBudget` with a fake device (the engine-level tests are in test_engine.py and
test_kv_groups.py)."""

import numpy as np
import pytest
from leat.errors import LeatError
from leat.pages import PageBudget
from leat.sessions import SessionKV, SessionStore

SIZE, WINDOW, SPAN = 4, 8, 4


class FakeDevice:
    """Each page holds one number per group: what the row that wrote it put there."""

    def __init__(self):
        self.contents: dict[tuple[int, int], float] = {}

    def copy_page(self, source, target, group):
        self.contents[group, target] = self.contents.get((group, source), 0.0)

    def set_pages(self, slot, pages, group):
        for page in pages:
            if page >= 0:
                self.contents.setdefault((group, int(page)), float(slot * 1000 + page))

    def read_pages(self, pages, group):
        return [np.asarray([self.contents[group, p] for p in pages])]

    def write_pages(self, pages, contents, group):
        for page, value in zip(pages, contents[0]):
            self.contents[group, page] = float(value)


def sessions(tmp_path=None, full=24, windowed=12):
    device = FakeDevice()
    budget = PageBudget([full, windowed], [None, WINDOW], SIZE, SPAN, device)
    return SessionKV(SessionStore(tmp_path, "fingerprint"), budget, device)


def finish(kv, name, length, slot=0, prefix=()):
    """A request on session ``name`` that wrote ``length`` positions (after ``prefix``, reused) and ended."""
    budget = kv.budget
    row = budget.reserve(length + 1, [list(held) for held in prefix] or [[], []])
    for filled in range(0, length, SPAN):
        budget.pages_for(row, slot, filled, min(filled + SPAN, length))
    kv.keep(name, list(range(length)), row.pages)
    budget.release(row)


def held(session):
    return sum(p >= 0 for group in session.pages for p in group)


def settled(budget):
    for pool in budget.pools:
        assert pool.reserved == 0 and pool.used() == 0


def test_a_session_keeps_what_a_continuation_reads():
    kv = sessions()
    finish(kv, "s", 18)
    session = kv.store.get("s")
    assert session.tokens == list(range(18)) and not session.busy
    assert len(session.pages[0]) == 5 and -1 not in session.pages[0]
    assert session.pages[1][:2] == [-1, -1]  # behind the window of a continuation at 18
    assert all(kv.budget.pools[g].refs[p] == 1 for g in (0, 1) for p in session.pages[g] if p >= 0)
    kv.drop("s")
    settled(kv.budget)


def test_reuse_shares_the_common_prefix_or_lets_go():
    kv = sessions()
    finish(kv, "s", 18)
    session = kv.store.get("s")
    reuse, shared = kv.reuse(session, list(range(17)) + [99])
    assert reuse == 17 and shared[0] == session.pages[0][:5] and shared[1][2:] == session.pages[1][2:5]
    kv.budget.drop(shared)
    # continuing at 14 would read windowed pages the session no longer holds: its pages go
    assert kv.reuse(session, list(range(14)) + [99]) is None
    assert session.pages == [] and session.tokens == []
    settled(kv.budget)


def test_lending_the_window_drops_only_windowed_pages():
    kv = sessions()
    finish(kv, "s", 18)
    session = kv.store.get("s")
    full = list(session.pages[0])
    kv.lend_window(session)
    assert session.pages[0] == full and all(p == -1 for p in session.pages[1])
    assert kv.budget.pools[1].used() == 0


def test_fork_shares_every_page():
    kv = sessions()
    finish(kv, "a", 10)
    assert kv.fork("a", "b")
    a, b = kv.store.get("a"), kv.store.get("b")
    assert b.pages == a.pages and b.tokens == a.tokens
    assert all(kv.budget.pools[0].refs[p] == 2 for p in a.pages[0])
    kv.drop("a")
    assert held(b) == 3 + 3
    assert all(kv.budget.pools[0].refs[p] == 1 for p in b.pages[0])
    kv.drop("b")
    settled(kv.budget)


def test_hibernate_and_restore_bring_back_the_contents(tmp_path):
    kv = sessions(tmp_path)
    finish(kv, "s", 10, slot=3)
    session = kv.store.get("s")
    before = [[kv.device.contents[g, p] if p >= 0 else None for p in group] for g, group in enumerate(session.pages)]
    kv.hibernate("s")
    assert session.hibernated and (tmp_path / "s.npz").exists()
    assert [pool.used() for pool in kv.budget.pools] == [0, 0]
    assert kv.listing() == [{"name": "s", "tokens": 10, "pages": 0, "hibernated": True}]
    assert kv.restore(session) and not session.hibernated
    after = [[kv.device.contents[g, p] if p >= 0 else None for p in group] for g, group in enumerate(session.pages)]
    assert after == before


def test_idle_sessions_make_room_least_recently_used_first():
    kv = sessions(full=8, windowed=8)
    finish(kv, "old", 10)
    finish(kv, "new", 10)
    old, new = kv.store.get("old"), kv.store.get("new")
    assert kv.budget.reserve(12, [[], []], keep=new) is not None  # 3 full pages: only "old" had to go
    assert old.pages == [] and old.tokens == []  # no store: forgotten, not hibernated
    assert new.pages
    new.busy = True
    assert kv.budget.reserve(20, [[], []]) is None  # a busy session is never given up


def test_a_busy_session_is_not_hibernated_or_dropped(tmp_path):
    kv = sessions(tmp_path)
    finish(kv, "s", 6)
    kv.store.get("s").busy = True
    for call in (kv.hibernate, kv.drop):
        with pytest.raises(LeatError, match="in use"):
            call("s")
