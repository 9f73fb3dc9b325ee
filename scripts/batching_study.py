"""Batched-service study: one concurrent workload served with --batch-size 8 and with 1.

    uv run python scripts/batching_study.py [MODEL] [--requests 16] [--prompt-tokens 64] [--max-tokens 32]

Submits every request at once to an Engine (the same scheduler `leat serve` uses) and prints one
JSON line per batch size: aggregate generated tokens per second and time-to-first-token
percentiles. Greedy sampling, so both runs generate the same tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import leat
import numpy as np
from leat.engine import Engine, GenerationRequest


def serve(model, batch_size: int, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = Engine(model, batch_size=batch_size, max_context=max(map(len, prompts)) + max_tokens, prefill_chunk=256)
    engine.start()
    started = time.perf_counter()
    handles = [engine.submit(GenerationRequest(p, max_tokens, {"temperature": 0})) for p in prompts]
    ttft, generated = [], 0
    for handle in handles:
        for event in handle:
            if event.kind == "done":
                ttft.append(event.timings["ttft_seconds"])
                generated += event.usage["completion_tokens"]
    elapsed = time.perf_counter() - started
    engine.stop()
    return {
        "batch_size": batch_size,
        "requests": len(prompts),
        "generated_tokens": generated,
        "seconds": round(elapsed, 3),
        "aggregate_tokens_per_second": round(generated / elapsed, 2),
        "ttft_p50_ms": round(1000 * float(np.percentile(ttft, 50)), 1),
        "ttft_p90_ms": round(1000 * float(np.percentile(ttft, 90)), 1),
        "ttft_p99_ms": round(1000 * float(np.percentile(ttft, 99)), 1),
        "steps": engine.steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="8,1")
    args = parser.parse_args()
    model = leat.load(args.model, backend=args.backend)
    rng = np.random.default_rng(0)
    text_ids = model.tokenize("The history of astronomy is long and full of surprises. " * 40, add_special=False)
    prompts = []
    for _ in range(args.requests):
        start = int(rng.integers(0, len(text_ids) - args.prompt_tokens))
        prompts.append(text_ids[start : start + args.prompt_tokens])
    for size in (int(s) for s in args.batch_sizes.split(",")):
        print(
            json.dumps(
                {"model": args.model, **model.backend.describe(), **serve(model, size, prompts, args.max_tokens)}
            )
        )


if __name__ == "__main__":
    main()
