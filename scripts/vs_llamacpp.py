#!/usr/bin/env python3
"""leat beside llama.cpp on one file, in one process, so both sides share the machine and its state: prompt and
decode speed (``leat bench`` beside ``llama-bench``) and batched decode (``leat bench --concurrency`` beside
``llama-batched-bench``'s S_TG), each pair with its ratio.

    python scripts/vs_llamacpp.py FILE --llama-bin DIR [--backend cuda] [--pp 512] [--tg 128] [--depth 0] [--reps 2]
        [--concurrency 8,16,32,64] [--batch-prompt 128] [--rounds 1] [--json OUT]

DIR holds llama.cpp's ``llama-bench`` and ``llama-batched-bench`` (not part of leat: build them from llama.cpp's
source, for instance the copy in the llama-cpp-python sdist, ``cmake -B b -DGGML_CUDA=ON && cmake --build b --target
llama-bench llama-batched-bench``). Each round runs leat's tests and then llama.cpp's. The settings are matched:
f16 KV on both sides; llama.cpp with every layer on the GPU and flash attention (``-ngl 99 -fa 1`` for llama-bench,
``-ngl 99 -fa on`` for llama-batched-bench, which spell it differently) unless ``--bench-args`` and ``--batched-args``
say otherwise (``--backend cpu``: ``-ngl 0``); batched decode after prompts of ``--batch-prompt``
tokens on both sides (``leat bench --batch-prompt``, ``llama-batched-bench -npp``), ``--tg`` tokens a sequence;
with ``--depth D``, pp and tg after D positions of context on both sides (``-d D``: ``pp512 @ dD``). The
table's leat figures are ``leat bench``'s means over ``--reps`` runs, llama-bench's its ``avg_ts``, and
llama-batched-bench's the S_TG of its one run a sequence count. leat's batched figure counts the generated tokens
over the whole run, its prompts' prefill included, where S_TG leaves llama.cpp's prompt processing out: each batched
row is also set beside the generated tokens over llama.cpp's whole run (pl x tg / (T_PP + T_TG)), like for like. At
8-token prompts the two barely differ; at 128 S_TG favours llama.cpp. Prints a Markdown table per round and, with
``--json``, writes every figure with both builds' versions.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path


def leat_rows(file: str, backend: str, args: list[str]) -> list[dict]:
    """``leat bench FILE --backend BACKEND --kv f16 ARGS --json``'s rows."""
    command = [sys.executable, "-m", "leat", "bench", file, "--backend", backend, "--kv", "f16", *args, "--json"]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def llama_bench(binary: Path, file: str, pp: int, tg: int, reps: int, extra: list[str]) -> list[dict]:
    """llama-bench's JSON rows (``-o json``): one with n_prompt = pp, one with n_gen = tg."""
    command = [str(binary), "-m", file, "-p", str(pp), "-n", str(tg), "-r", str(reps), "-o", "json", *extra]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def batched_bench(
    binary: Path, file: str, prompt: int, tg: int, counts: list[int], extra: list[str], tries: int = 3
) -> list[dict]:
    """llama-batched-bench's JSON lines (``--output-format jsonl``), one per sequence count. Its lines go through
    llama.cpp's asynchronous logger, which may lose the last of them when the process exits (llama.cpp issue 22142;
    seen with small models): a count whose line is missing runs again alone, up to ``tries`` times in all."""
    context = max(counts) * (prompt + tg) + 16
    base = [str(binary), "-m", file, "-c", str(context), "-b", "2048", "-ub", "512", "-npp", str(prompt)]
    base += ["-ntg", str(tg), "--output-format", "jsonl", *extra]
    found: dict[int, dict] = {}
    missing = counts
    for _ in range(tries):
        done = subprocess.run([*base, "-npl", ",".join(map(str, missing))], capture_output=True, text=True, check=True)
        for line in (done.stdout + done.stderr).splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                found[row["pl"]] = row
        missing = [c for c in counts if c not in found]
        if not missing:
            return [found[c] for c in counts]
    raise SystemExit(f"llama-batched-bench printed no result for {missing} sequences in {tries} runs")


def pairs(leat: list[dict], bench: list[dict], batched: list[dict]) -> list[dict]:
    """One row per test that both sides ran: test name (leat's), leat's tok/s and its deviation, llama.cpp's, ratio.
    leat's batched tests (``tg128 xN``, or ``pp128+tg128 xN`` after longer prompts) pair with llama-batched-bench's
    line of N sequences (one run of each side has one prompt length and one decode length)."""
    theirs: dict[str, float] = {}
    for row in bench:
        name = f"pp{row['n_prompt']}" if row["n_prompt"] and not row["n_gen"] else f"tg{row['n_gen']}"
        depth = row.get("n_depth", 0)  # llama-bench -d's rows, named as leat bench -d names its
        theirs[name + (f" @ d{depth}" if depth else "")] = row["avg_ts"]
    sequences = {row["pl"]: row for row in batched}
    out = []
    for row in leat:
        test = row["test"]
        line = sequences.get(int(test.rsplit(" x", 1)[1])) if " x" in test else None
        other = line["speed_tg"] if line is not None else theirs.get(test)
        if other is not None:
            mine = row["tokens_per_second"]
            pair = {
                "test": test,
                "leat": mine,
                "leat_stdev": row.get("stdev"),
                "leat_rates": row.get("rates"),  # each run's, to see a spread's cause (a slow first run)
                "llama.cpp": other,
                "ratio": mine / other,
            }
            if line is not None and line.get("t"):
                # leat bench's batched figure is the generated tokens over the whole run, its prompts' prefill
                # included; S_TG leaves llama.cpp's prompt processing out. The same count over llama.cpp's whole
                # run (T_PP + T_TG) is the like-for-like figure
                served = line["pl"] * line["tg"] / line["t"]
                pair |= {"llama.cpp_with_prompts": served, "ratio_with_prompts": mine / served}
            out.append(pair)
    return out


def table(rows: list[dict]) -> str:
    """The rows as Markdown; batched rows also beside llama.cpp's generated tokens over its whole run (prompts in)."""
    lines = [
        "| test | leat tok/s | llama.cpp tok/s | ratio | llama.cpp, prompts' time in | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        spread = f" ± {r['leat_stdev']:,.1f}" if r["leat_stdev"] is not None else ""
        served = r.get("llama.cpp_with_prompts")
        tail = f"{served:,.1f} | {r['ratio_with_prompts']:.2f}x" if served else " | "
        lines.append(f"| {r['test']} | {r['leat']:,.1f}{spread} | {r['llama.cpp']:,.1f} | {r['ratio']:.2f}x | {tail} |")
    return "\n".join(lines)


def leat_version() -> str:
    """The leat checkout's commit where there is one ("-dirty" after it where the checkout's tracked files differ from
    it: a copy of a working tree, as a device machine runs, is not that commit), else the installed version."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return done.stdout.strip()
    from importlib.metadata import version

    return version("leat-core")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--llama-bin", required=True, type=Path, help="the folder of llama-bench and llama-batched-bench")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--depth", type=int, default=0, help="positions of context pp and tg run after (-d on both sides)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--concurrency", default="8,16,32,64", help="sequence counts of batched decode ('' for none)")
    ap.add_argument("--batch-prompt", type=int, default=128, help="prompt tokens of each sequence in batched decode")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--bench-args", default=None, help="llama-bench's flags (default: -ngl 99 -fa 1)")
    ap.add_argument("--batched-args", default=None, help="llama-batched-bench's flags (default: -ngl 99 -fa on)")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args()
    cpu = args.backend == "cpu"
    bench_extra = shlex.split(args.bench_args if args.bench_args is not None else "-ngl 0" if cpu else "-ngl 99 -fa 1")
    batched_default = "-ngl 0" if cpu else "-ngl 99 -fa on"
    batched_extra = shlex.split(args.batched_args if args.batched_args is not None else batched_default)
    counts = [int(c) for c in args.concurrency.split(",") if c.strip()]
    report: dict = {"model": args.model, "backend": args.backend, "leat": leat_version(), "rounds": []}
    for index in range(args.rounds):
        tests = ["-p", str(args.pp), "-n", str(args.tg), "-r", str(args.reps), "--batch-prompt", str(args.batch_prompt)]
        depth = ["-d", str(args.depth)] if args.depth else []
        leat = leat_rows(args.model, args.backend, [*tests, *depth, "--concurrency", ",".join(map(str, counts))])
        bench_binary = args.llama_bin / "llama-bench"
        bench = llama_bench(bench_binary, args.model, args.pp, args.tg, args.reps, [*bench_extra, *depth])
        batched = []
        if counts:
            batched_binary = args.llama_bin / "llama-batched-bench"
            batched = batched_bench(batched_binary, args.model, args.batch_prompt, args.tg, counts, batched_extra)
        rows = pairs(leat, bench, batched)
        build = bench[0].get("build_commit") if bench else None
        report["rounds"].append({"rows": rows, "llama.cpp": build})
        print(
            f"## round {index + 1}: leat {report['leat']}, llama.cpp {build}, {args.backend}\n\n{table(rows)}\n",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as error:  # a side failed: its command and the end of what it said
        raise SystemExit(f"{' '.join(map(str, error.cmd))} exited with {error.returncode}:\n{error.stderr[-3000:]}")
    except FileNotFoundError as error:
        raise SystemExit(f"{error.filename}: not found (--llama-bin names the folder of llama.cpp's tools)")
