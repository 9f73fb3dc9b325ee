"""leat-sampler-xtc: registers the XTC stage; numpy loads only when a chain is built."""

from __future__ import annotations

from collections.abc import Callable

from leat import hookimpl


@hookimpl
def register_samplers(register: Callable[..., None]) -> None:
    register("xtc", "leat_sampler_xtc.xtc:XTC")
