"""leat: a GGUF inference engine built from a small core and plugins."""

from __future__ import annotations

from importlib import metadata

from leat import gguf_lean

gguf_lean.install()

from leat.hookspecs import hookimpl

DISTRIBUTION = "leat-core"  # the import name is leat; `leat` on PyPI is another project
try:
    __version__ = metadata.version(DISTRIBUTION)
except metadata.PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0.0.0"


def load(model: str, backend: str | None = None, **options):
    """Load a model by path or cached name and return a :class:`leat.model.Model`."""
    from leat.model import load as _load

    return _load(model, backend=backend, **options)


__all__ = ["__version__", "hookimpl", "load"]
