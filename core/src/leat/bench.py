"""``leat bench``: llama-bench's tests on leat, plus batched decode throughput through the engine.

* ``pp N``: prefill N tokens into an empty cache in one forward pass (chunks of the engine's prefill size).
* ``tg N``: N single-token decode steps into an empty cache, one forward pass each (no sampling), as llama-bench.
* ``decode cC``: C requests of ``tg`` tokens each, decoded together by :class:`~leat.engine.Engine` (greedy
  sampling, a short prompt each); the rate is every request's generated tokens over the wall time of the run.
* ``WORKLOAD tgN`` with a :class:`~leat.speculative.Speculation` (:func:`speculative`): one greedy chat request
  of up to N tokens through the engine, decoded with plain decoding and with speculation, taking turns; the rate
  is decode tokens per second (first token to last, so the prompt's prefill is not counted).

Each test runs once untimed (warm-up), then ``repetitions`` times; a row reports tokens per second as mean and
standard deviation over the repetitions, like llama-bench's ``t/s`` column.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.model import PREFILL_CHUNK

DOCUMENT = (
    "The Rayleigh scattering of sunlight in the atmosphere causes diffuse sky radiation, which is the reason "
    "for the blue color of the daytime and twilight sky, as well as the yellowish to reddish hue of the low Sun. "
    "Sunlight is also subject to Raman scattering, which changes the rotational state of the molecules."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
# chat prompts for the speculative test
WORKLOADS = {
    # repetitive: the answer quotes the prompt back
    "quote": f"Here is a paragraph:\n\n{DOCUMENT}\n\nRepeat the paragraph above word for word.",
    "code": f"{CODE}\nRewrite this Python function with the variable `subtotal` renamed to `net`. Reply with code only.",
    # not repetitive: the answer is new text
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def _tokens(model: Any, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.architecture.vocab_size, n, dtype=np.int64)


def _cache(model: Any, n: int, kv: str, depth: int) -> Any:
    """A one-slot cache of ``depth + n`` positions, its first ``depth`` prefilled here (untimed, once: each run writes
    only the positions after them): the context a test runs after, as llama-bench's ``-d``."""
    cache = model.new_kv(depth + n, dtype=kv)
    context = _tokens(model, depth, seed=1)
    for start in range(0, depth, PREFILL_CHUNK):
        out = model.backend.run(
            model.architecture.forward, Batch([Row(0, start, context[start : start + PREFILL_CHUNK])]), cache
        )
        model.backend.to_host(out)
    return cache


def prefill(model: Any, n: int, kv: str = "f16", depth: int = 0) -> Callable[[], int]:
    ids = _tokens(model, n)
    cache = _cache(model, n, kv, depth)  # one for every run, as llama-bench keeps its context: each run overwrites it

    def run() -> int:
        for start in range(0, n, PREFILL_CHUNK):
            out = model.backend.run(
                model.architecture.forward, Batch([Row(0, depth + start, ids[start : start + PREFILL_CHUNK])]), cache
            )
        model.backend.to_host(out)
        return n

    return run


def decode(model: Any, n: int, kv: str = "f16", depth: int = 0) -> Callable[[], int]:
    ids = _tokens(model, n)
    cache = _cache(model, n, kv, depth)

    def run() -> int:
        for pos in range(n):
            out = model.backend.run(model.architecture.forward, Batch([Row(0, depth + pos, ids[pos : pos + 1])]), cache)
            model.backend.to_host(out)  # each step's logits come back, as a sampler needs them
        return n

    return run


def batched_decode(
    model: Any, concurrency: int, n: int, prompt_tokens: int = 8, kv: str = "f16", profile: bool = False
) -> Callable[[], int]:
    """C requests of ``prompt_tokens`` and ``n`` generated tokens each through one engine; with ``profile`` the run
    keeps the engine's :class:`~leat.engine.StepProfile` of its last repetition in ``run.profile``."""
    from leat.engine import Engine, GenerationRequest

    engine = Engine(model, batch_size=concurrency, max_context=prompt_tokens + n + 1, kv=kv, profile=profile).start()
    seeds = itertools.count()  # new prompts each run: none finds the last run's prefix cached, as a server's would not

    def run() -> int:
        if profile:
            engine.profile.clear()
        handles = [
            engine.submit(
                GenerationRequest(list(_tokens(model, prompt_tokens, seed)), n, {"temperature": 0.0}, ignore_eos=True)
            )
            for seed in itertools.islice(seeds, concurrency)
        ]
        events = [event for handle in handles for event in handle]
        if error := next((event.error for event in events if event.kind == "error"), None):
            raise RuntimeError(error)
        generated = sum(event.usage["completion_tokens"] for event in events if event.kind == "done")
        run.profile = list(engine.profile or [])  # type: ignore[attr-defined]
        return generated

    run.close = engine.stop  # type: ignore[attr-defined]
    return run


def profile_summary(steps: list[Any]) -> dict[str, Any]:
    """Mean milliseconds per step of each part of :class:`~leat.engine.StepProfile`, over the decode steps (those
    with one token per row) and over every step, and the share of decode step time the device was busy."""
    decode = [s for s in steps if s.tokens == s.rows]

    def mean_ms(chosen: list[Any], part: str) -> float | None:
        values = [getattr(s, part) for s in chosen]
        return None if not values or None in values else round(1000 * statistics.fmean(values), 3)

    out: dict[str, Any] = {"steps": len(steps), "decode_steps": len(decode)}
    for part in ("prepare", "wait", "finish", "device"):
        out[f"{part}_ms"] = mean_ms(decode, part)
    whole = [s.prepare + s.wait + s.finish for s in decode]
    out["step_ms"] = round(1000 * statistics.fmean(whole), 3) if whole else None
    out["host_ms"] = round(out["prepare_ms"] + out["finish_ms"], 3) if decode else None
    if out["device_ms"] is not None and out["step_ms"]:
        out["device_busy"] = round(out["device_ms"] / out["step_ms"], 3)
    out["all_steps_ms"] = round(1000 * statistics.fmean(s.prepare + s.wait + s.finish for s in steps), 3)
    return out


@contextmanager
def engines(model: Any, context: int, speculation: Any) -> Iterator[tuple[Any, Any]]:
    """A plain engine and a speculative one (one slot each, ``context`` tokens), kept for a whole measurement as
    a server keeps its engine: a backend's captured steps and the step-cost table are made once, not per run."""
    from leat.engine import Engine

    plain = Engine(model, batch_size=1, max_context=context).start()
    try:
        spec = Engine(model, batch_size=1, max_context=context, speculation=speculation).start()
        try:
            yield plain, spec
        finally:
            spec.stop()
    finally:
        plain.stop()


def engine_decode(engine: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy request alone in ``engine``: its token ids, decode seconds (first token to last), decode
    tokens per second, and the speculation counters of this request (None for an engine without speculation)."""
    from leat.engine import GenerationRequest

    before = engine.stats().get("speculation") or {}
    events = list(engine.submit(GenerationRequest(prompt, max_tokens, {"temperature": 0})))
    after = engine.stats().get("speculation")
    done = events[-1]
    if done.kind == "error":
        raise RuntimeError(done.error)
    seconds = done.timings["total_seconds"] - done.timings["ttft_seconds"]
    generated = done.usage["completion_tokens"]
    if generated < 2 or seconds <= 0:
        raise LeatError(f"the request stopped after {generated} token(s): no decode to time; raise --n-gen")
    out = {"ids": [t for e in events for t in e.ids], "seconds": seconds}
    out["tokens_per_second"] = (generated - 1) / seconds
    out["speculation"] = None if after is None else {key: after[key] - before.get(key, 0) for key in after}
    return out


def speculative(
    model: Any,
    model_name: str,
    speculation: Any,
    workloads: list[str],
    max_tokens: int,
    repetitions: int = 5,
) -> list[dict[str, Any]]:
    """One row per workload: the same greedy request decoded plainly and with ``speculation`` (a
    :class:`~leat.speculative.Speculation`), taking turns repetition by repetition so a noisy machine slows both
    alike, after one untimed run of each. One proposer and step-cost table serve every run, as in a server.

    A row has the fields of :func:`bench`'s rows (``tokens_per_second``, ``stdev`` and ``rates`` are the
    speculative runs'), and ``workload``, ``proposer``, ``plain_tokens_per_second``, ``plain_stdev``,
    ``plain_rates``, ``speedup`` (ratio of the means), ``paired_speedup`` (median of each plain/speculative
    pair's ratio), ``proposed``, ``accepted`` and ``verifications`` (summed over the timed speculative runs),
    ``acceptance`` (accepted / proposed), ``tokens_per_verification`` (tokens a verifying step yields: its
    accepted drafts plus one) and ``identical_output`` (every run, plain or speculative, gave the same tokens).
    """
    unknown = [name for name in workloads if name not in WORKLOADS]
    if unknown:
        raise LeatError(f"unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    rows = []
    prompts = {name: model.chat_prompt([{"role": "user", "content": WORKLOADS[name]}]) for name in workloads}
    with engines(model, max(map(len, prompts.values())) + max_tokens, speculation) as (plain_engine, spec_engine):
        for name, prompt in prompts.items():
            row = _speculative_row(speculation, prompt, max_tokens, repetitions, plain_engine, spec_engine)
            rows.append(_describe(model, model_name) | {"test": f"{name} tg{max_tokens}", "workload": name} | row)
    return rows


def _speculative_row(
    speculation: Any,
    prompt: list[int],
    max_tokens: int,
    repetitions: int,
    plain_engine: Any,
    spec_engine: Any,
) -> dict[str, Any]:
    warm = [engine_decode(plain_engine, prompt, max_tokens), engine_decode(spec_engine, prompt, max_tokens)]
    plain, spec = [], []
    for _ in range(repetitions):
        plain.append(engine_decode(plain_engine, prompt, max_tokens))
        spec.append(engine_decode(spec_engine, prompt, max_tokens))
    counts = {key: sum(run["speculation"][key] for run in spec) for key in ("proposed", "accepted", "verifications")}
    plain_rates = [run["tokens_per_second"] for run in plain]
    rates = [run["tokens_per_second"] for run in spec]
    return {
        "proposer": speculation.proposer.name,
        "n_tokens": len(plain[0]["ids"]),
        "repetitions": repetitions,
        "tokens_per_second": statistics.fmean(rates),
        "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        "rates": rates,
        "plain_tokens_per_second": statistics.fmean(plain_rates),
        "plain_stdev": statistics.stdev(plain_rates) if len(plain_rates) > 1 else 0.0,
        "plain_rates": plain_rates,
        "speedup": statistics.fmean(rates) / statistics.fmean(plain_rates),
        "paired_speedup": statistics.median(s / p for s, p in zip(rates, plain_rates)),
        **counts,
        "acceptance": counts["accepted"] / counts["proposed"] if counts["proposed"] else 0.0,
        "tokens_per_verification": (
            (counts["accepted"] + counts["verifications"]) / counts["verifications"] if counts["verifications"] else 1.0
        ),
        "identical_output": all(run["ids"] == warm[0]["ids"] for run in warm + plain + spec),
    }


def _describe(model: Any, model_name: str) -> dict[str, Any]:
    return {
        "model": model_name,
        "architecture": model.file.architecture,
        "size": model.file.path.stat().st_size,
        **model.backend.describe(),
    }


def measure(run: Callable[[], int], repetitions: int) -> tuple[list[float], float]:
    """Tokens per second of each of ``repetitions`` runs, and the seconds of the untimed warm-up run before them
    (where a backend compiles its kernels: tinygrad's second start finds them in its cache)."""
    start = time.perf_counter()
    run()
    warmup = time.perf_counter() - start
    rates = []
    for _ in range(repetitions):
        start = time.perf_counter()
        n = run()
        rates.append(n / (time.perf_counter() - start))
    return rates, warmup


def bench(
    model: Any,
    model_name: str,
    prompt: list[int],
    generate: list[int],
    concurrency: list[int],
    repetitions: int = 5,
    kv: str = "f16",
    batch_prompt: int = 8,
    profile: bool = False,
    progress: Callable[[str], None] | None = None,
    depths: list[int] | tuple[int, ...] = (0,),
) -> list[dict[str, Any]]:
    """One row per test: ``model``, ``size`` (bytes), ``params``, ``backend``, ``precision``, ``test``,
    ``n_tokens``, ``n_depth``, ``repetitions``, ``rates`` and ``tokens_per_second`` with ``stdev``, and
    ``warmup_seconds`` (the untimed first run). Each prefill and decode test runs after each of ``depths`` positions
    of context (llama-bench's ``-d``; named ``pp512 @ d4096`` as it names them). Batched decode tests give each
    request a prompt of ``batch_prompt`` tokens; with ``profile`` their rows carry ``profile`` (:func:`profile_summary`
    of the last repetition). ``progress`` gets a line of text as each test starts and ends."""
    base = _describe(model, model_name) | {"kv": kv}
    if any(depths) and (longest := max(depths) + max([*prompt, *generate], default=0)) > model.context_length:
        raise LeatError(f"a test at depth {max(depths)} reaches {longest}: past the context of {model.context_length}")
    tests: list[tuple[str, int, int, Callable[[], Callable[[], int]]]] = []  # name, tokens, depth, its run's maker
    for d in depths:
        at = f" @ d{d}" if d else ""
        tests += [(f"pp{n}{at}", n, d, functools.partial(prefill, model, n, kv, d)) for n in prompt if n > 0]
        tests += [(f"tg{n}{at}", n, d, functools.partial(decode, model, n, kv, d)) for n in generate if n > 0]
    tg = max(generate) if generate else 16
    label = f"tg{tg}" if batch_prompt == 8 else f"pp{batch_prompt}+tg{tg}"
    batched = functools.partial(batched_decode, model, n=tg, prompt_tokens=batch_prompt, kv=kv, profile=profile)
    tests += [(f"{label} x{c}", c * tg, 0, functools.partial(batched, c)) for c in concurrency if c > 0]
    rows = []
    for index, (name, n, depth, make) in enumerate(tests, 1):
        if progress:
            progress(f"{name} ({index}/{len(tests)}): {repetitions} runs after a warm-up")
        run = make()  # a test's cache (and its depth's prefill) only while it runs
        try:
            rates, warmup = measure(run, repetitions)
        finally:
            getattr(run, "close", lambda: None)()
        rows.append(
            base
            | {
                "test": name,
                "n_tokens": n,
                "n_depth": depth,
                "repetitions": repetitions,
                "tokens_per_second": statistics.fmean(rates),
                "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
                "rates": rates,
                "warmup_seconds": warmup,
            }
            | ({"profile": profile_summary(run.profile)} if getattr(run, "profile", None) else {})
        )
        if progress:
            progress(f"{name} ({index}/{len(tests)}): {rows[-1]['tokens_per_second']:.2f} t/s")
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    """A llama-bench-style markdown table; speculative rows (:func:`speculative`) get a table of their own."""
    plain = [row for row in rows if "speedup" not in row]
    spec = [row for row in rows if "speedup" in row]
    tables = []
    if plain or not spec:
        head = ["model", "size", "backend", "precision", "kv", "test", "t/s"]
        lines = [_row(head), _row("---:" if h == "t/s" else "---" for h in head)]
        for row in plain:
            rate = f"{row['tokens_per_second']:.2f} ± {row['stdev']:.2f}"
            cells = [row["model"], _size(row), row["backend"], row["precision"], row.get("kv", ""), row["test"], rate]
            lines.append(_row(cells))
        tables.append("\n".join(lines))
    profiled = [row for row in plain if "profile" in row]
    if profiled:
        parts = ["steps", "step_ms", "prepare_ms", "wait_ms", "finish_ms", "host_ms", "device_ms", "device_busy"]
        lines = [_row(["test", *parts]), _row(["---"] + ["---:"] * len(parts))]
        lines += [_row([row["test"], *(str(row["profile"].get(p)) for p in parts)]) for row in profiled]
        tables.append("Decode steps (ms each, means; host = prepare + finish):\n\n" + "\n".join(lines))
    if spec:
        head = ["model", "size", "backend", "precision", "test", "proposer", "plain t/s", "speculative t/s"]
        head += ["speed-up", "acceptance", "tokens/step", "same output"]
        numeric = head[6:-1]
        lines = [_row(head), _row("---:" if h in numeric else "---" for h in head)]
        for row in spec:
            cells = [row["model"], _size(row), row["backend"], row["precision"], row["test"], row["proposer"]]
            cells += [f"{row['plain_tokens_per_second']:.2f} ± {row['plain_stdev']:.2f}"]
            cells += [f"{row['tokens_per_second']:.2f} ± {row['stdev']:.2f}", f"{row['speedup']:.2f}x"]
            cells += [f"{row['acceptance']:.2f}", f"{row['tokens_per_verification']:.2f}"]
            cells += ["yes" if row["identical_output"] else "NO"]
            lines.append(_row(cells))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def _row(cells: Any) -> str:
    return "| " + " | ".join(cells) + " |"


def _size(row: dict[str, Any]) -> str:
    return f"{row['size'] / 2**20:.2f} MiB"
