"""leat-samplers: registers the default sampling stages; the numpy code loads only when a chain is built."""

from __future__ import annotations

from collections.abc import Callable

from leat import hookimpl

STAGES = {
    "penalties": "Penalties",
    "top_k": "TopK",
    "top_p": "TopP",
    "min_p": "MinP",
    "temperature": "Temperature",
    "greedy": "Greedy",
    "categorical": "Categorical",
}


@hookimpl
def register_samplers(register: Callable[..., None]) -> None:
    for name, cls in STAGES.items():
        register(name, f"leat_samplers.stages:{cls}")
