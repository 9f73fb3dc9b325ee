"""Decode and prompt speed of leat's CPU backend beside llama.cpp's llama-bench, interleaved.

    uv run python scripts/cpu_vs_llamacpp.py --llama-bench /path/to/llama-bench [--model default] [--rounds 3]
        [--threads 2] [--weights quantized|dequantized]

llama-bench is not part of leat: build it from llama.cpp's source (for instance the copy inside the llama-cpp-python
sdist: `cmake -B build -DGGML_NATIVE=ON && cmake --build build --target llama-bench`; add `-DLLAMA_BUILD_SERVER=OFF`
where the sdist lacks tools/ui). Each round runs llama-bench (pp128, tg64, 2 threads) and then leat on the same file
(prompt of 128 tokens, then 64 greedy tokens), so both see the same machine load. leat's KV cache is f16, as
llama-bench's is by default. leat's CPU backend gets the same --threads; `--weights dequantized` measures its float32
reference path instead of the quantized one. Prints one JSON line per round and a median summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import leat
import numpy as np
from leat.batch import Batch, Row
from leat.pull import resolve


def llama_bench(binary: str, path: str, threads: int) -> dict[str, float]:
    out = subprocess.run(
        [binary, "-m", path, "-p", "128", "-n", "64", "-t", str(threads), "-r", "3", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(out)
    return {("pp128" if r["n_prompt"] else "tg64"): r["avg_ts"] for r in rows}


def leat_bench(model) -> dict[str, float]:
    arch, backend = model.architecture, model.backend
    ids = np.random.default_rng(0).integers(0, arch.vocab_size, 128)
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), 1, 256, dtype="f16")
    started = time.perf_counter()
    backend.to_host(arch.forward(Batch([Row(0, 0, ids)]), kv))
    prompt = 128 / (time.perf_counter() - started)
    token, started = np.array([ids[-1]]), time.perf_counter()
    for i in range(64):
        logits = backend.to_host(arch.forward(Batch([Row(0, 128 + i, token)]), kv))
        token = np.array([int(np.argmax(logits[-1]))])
    return {"pp128": prompt, "tg64": 64 / (time.perf_counter() - started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bench", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", choices=["quantized", "dequantized"], default="quantized")
    args = parser.parse_args()
    path = str(resolve(args.model))
    model = leat.load(path, backend="cpu", backend_options={"threads": args.threads, "weights": args.weights})
    results = []
    for round_ in range(args.rounds):
        row = {
            "round": round_,
            "llama.cpp": llama_bench(args.llama_bench, path, args.threads),
            "leat": leat_bench(model),
        }
        results.append(row)
        print(json.dumps(row))
    summary = {}
    for test in ("pp128", "tg64"):
        ours = statistics.median(r["leat"][test] for r in results)
        theirs = statistics.median(r["llama.cpp"][test] for r in results)
        summary[test] = {"leat": round(ours, 1), "llama.cpp": round(theirs, 1), "ratio": round(ours / theirs, 3)}
    print(json.dumps({"model": path, "leat": model.backend.describe(), "median": summary}))


if __name__ == "__main__":
    main()
