"""What the tests of proposers share (here and in the architecture plugins whose drafters they run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leat.engine import Engine, GenerationRequest


def greedy(
    model: Any, prompts: Sequence[Sequence[int]], speculation: Any = None, n: int = 16, context: int = 256
) -> tuple[list[list[int]], dict[str, int] | None]:
    """Each prompt's ``n`` greedy tokens, the prompts in one batch of an engine (prompt chunks of 16, pages of 8) with
    ``speculation`` (a :class:`leat.speculative.Speculation`, or None), and the engine's speculation counters."""
    engine = Engine(model, batch_size=3, max_context=context, page_size=8, prefill_chunk=16, speculation=speculation)
    handles = [engine.submit(GenerationRequest(list(p), n, {"temperature": 0})) for p in prompts]
    engine.start()
    try:
        events = [list(handle) for handle in handles]
        assert all(e[-1].kind == "done" for e in events), [e[-1] for e in events]
        return [[t for e in each for t in e.ids] for each in events], engine.stats().get("speculation")
    finally:
        engine.stop()
