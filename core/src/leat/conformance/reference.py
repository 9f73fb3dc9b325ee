"""What the kit checks against: the distributions core's ``conformance`` extra declares (``pip install
'leat[conformance]'``), a backend whose float64 mode is the oracle and an architecture whose tiny files the backend
checks run. They are named once, in core's ``pyproject.toml``; the kit reads that declaration from the installed
metadata and fails, never skips, when one is missing."""

from __future__ import annotations

import functools
import re
from importlib import metadata
from typing import Any

import pytest

from leat import DISTRIBUTION
from leat.errors import PluginError
from leat.plugins import PluginHost

EXTRA = "conformance"


def declared() -> list[str]:
    """The leat plugin distributions the ``conformance`` extra of the installed ``leat-core`` requires."""
    names = []
    for requirement in metadata.requires(DISTRIBUTION) or []:
        if re.search(rf"extra\s*==\s*['\"]{EXTRA}['\"]", requirement):
            name = re.match(r"[A-Za-z0-9._-]+", requirement).group()
            if name.startswith("leat-"):
                names.append(name)
    return names


@functools.cache
def reference(kind: str) -> Any:
    """The class a declared distribution registers as its ``kind`` ("backends" or "architectures")."""
    missing = []
    for name in declared():
        try:
            host = PluginHost([name], kinds=(kind,))
        except PluginError:
            missing.append(name)
            continue
        entries = sorted(host.registry[kind].values(), key=lambda entry: entry.name)
        if entries:
            return entries[0].load()
    wanted = ", ".join(missing) or f"a distribution registering {kind} (leat's '{EXTRA}' extra declares none)"
    pytest.fail(
        f"leat's conformance kit needs its reference {kind[:-1]} ({wanted}), which is not installed: install "
        f"'leat[{EXTRA}]' in the test environment",
        pytrace=False,
    )
