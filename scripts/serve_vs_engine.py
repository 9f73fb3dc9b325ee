#!/usr/bin/env python3
"""The server against its own engine, in one run: what `leat serve` delivers under a streaming load, beside
what `leat bench` decodes through the engine alone on the same file.

    python scripts/serve_vs_engine.py MODEL --backend cuda --load scripts/bench/load_openai.py \\
        --serve "64:1,64" --serve "256:256" --bench "--concurrency 1,8,32,64 -n 128 --batch-prompt 128 -r 1"

Each ``--serve BATCH:C1,C2`` starts ``leat serve MODEL --batch-size BATCH`` (with ``--serve-args``), times
how long it takes to answer /health, runs the load script at each concurrency (an untimed round of one request
per client first, as ``leat bench`` warms up; then ``--requests-per-client`` requests per client, prompts of ``--prompt-tokens`` token ids, ``--max-tokens`` each, greedy, streamed),
then stops the server with SIGTERM and times that too. Prints one JSON line per measurement, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request


def wait_ready(url: str, process: subprocess.Popen, timeout: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"the server did not answer /health within {timeout:.0f} s")


def stamp_lines(stream, path: str, start: float) -> None:
    with open(path, "w") as output:
        # the stamps' origin as Unix time, to line the request log up with `leat serve --step-log`'s steps
        output.write(f"[{0:7.2f} s] log clock: 0.00 s is Unix time {time.time() - (time.perf_counter() - start):.3f}\n")
        for line in stream:
            output.write(f"[{time.perf_counter() - start:7.2f} s] {line}")
            output.flush()


def stop(process: subprocess.Popen) -> float:
    start = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return time.perf_counter() - start


def serve_runs(args: argparse.Namespace, spec: str) -> list[dict]:
    batch, concurrencies = spec.split(":")
    port = args.port
    command = [*shlex.split(args.leat), "serve", args.model, "--port", str(port), "--batch-size", batch]
    command += shlex.split(args.serve_args)
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    log = f"{args.log_dir}/serve-{batch}.log" if args.log_dir else os.devnull
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # each line of the server's output with the seconds since it started, so the log shows where "ready" went
    threading.Thread(target=stamp_lines, args=(process.stdout, log, time.perf_counter()), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    rows = []
    seeds = 0  # every request of every run a prompt of its own: none finds another's prefix cached
    try:
        ready = wait_ready(url, process, args.ready_timeout)
        rows.append({"what": "serve ready", "batch_size": int(batch), "seconds": round(ready, 2)})
        print(json.dumps(rows[-1]), flush=True)
        for c in (int(x) for x in concurrencies.split(",")):
            load = [sys.executable, args.load, "--url", url, "-c", str(c)]
            load += ["--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)]
            load += ["--vocab", str(args.vocab)]
            if args.warmup:  # as leat bench does: one untimed round first (graph captures, allocations)
                warm = [*load, "-n", str(c), "--seed", str(seeds)]
                subprocess.run(warm, check=False, capture_output=True, timeout=args.load_timeout)
                seeds += c
            load += ["-n", str(c * args.requests_per_client), "--seed", str(seeds)]
            seeds += c * args.requests_per_client
            before, logged = engine_counters(url), os.path.getsize(log) if args.log_dir else 0
            out = subprocess.run(load, check=False, capture_output=True, text=True, timeout=args.load_timeout)
            result = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {"error": out.stderr}
            after = engine_counters(url)
            steps = {key: round(after[key] - before[key], 3) for key in after if key in before}
            if "busy_seconds" in steps and result.get("wall_s"):
                steps["busy_share"] = round(steps["busy_seconds"] / result["wall_s"], 3)
            server = server_timings(log, logged) if args.log_dir else {}
            rows.append({"what": "serve", "batch_size": int(batch), **result, "engine": steps, "server": server})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        rows.append({"what": "serve stop", "batch_size": int(batch), "seconds": round(stop(process), 2)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


LOGGED = re.compile(
    r"first byte (\d+) ms, \d+ bytes; (?:sent at \d+ ms, )?accepted at (\d+) ms, first token (\d+) ms after"
)


def server_timings(log: str, offset: int) -> dict[str, float]:
    """Medians over the run's requests of the server's own timings (its request log, from where the request
    reached it): when the engine accepted it, the engine's first token after that, the first byte out."""
    time.sleep(0.5)  # the last requests' lines are written as their responses end
    with open(log) as f:
        f.seek(offset)
        found = [tuple(int(x) for x in m.groups()) for m in LOGGED.finditer(f.read())]
    if not found:
        return {}
    first, accepted, engine = (sorted(column)[len(column) // 2] for column in zip(*found))
    return {
        "requests": len(found),
        "accepted_ms_p50": accepted,
        "engine_first_ms_p50": engine,
        "first_byte_ms_p50": first,
    }


def engine_counters(url: str) -> dict[str, float]:
    """The engine's step counters from the server's /metrics (leat_engine_*_total), to tell how the load's tokens
    were batched: steps, those carrying a prompt chunk, decode steps queued ahead, seconds spent in steps."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    counters = {}
    for line in text.splitlines():
        if line.startswith("leat_engine_") and "_total " in line:
            name, value = line.split()
            counters[name.removeprefix("leat_engine_").removesuffix("_total")] = float(value)
    return counters


def bench_runs(args: argparse.Namespace) -> list[dict]:
    command = [*shlex.split(args.leat), "bench", args.model, *shlex.split(args.serve_backend_args), "--json"]
    command += shlex.split(args.bench)
    out = subprocess.run(command, check=False, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"leat bench failed:\n{out.stderr[-3000:]}")
    rows = [{"what": "bench", **row} for row in json.loads(out.stdout)]
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    header = "| what | batch | c | requests | failed | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | engine steps "
    lines = [header + "| server p50 ms: accepted / engine's first token after / first byte |"]
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["what"] == "serve":
            cells = [r.get(k) for k in ("requests", "failed", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99")]
            lines.append(
                f"| serve | {r['batch_size']} | {r.get('concurrency')} | "
                + " | ".join(str(c) for c in cells)
                + f" | {r.get('itl_ms_p50')} | {steps_cell(r.get('engine') or {})} | {server_cell(r.get('server') or {})} |"
            )
        elif r["what"] == "bench":
            lines.append(f"| bench {r.get('test', '')} | | | | | {r['tokens_per_second']:.1f} | | | | | |")
        else:
            lines.append(f"| {r['what']} | {r['batch_size']} | | | | {r['seconds']} s | | | | | |")
    return "\n".join(lines)


def server_cell(server: dict[str, float]) -> str:
    if not server:
        return ""
    return f"{server['accepted_ms_p50']} / {server['engine_first_ms_p50']} / {server['first_byte_ms_p50']}"


def steps_cell(steps: dict[str, float]) -> str:
    """``N (P with prompts, A ahead), busy B%`` from the engine counters of one load run."""
    if "steps" not in steps:
        return ""
    busy = f", busy {100 * steps['busy_share']:.0f}%" if "busy_share" in steps else ""
    return f"{steps['steps']:.0f} ({steps.get('prefill_steps', 0):.0f} with prompts, {steps.get('steps_ahead', 0):.0f} ahead){busy}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--leat", default="leat", help="how to run leat (e.g. 'uv run leat')")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--load", required=True, help="path of load_openai.py")
    ap.add_argument("--serve", action="append", default=[], help="BATCH:C1,C2,... (repeatable)")
    ap.add_argument("--serve-args", default="", help="more `leat serve` options")
    ap.add_argument("--bench", default=None, help="`leat bench` options; none: no engine run")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="no untimed round before each load")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--port", type=int, default=8181)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--load-timeout", type=float, default=600)
    ap.add_argument("--log-dir", default=os.environ.get("OUT"))
    args = ap.parse_args()
    backend = f"--backend {args.backend} " if args.backend else ""
    args.serve_backend_args = f"{backend}--kv {args.kv}"
    context = args.prompt_tokens + args.max_tokens + 64
    args.serve_args = f"{args.serve_backend_args} --max-context {context} {args.serve_args}"
    rows = bench_runs(args) if args.bench is not None else []
    for spec in args.serve:
        rows += serve_runs(args, spec)
    print(table(rows))


if __name__ == "__main__":
    main()
