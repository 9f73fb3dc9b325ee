"""API keys for ``leat serve``: named keys, shown once when made, stored only as SHA-256 hashes.

The keys file is ``$LEAT_HOME/keys.json`` (else ``~/.cache/leat/keys.json``), or the file given
with ``--file`` / ``leat serve --api-key-file``. It is written with mode 0600::

    {"keys": [{"name": "laptop", "sha256": "<hex of sha256(key)>", "prefix": "leat_Ab3x", "created": 1767225600}]}

``leat serve --api-key-file`` also reads llama-server's format: the keys themselves, one per line (whitespace
separates keys); such a file is read only.

A key is ``leat_`` and 43 URL-safe characters (256 random bits), so a plain hash is enough: there
is nothing to brute-force.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from leat.errors import LeatError

PREFIX = "leat_"
NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


def default_path() -> Path:
    from leat.pull import cache_dir

    return cache_dir() / "keys.json"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _plain_entry(line: int, key: str) -> dict[str, Any]:
    return {"name": f"line {line}", "sha256": _digest(key), "prefix": key[:4], "created": None}


class KeyStore:
    """The named key hashes in one keys file."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path).expanduser() if path else default_path()
        self.keys: list[dict[str, Any]] = []
        self.plain = False  # a llama-server key list (one key per line), read only
        if self.path.exists():
            try:
                text = self.path.read_text()
                if text.lstrip().startswith("{"):
                    self.keys = list(json.loads(text)["keys"])
                else:
                    self.plain = True
                    self.keys = [_plain_entry(n, key) for n, key in enumerate(text.split(), 1)]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise LeatError(f"cannot read the keys file {self.path}: {e}; fix or remove it") from None

    def __bool__(self) -> bool:
        return bool(self.keys)

    def add(self, name: str) -> str:
        """Make a key called ``name``; the key itself is returned once and never stored."""
        if not NAME.match(name):
            raise LeatError(f"key name {name!r}: use 1-64 letters, digits, '.', '_', '@' or '-'")
        if any(k["name"] == name for k in self.keys):
            raise LeatError(f"a key named {name} exists; remove it first (`leat keys remove {name}`)")
        key = PREFIX + secrets.token_urlsafe(32)
        self.keys.append({"name": name, "sha256": _digest(key), "prefix": key[:9], "created": int(time.time())})
        self._save()
        return key

    def remove(self, name: str) -> None:
        kept = [k for k in self.keys if k["name"] != name]
        if len(kept) == len(self.keys):
            known = ", ".join(k["name"] for k in self.keys) or "none"
            raise LeatError(f"no key named {name} in {self.path} (keys: {known})")
        self.keys = kept
        self._save()

    def list(self) -> list[dict[str, Any]]:
        return [{"name": k["name"], "prefix": k.get("prefix", ""), "created": k.get("created")} for k in self.keys]

    def check(self, key: str | None) -> str | None:
        """The name of the key ``key`` is, or None. Compares every hash in constant time."""
        if not key:
            return None
        digest = _digest(key)
        found = None
        for k in self.keys:
            if hmac.compare_digest(digest, str(k.get("sha256", ""))):
                found = k["name"]
        return found

    def _save(self) -> None:
        if self.plain:
            raise LeatError(f"{self.path} is a list of keys, one per line (llama-server's format): edit it by hand")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".keys-")  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"keys": self.keys}, f, indent=2)
                f.write("\n")
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
