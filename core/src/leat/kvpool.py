"""KV page accounting: which pages are free, who holds each, and which hold a reusable prefix.

The backend stores pages; this pool decides which page ids a sequence gets. Pages are refcounted
so a prompt prefix (found by hash) or a forked session shares pages until one side writes into a
shared page, which is then copied first (copy-on-write). Pages that only the prefix cache holds
are evicted least-recently-used when free pages run out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from leat.sha256 import sha256


class PagePool:
    def __init__(self, pages: int, page_size: int):
        self.pages = pages
        self.page_size = page_size
        self.free: list[int] = list(range(pages - 1, -1, -1))
        self.refs = [0] * pages
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> page, least recent first
        self.cache_key: dict[int, bytes] = {}
        self.reserved = 0  # pages promised to admitted requests but not yet taken

    # -- capacity ------------------------------------------------------------------------------------
    def evictable(self) -> int:
        return sum(1 for page in self.cached.values() if self.refs[page] == 1)

    def available(self) -> int:
        """Pages that could be handed out now without touching a promise."""
        return len(self.free) + self.evictable() - self.reserved

    def used(self) -> int:
        return self.pages - len(self.free)

    def reserve(self, count: int) -> bool:
        if count > self.available():
            return False
        self.reserved += count
        return True

    def release(self, count: int) -> None:
        self.reserved -= count

    # -- pages ---------------------------------------------------------------------------------------
    def take(self, from_reservation: bool = True) -> int:
        if from_reservation:
            self.reserved -= 1
        if not self.free:
            self._evict_one()
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def give_back(self, page: int) -> bool:
        """Drop a holder's reference to a page (a sliding window moving past it). When that makes a page
        available (free, or held by the prefix cache alone), keep one reserved in its place, and say so: the
        holder may take a page again without reserving anew."""
        self.drop(page)
        if self.refs[page] == 0 or (self.refs[page] == 1 and page in self.cache_key):
            self.reserved += 1
            return True
        return False

    def share(self, page: int) -> int:
        self.refs[page] += 1
        return page

    def drop(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            key = self.cache_key.pop(page, None)
            if key is not None:
                self.cached.pop(key, None)
            self.free.append(page)

    def _evict_one(self) -> None:
        for key, page in self.cached.items():
            if self.refs[page] == 1:
                del self.cached[key]
                del self.cache_key[page]
                self.drop(page)
                return
        raise RuntimeError("KV page pool exhausted: admission let through more than the pool holds")

    def forget_cached(self) -> None:
        """Free every page that only the prefix cache holds."""
        while self.evictable():
            self._evict_one()

    # -- prefix cache --------------------------------------------------------------------------------
    def prefix_keys(self, client: str | None, tokens: Sequence[int]) -> list[bytes]:
        """One chained hash per full page of ``tokens``, isolated per client."""
        keys, digest = [], sha256((client or "").encode())
        size = self.page_size
        for start in range(0, len(tokens) - size + 1, size):
            digest.update(b"".join(int(t).to_bytes(4, "little") for t in tokens[start : start + size]))
            keys.append(digest.copy().digest())
        return keys

    def cached_prefix(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first on, have a cached page."""
        for i, key in enumerate(keys):
            if key not in self.cached:
                return i
        return len(keys)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached pages of ``keys`` (every one cached), each shared to the caller."""
        pages = []
        for key in keys:
            self.cached.move_to_end(key)
            pages.append(self.share(self.cached[key]))
        return pages

    def remember(self, keys: list[bytes], pages: list[int]) -> None:
        """Offer full pages to the prefix cache (the cache holds one reference to each; -1: no page)."""
        for key, page in zip(keys, pages):
            if page < 0 or key in self.cached or page in self.cache_key:
                continue
            self.cached[key] = self.share(page)
            self.cache_key[page] = key
