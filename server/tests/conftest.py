"""Fixtures the server's test modules share (a module that defines its own ``path`` or ``server`` uses those): a tiny
Llama and a ``leat serve`` of it, one of each a module."""

from __future__ import annotations

import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A tiny random Llama with a 512-token context and a ChatML template."""
    return write_tiny_gguf(Llama, tmp_path_factory.mktemp("tiny") / "tiny.gguf", params=Llama.tiny(context=512))


@pytest.fixture(scope="module")
def server(path):
    """``leat serve`` of :func:`path` on the CPU, four requests a step, no keys."""
    with ServerProcess(path, ["--backend", "cpu", "--batch-size", "4"], timeout=120) as proc:
        yield proc
