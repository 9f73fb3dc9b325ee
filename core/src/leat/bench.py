"""``leat bench``: llama-bench's tests on leat, plus batched decode throughput through the engine.

* ``pp N``: prefill N tokens into an empty cache in one forward pass (chunks of the engine's prefill size).
* ``tg N``: N single-token decode steps into an empty cache, one forward pass each (no sampling), as llama-bench.
* ``decode cC``: C requests of ``tg`` tokens each, decoded together by :class:`~leat.engine.Engine` (greedy
  sampling, a short prompt each); the rate is every request's generated tokens over the wall time of the run.

Each test runs once untimed (warm-up), then ``repetitions`` times; a row reports tokens per second as mean and
standard deviation over the repetitions, like llama-bench's ``t/s`` column.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from leat.batch import Batch, Row
from leat.model import PREFILL_CHUNK


def _tokens(model: Any, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.architecture.vocab_size, n, dtype=np.int64)


def prefill(model: Any, n: int) -> Callable[[], int]:
    ids = _tokens(model, n)

    def run() -> int:
        kv = model.new_kv(n)
        for start in range(0, n, PREFILL_CHUNK):
            out = model.backend.run(
                model.architecture.forward, Batch([Row(0, start, ids[start : start + PREFILL_CHUNK])]), kv
            )
        model.backend.to_host(out)
        return n

    return run


def decode(model: Any, n: int) -> Callable[[], int]:
    ids = _tokens(model, n)

    def run() -> int:
        kv = model.new_kv(n)
        for pos in range(n):
            out = model.backend.run(model.architecture.forward, Batch([Row(0, pos, ids[pos : pos + 1])]), kv)
            model.backend.to_host(out)  # each step's logits come back, as a sampler needs them
        return n

    return run


def batched_decode(model: Any, concurrency: int, n: int, prompt_tokens: int = 8) -> Callable[[], int]:
    from leat.engine import Engine, GenerationRequest

    engine = Engine(model, batch_size=concurrency, max_context=prompt_tokens + n + 1).start()

    def run() -> int:
        handles = [
            engine.submit(GenerationRequest(list(_tokens(model, prompt_tokens, seed)), n, {"temperature": 0.0}))
            for seed in range(concurrency)
        ]
        generated = 0
        for handle in handles:
            for event in handle:
                if event.kind == "error":
                    raise RuntimeError(event.error)
                if event.kind == "done":
                    generated += event.usage["completion_tokens"]
        return generated

    run.close = engine.stop  # type: ignore[attr-defined]
    return run


def measure(run: Callable[[], int], repetitions: int) -> list[float]:
    run()
    rates = []
    for _ in range(repetitions):
        start = time.perf_counter()
        n = run()
        rates.append(n / (time.perf_counter() - start))
    return rates


def bench(
    model: Any,
    model_name: str,
    prompt: list[int],
    generate: list[int],
    concurrency: list[int],
    repetitions: int = 5,
) -> list[dict[str, Any]]:
    """One row per test: ``model``, ``size`` (bytes), ``params``, ``backend``, ``precision``, ``test``,
    ``n_tokens``, ``repetitions``, ``rates`` and ``tokens_per_second`` with ``stdev``."""
    base = {
        "model": model_name,
        "architecture": model.file.architecture,
        "size": model.file.path.stat().st_size,
        **model.backend.describe(),
    }
    tests: list[tuple[str, int, Callable[[], int]]] = []
    tests += [(f"pp{n}", n, prefill(model, n)) for n in prompt if n > 0]
    tests += [(f"tg{n}", n, decode(model, n)) for n in generate if n > 0]
    tg = max(generate) if generate else 16
    tests += [(f"tg{tg} x{c}", c * tg, batched_decode(model, c, tg)) for c in concurrency if c > 0]
    rows = []
    for name, n, run in tests:
        try:
            rates = measure(run, repetitions)
        finally:
            getattr(run, "close", lambda: None)()
        rows.append(
            base
            | {
                "test": name,
                "n_tokens": n,
                "repetitions": repetitions,
                "tokens_per_second": statistics.fmean(rates),
                "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
                "rates": rates,
            }
        )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """A llama-bench-style markdown table."""
    head = ["model", "size", "backend", "precision", "test", "t/s"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---:" if h == "t/s" else "---" for h in head) + " |"]
    for row in rows:
        size = f"{row['size'] / 2**20:.2f} MiB"
        rate = f"{row['tokens_per_second']:.2f} ± {row['stdev']:.2f}"
        cells = [row["model"], size, row["backend"], row["precision"], row["test"], rate]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
