"""The conformance kit's pytest plugin (the ``pytest11`` entry point ``leat-conformance``, loaded wherever leat is
installed): the kit's checks take their parameters from what a subclass declares, and a check that needs a
capability (``@pytest.mark.leat_needs("sinks")``) is collected only for subclasses whose ``capabilities`` have it,
so an inapplicable check is deselected at collection, never skipped at run time."""

from __future__ import annotations

from typing import Any

import pytest

from leat.conformance.architecture import ArchitectureConformance
from leat.conformance.backend import BackendConformance

KITS = (ArchitectureConformance, BackendConformance)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "leat_needs(capability): a conformance check for plugins whose `capabilities` declare it"
    )


def pytest_report_header(config: pytest.Config) -> str:
    from leat import __version__

    return f"leat conformance kit (leat {__version__})"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``qtype``: the storage types the subclass declares (``qtypes`` / ``model_qtypes``); ``variant``: an
    architecture's ``variants``."""
    cls = metafunc.cls
    if cls is None or not issubclass(cls, KITS):
        return
    if "qtype" in metafunc.fixturenames:
        metafunc.parametrize("qtype", list(_qtypes(cls)))
    if "variant" in metafunc.fixturenames:
        metafunc.parametrize("variant", list(cls.variants))


def _qtypes(cls: Any) -> tuple[str, ...]:
    return cls.qtypes if issubclass(cls, ArchitectureConformance) else cls.model_qtypes


def _applies(item: pytest.Item, cls: Any) -> bool:
    needs = {mark.args[0] for mark in item.iter_markers("leat_needs")}
    no_types = "qtype" in getattr(item, "fixturenames", ()) and not _qtypes(cls)
    no_variants = "variant" in getattr(item, "fixturenames", ()) and not getattr(cls, "variants", None)
    return needs <= cls.capabilities and not no_types and not no_variants


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselects the kit's checks that a subclass's ``capabilities`` (or empty storage types) leave out."""
    keep, deselected = [], []
    for item in items:
        cls: Any = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, KITS) and not _applies(item, cls):
            deselected.append(item)
        else:
            keep.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep
