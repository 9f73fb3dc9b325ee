"""What else a plugin may bring beside an architecture, each through its own hook and none needing a change to core:
a sampler stage (``register_samplers``), a chat format (``register_chat_formats``) and a ``leat`` subcommand
(``register_commands``). Replace them with your own or delete them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import click
import msgspec
import numpy as np
from leat.chatformat import MarkerParser, ToolCall, json_calls
from leat.sampling import ORDER, Stage


class TopAParams(msgspec.Struct, kw_only=True):
    top_a: Annotated[float, msgspec.Meta(ge=0, le=1, description="drop tokens with p < top_a * p_max^2; 0 = off")] = 0.0


class TopA(Stage):
    """Top-a: keeps the tokens whose probability is at least ``top_a`` times the square of the top one's."""

    name = "top_a"
    Params = TopAParams  # requests, SamplingParams and the server's bodies take `top_a` from here
    order = ORDER["min_p"] + 1  # right after min_p

    def enabled(self) -> bool:
        return self.params.top_a > 0

    def apply(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        p = np.exp(logits - logits.max())
        p /= p.sum()
        logits[p < self.params.top_a * p.max() ** 2] = -np.inf
        return logits


class ExampleCalls(MarkerParser):
    """Tool calls written as ``<call>{"name": ..., "arguments": {...}}</call>``."""

    start, end = ("<call>",), "</call>"

    @classmethod
    def detect(cls, template: str, special: set[str], architecture: str) -> int | None:
        return 45 if "<call>" in template or "<call>" in special or architecture == "example" else None

    def parse(self, body: str) -> list[ToolCall] | None:
        return json_calls(body)


@click.command("example-tiny")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def tiny_command(path: Path) -> None:
    """Write a tiny random-weight example model to PATH."""
    from leat.testing import write_tiny_gguf

    from leat_example.architecture import Example

    click.echo(write_tiny_gguf(Example, path))
