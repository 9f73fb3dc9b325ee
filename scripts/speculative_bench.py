"""Speculative decoding on one workload at a time: the same requests with and without a proposer.

    uv run python scripts/speculative_bench.py [MODEL] [--speculate ngram|draft] [--draft MODEL]
        [--backend cpu] [--max-tokens 48] [--repeats 3] [--workloads quote,code,story]

Runs each workload (greedy, one request alone, so both modes produce the same tokens) with plain
decoding and with speculation, interleaved repeat by repeat so a noisy machine slows both alike.
Prints one JSON line per workload: median decode tokens per second of each mode, the speed-up
(ratio of medians, and the median of each adjacent pair's ratio), acceptance (accepted / proposed draft tokens) and tokens per verification step.
Decode time is from the first token to the last, so the prompt's prefill is not counted.
`leat bench --speculate ngram|draft` runs the same workloads (from leat.bench) with means and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import leat
from leat.bench import WORKLOADS, engines
from leat.bench import engine_decode as decode
from leat.speculative import Speculation, load_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--speculate", default="ngram")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    args = parser.parse_args()
    model = leat.load(args.model, backend=args.backend)
    options = {"draft": leat.load(args.draft, backend=args.backend)} if args.draft else {}
    # one proposer and cost table for the whole run, as a server keeps them; each request has its own controller
    speculation = Speculation(load_proposer(args.speculate, model, **options))
    names = args.workloads.split(",")
    prompts = {name: model.chat_prompt([{"role": "user", "content": WORKLOADS[name]}]) for name in names}
    with engines(model, max(map(len, prompts.values())) + args.max_tokens, speculation) as (plain_engine, spec_engine):
        for name, prompt in prompts.items():
            measure(args, name, prompt, plain_engine, spec_engine)


def measure(args, name: str, prompt: list[int], plain_engine, spec_engine) -> None:
    """Plain and speculative runs of one workload, taking turns; prints one JSON line."""
    runs: dict[str, list[dict]] = {"plain": [], "speculative": []}
    for _ in range(args.repeats):
        runs["plain"].append(decode(plain_engine, prompt, args.max_tokens))
        runs["speculative"].append(decode(spec_engine, prompt, args.max_tokens))
    pairs = list(zip(runs["plain"], runs["speculative"]))
    same = all(r["ids"] == runs["plain"][0]["ids"] for r in runs["plain"] + runs["speculative"])
    plain = statistics.median(r["tokens_per_second"] for r in runs["plain"])
    spec = statistics.median(r["tokens_per_second"] for r in runs["speculative"])
    proposed = sum(r["speculation"]["proposed"] for r in runs["speculative"])
    accepted = sum(r["speculation"]["accepted"] for r in runs["speculative"])
    verifications = sum(r["speculation"]["verifications"] for r in runs["speculative"])
    line = {
        "workload": name,
        "proposer": args.speculate,
        "backend": args.backend,
        "generated_tokens": len(runs["plain"][0]["ids"]),
        "plain_tokens_per_second": round(plain, 3),
        "speculative_tokens_per_second": round(spec, 3),
        "speedup": round(spec / plain, 3),
        # each speculative run against the plain run just before it: both saw about the same machine load
        "paired_speedup": round(
            statistics.median(s["tokens_per_second"] / p["tokens_per_second"] for p, s in pairs), 3
        ),
        "acceptance": round(accepted / proposed, 3) if proposed else None,
        "tokens_per_verification": round((accepted + verifications) / verifications, 3) if verifications else None,
        "plain_runs": [round(r["tokens_per_second"], 3) for r in runs["plain"]],
        "speculative_runs": [round(r["tokens_per_second"], 3) for r in runs["speculative"]],
        "identical_output": same,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
