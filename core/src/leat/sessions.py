"""Named sessions: a conversation's KV kept between requests, hibernated to disk, forked.

A session holds the tokens whose K/V are in its pages and a reference to each page, per page group
(a sliding-window group keeps only the pages its window still reads). A request
naming the session reuses the longest common prefix of those tokens and its own prompt, so a
multi-turn chat prefills only the new turn. Forking shares every page; the first write into a
shared page copies it (copy-on-write). With a store directory, an idle session can be written to
disk and its pages freed ("hibernated"); it is read back when next used, also after a restart.
:class:`SessionStore` keeps the sessions and their files; :class:`SessionKV` is the engine's side, their pages in
its :class:`~leat.pages.PageBudget`.

A server with API keys gives each key its own sessions: the engine's name for a key's session is
``OWNER.NAME`` (:func:`scoped`), ``OWNER`` 16 hex digits derived from the key. The store is bounded
by :class:`StoreLimits`: :meth:`SessionStore.stale` names the sessions idle past their time or
beyond the count (least recently used first) for the engine to drop, and saving keeps the files
on disk under their byte limit, removing the least recently used.
"""

from __future__ import annotations

import json
import re
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leat.errors import LeatError
from leat.pages import DevicePages, PageBudget
from leat.sha256 import sha256

NAME = re.compile(r"^(?!\.+$)[A-Za-z0-9._-]{1,128}$")  # not "." or "..": no URL path could name it
MAX_NAME = 128
FORMAT = 2  # of a stored session: 2 = pages per layer group (1 had one page list for every layer)


class SessionInUse(LeatError):
    """A request is extending the session: it cannot be forked from, hibernated, restored or dropped until it ends."""


@dataclass
class StoreLimits:
    max_sessions: int | None = None  # in memory and on disk together
    idle_seconds: float | None = None  # since a session was last used
    max_bytes: int | None = None  # of the session files on disk


@dataclass
class Session:
    name: str
    tokens: list[int] = field(default_factory=list)
    pages: list[list[int]] = field(default_factory=list)  # per group, in position order (-1: none); [] when none held
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a running request is extending it

    @property
    def hibernated(self) -> bool:
        return bool(self.tokens) and not self.pages


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise LeatError(f"session name {name!r} must be 1-{MAX_NAME} letters, digits, '.', '_' or '-', not dots alone")
    return name


def scoped(owner: str | None, name: str) -> str:
    """The engine's name for the session ``name`` of API key ``owner`` (None: the server has no keys)."""
    check_name(name)
    if owner is None:
        return name
    most = MAX_NAME - len(owner) - 1
    if len(name) > most:
        raise LeatError(f"session name {name!r} is too long: with API keys on, a name has at most {most} characters")
    return f"{owner}.{name}"


def unscoped(owner: str | None, engine_name: str) -> str | None:
    """The name ``owner`` knows the engine's session ``engine_name`` by; None when it is another key's."""
    if owner is None:
        return engine_name
    prefix = owner + "."
    return engine_name[len(prefix) :] if engine_name.startswith(prefix) else None


def model_fingerprint(model: Any, kv_dtype: str, page_size: int, windows: Sequence[int | None] = (None,)) -> str:
    """What a stored session's KV depends on: the weights, the backend's precision, the KV format (its page
    groups' ``windows`` included)."""
    f = model.file
    digest = sha256()
    layout = [FORMAT, str(f.architecture), f.weight_bytes(), len(f.tensors), kv_dtype, page_size, list(windows)]
    digest.update(json.dumps(layout).encode())
    digest.update(json.dumps(model.backend.describe(), sort_keys=True, default=str).encode())
    with open(f.parts[0], "rb") as handle:
        for _ in range(16):  # the first MiB in pieces: a 1 MiB buffer would stay in a heap that keeps freed memory
            digest.update(handle.read(1 << 16))
    return digest.hexdigest()[:32]


class SessionStore:
    """Sessions in memory, and on disk under ``directory`` (one ``NAME.npz`` each) when given."""

    def __init__(self, directory: str | Path | None, fingerprint: str, limits: StoreLimits | None = None):
        self.directory = Path(directory).expanduser() if directory else None
        self.fingerprint = fingerprint
        self.limits = limits or StoreLimits()
        self.live: dict[str, Session] = {}
        self.sizes: dict[str, int] = {}  # bytes of each session file
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)
            now, wall = time.monotonic(), time.time()
            for path in self.directory.glob("*.npz"):
                stat = path.stat()
                used = now - max(0.0, wall - stat.st_mtime)
                self.live[path.stem] = Session(path.stem, tokens=self._stored_tokens(path), last_used=used)
                self.sizes[path.stem] = stat.st_size

    def _path(self, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{name}.npz"

    def stale(self, now: float | None = None) -> list[str]:
        """Idle sessions past ``limits.idle_seconds``, then the least recently used beyond ``limits.max_sessions``."""
        now = time.monotonic() if now is None else now
        idle = sorted((s for s in list(self.live.values()) if not s.busy), key=lambda s: s.last_used)
        ttl, cap = self.limits.idle_seconds, self.limits.max_sessions
        expired = [s.name for s in idle if ttl is not None and now - s.last_used > ttl]  # the oldest ones
        over = len(self.live) - len(expired) - cap if cap is not None else 0
        return expired + [s.name for s in idle[len(expired) : len(expired) + max(0, over)]]

    def trim_disk(self, keep: str | None = None) -> None:
        """Remove the least recently used session files (but ``keep``'s) until they fit ``limits.max_bytes``; a
        session whose only copy was its file is forgotten."""
        if self.limits.max_bytes is None:
            return
        order = sorted(self.sizes, key=lambda n: self.live[n].last_used if n in self.live else float("-inf"))
        total = sum(self.sizes.values())
        for name in order:
            if total <= self.limits.max_bytes:
                return
            session = self.live.get(name)
            if name == keep or (session is not None and session.busy):
                continue
            self._path(name).unlink(missing_ok=True)
            total -= self.sizes.pop(name)
            if session is not None and not session.pages:
                del self.live[name]

    def _stored_tokens(self, path: Path) -> list[int]:
        try:
            with np.load(path) as data:
                if str(data["fingerprint"]) != self.fingerprint:
                    return []  # another model or KV format: the session starts over
                return data["tokens"].tolist()
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # unreadable: the session starts over
            return []

    def get(self, name: str) -> Session:
        return self.live.setdefault(check_name(name), Session(name))

    def save(self, session: Session, groups: list[tuple[list[int], list[np.ndarray]]]) -> None:
        """Write a session's tokens and, per page group, which pages it holds (-1: none) and their contents
        (:meth:`Backend.read_pages` of the held ones)."""
        if self.directory is None:
            raise LeatError("no session store: start with --session-store DIR to hibernate sessions")
        arrays: dict[str, np.ndarray] = {}
        for g, (pages, contents) in enumerate(groups):
            arrays[f"held{g}"] = np.asarray(pages, np.int64) >= 0
            arrays |= {f"group{g}_{i}": a for i, a in enumerate(contents)}
        path = self._path(session.name)
        partial = path.with_name(path.name + ".partial")  # not *.npz: never read back as a session
        with open(partial, "wb") as out:
            # no pickles, as np.load reads it back
            tokens = np.asarray(session.tokens, np.int64)
            np.savez(out, tokens=tokens, fingerprint=self.fingerprint, allow_pickle=False, **arrays)
        partial.replace(path)
        self.sizes[session.name] = path.stat().st_size
        self.trim_disk(keep=session.name)

    def load(self, session: Session) -> list[tuple[np.ndarray, list[np.ndarray]]]:
        """Per page group: which pages the session held (a bool per page) and their contents, as saved."""
        with np.load(self._path(session.name)) as data:
            out = []
            for g in range(len([k for k in data.files if k.startswith("held")])):
                count = len([k for k in data.files if k.startswith(f"group{g}_")])
                out.append((data[f"held{g}"], [data[f"group{g}_{i}"] for i in range(count)]))
            return out

    def delete(self, name: str) -> None:
        self.live.pop(name, None)
        self.sizes.pop(name, None)
        if self.directory is not None:
            self._path(name).unlink(missing_ok=True)


class SessionKV:
    """The engine's side of sessions: their pages in a :class:`~leat.pages.PageBudget`, kept when a request on one
    ends, shared with the next request on it, forked, hibernated to the store and restored from it, and given up,
    least recently used first, when the budget needs room (it becomes the budget's ``make_room``). Not locked: the
    engine calls it under its own lock."""

    def __init__(self, store: SessionStore, budget: PageBudget, device: DevicePages):
        self.store, self.budget, self.device = store, budget, device
        budget.make_room = self.release_idle

    # -- around a request --------------------------------------------------------------------------------
    def reuse(self, session: Session, prompt: list[int]) -> tuple[int, list[list[int]]] | None:
        """How many tokens of ``prompt`` the session's pages serve, and those pages, shared to the caller; None
        when they serve none (the session's pages are dropped then: they would only take room until it is
        replaced)."""
        held = session.pages
        reuse = common_prefix(session.tokens, prompt) if held else 0
        if reuse and self.budget.reusable(reuse, lambda g, i: held[g][i] >= 0):
            return reuse, self.budget.share([pages[: -(-reuse // self.budget.page_size)] for pages in held])
        if held:
            self.drop_pages(session)
            session.tokens = []
        return None

    def lend_window(self, session: Session) -> None:
        """A request continuing the session was admitted: it holds the windowed pages it needs and replaces them
        when it ends, and a slot has room for one window's worth only, so the session lets go of its own."""
        windows = self.budget.windows
        self.budget.drop([held if w is not None else [] for held, w in zip(session.pages, windows)])
        session.pages = [held if w is None else [-1] * len(held) for held, w in zip(session.pages, windows)]

    def keep(self, name: str, tokens: list[int], pages: list[list[int]], failed: bool = False) -> None:
        """A request on session ``name`` ended: the session is free again and, unless the request ``failed``, holds
        ``tokens`` (those whose K/V are in ``pages``, the request's) and the pages a continuation reads."""
        session = self.store.get(name)
        session.busy, session.last_used = False, time.monotonic()
        if failed:
            return
        self.drop_pages(session)
        session.tokens = tokens
        session.pages = self.budget.share_continuation(pages, len(tokens))
        if self.store.directory is not None:
            self.store.save(session, self._read(session))

    # -- room ----------------------------------------------------------------------------------------------
    def release_idle(self, fits: Callable[[], bool], keep: Session | None) -> None:
        """Hibernate (with a store) or forget idle sessions but ``keep``, least recently used first, until
        ``fits()``."""
        idle = sorted(
            (s for s in self.store.live.values() if s.pages and not s.busy and s is not keep),
            key=lambda s: s.last_used,
        )
        for session in idle:
            if fits():
                return
            self.release(session, to_disk=self.store.directory is not None)

    def release(self, session: Session, to_disk: bool) -> None:
        """Free the session's pages, its tokens and K/V saved to the store first (``to_disk``) or forgotten."""
        if to_disk:
            self.store.save(session, self._read(session))
        else:
            session.tokens = []
        self.drop_pages(session)

    def restore(self, session: Session) -> bool:
        """Read a hibernated session back into fresh pages; False when they do not fit."""
        stored = self.store.load(session)
        pages = self.budget.allocate([held for held, _ in stored], keep=session)
        if pages is None:
            return False
        for group, (held, (_, contents)) in enumerate(zip(pages, stored)):
            self.device.write_pages([p for p in held if p >= 0], contents, group)
        session.pages = pages
        return True

    def drop_pages(self, session: Session) -> None:
        self.budget.drop(session.pages)
        session.pages = []

    def _read(self, session: Session) -> list[tuple[list[int], list[np.ndarray]]]:
        """Per group: the session's page list and the contents of its held pages."""
        return [
            (held, self.device.read_pages([p for p in held if p >= 0], group))
            for group, held in enumerate(session.pages)
        ]

    # -- by name ---------------------------------------------------------------------------------------------
    def fork(self, source: str, target: str) -> bool:
        """``target`` starts as a copy of ``source``, sharing its pages until either writes; False when ``source``
        is hibernated and its pages do not fit."""
        src, dst = self._idle(source), self._idle(target)
        if src.hibernated and not self.restore(src):
            return False
        self.drop_pages(dst)
        dst.tokens, dst.pages = list(src.tokens), self.budget.share(src.pages)
        if self.store.directory is not None and dst.tokens:  # kept across restarts, as a continued session is
            self.store.save(dst, self._read(dst))
        return True

    def hibernate(self, name: str) -> None:
        session = self._idle(name)
        if session.pages:
            self.release(session, to_disk=True)

    def wake(self, name: str) -> bool:
        """Read a hibernated session back into pages now rather than at its next request; False when they do not
        fit."""
        session = self._idle(name)
        return not session.hibernated or self.restore(session)

    def drop(self, name: str) -> None:
        session = self._idle(name)
        self.drop_pages(session)
        self.store.delete(name)

    def _idle(self, name: str) -> Session:
        session = self.store.get(name)
        if session.busy:
            raise SessionInUse(f"session {name} is in use")
        return session

    def listing(self) -> list[dict[str, Any]]:
        """Each session's name, tokens, pages held and whether it is hibernated."""
        return [
            {
                "name": s.name,
                "tokens": len(s.tokens),
                "pages": sum(p >= 0 for held in s.pages for p in held),
                "hibernated": s.hibernated,
            }
            for s in self.store.live.values()
        ]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
