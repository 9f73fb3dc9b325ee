"""gguf's package without what reading a model does not use.

``import gguf`` runs the package's ``__init__``, which imports every module of it: the writer, the tensor-name
mapping, the vocabulary and metadata tools (these with yaml). A process that only reads a model (``leat generate``)
then carries about 2 MiB of them. :func:`install`, run when leat is imported, puts a ``gguf`` module in place whose
names are those of the modules reading needs (constants, quants, the reader); the first access to any other name
runs the package's own ``__init__`` in it, so ``gguf.GGUFWriter`` and every other name work as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

READING = ("constants", "lazy", "quants", "gguf_reader")
_completing = threading.RLock()  # other threads wait for the whole package; its own modules' reads pass
_started: list[str] = []  # the name whose access ran the package's __init__


class _Lean(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        with _completing:
            if not _started:
                _started.append(name)
                try:
                    self.__spec__.loader.exec_module(self)
                finally:
                    self.__class__ = types.ModuleType
            if name in self.__dict__:
                return self.__dict__[name]
        raise AttributeError(f"module 'gguf' has no attribute {name!r}")


def install() -> None:
    """Import gguf's reading modules under a lean ``gguf`` (nothing when gguf is imported already)."""
    spec = None if "gguf" in sys.modules else importlib.util.find_spec("gguf")
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["gguf"] = module
    try:
        for name in READING:  # `from .NAME import *`, as the package's __init__ does
            part = importlib.import_module(f"gguf.{name}")
            module.__dict__.update((k, v) for k, v in vars(part).items() if not k.startswith("_"))
    except BaseException:
        del sys.modules["gguf"]
        raise
    module.__class__ = _Lean
