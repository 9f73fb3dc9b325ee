"""Named sessions: a conversation's KV kept between requests, hibernated to disk, forked.

A session holds the tokens whose K/V are in its pages and a reference to each page, per page group
(a sliding-window group keeps only the pages its window still reads). A request
naming the session reuses the longest common prefix of those tokens and its own prompt, so a
multi-turn chat prefills only the new turn. Forking shares every page; the first write into a
shared page copies it (copy-on-write). With a store directory, an idle session can be written to
disk and its pages freed ("hibernated"); it is read back when next used, also after a restart.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from leat.errors import LeatError

NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
FORMAT = 2  # of a stored session: 2 = pages per layer group (1 had one page list for every layer)


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
        raise LeatError(f"session name {name!r} must be 1-128 letters, digits, '.', '_' or '-'")
    return name


def model_fingerprint(model: Any, kv_dtype: str, page_size: int, windows: Sequence[int | None] = (None,)) -> str:
    """What a stored session's KV depends on: the weights, the backend's precision, the KV format (its page
    groups' ``windows`` included)."""
    f = model.file
    digest = hashlib.sha256()
    layout = [FORMAT, str(f.architecture), f.weight_bytes(), len(f.tensors), kv_dtype, page_size, list(windows)]
    digest.update(json.dumps(layout).encode())
    digest.update(json.dumps(model.backend.describe(), sort_keys=True, default=str).encode())
    with open(f.parts[0], "rb") as handle:
        digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:32]


class SessionStore:
    """Sessions in memory, and on disk under ``directory`` (one ``NAME.npz`` each) when given."""

    def __init__(self, directory: str | Path | None, fingerprint: str):
        self.directory = Path(directory).expanduser() if directory else None
        self.fingerprint = fingerprint
        self.live: dict[str, Session] = {}
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)
            for path in self.directory.glob("*.npz"):
                self.live[path.stem] = Session(path.stem, tokens=self._stored_tokens(path))

    def _path(self, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{name}.npz"

    def _stored_tokens(self, path: Path) -> list[int]:
        try:
            with np.load(path) as data:
                if str(data["fingerprint"]) != self.fingerprint:
                    return []  # another model or KV format: the session starts over
                return data["tokens"].tolist()
        except Exception:
            return []

    def get(self, name: str) -> Session:
        return self.live.setdefault(check_name(name), Session(name))

    def save(self, session: Session, groups: list[tuple[list[int], list[np.ndarray]]]) -> None:
        """Write a session's tokens and, per page group, which pages it holds (-1: none) and their contents
        (:meth:`Backend.read_pages` of the held ones)."""
        if self.directory is None:
            raise LeatError("no session store: start with --session-store DIR to hibernate sessions")
        arrays = {}
        for g, (pages, contents) in enumerate(groups):
            arrays[f"held{g}"] = np.asarray(pages, np.int64) >= 0
            arrays |= {f"group{g}_{i}": a for i, a in enumerate(contents)}
        partial = self._path(session.name).with_suffix(".partial.npz")
        np.savez(partial, tokens=np.asarray(session.tokens, np.int64), fingerprint=self.fingerprint, **arrays)
        partial.replace(self._path(session.name))

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
        if self.directory is not None:
            self._path(name).unlink(missing_ok=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
