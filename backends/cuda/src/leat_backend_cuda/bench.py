"""Prompt and generation speed on the CUDA backend, printed as llama-bench-style rows.

    python -m leat_backend_cuda.bench MODEL.gguf [--pp 512] [--tg 128] [--reps 3] [--micro]

``pp N``: one forward over N prompt tokens. ``tg N``: N decode steps of one token from an empty
cache, each replaying the captured graph and copying the logits to the host (a generation loop
without sampling); ``tg N device`` replays without the copies. Bandwidth is the weight bytes a
decode step reads (every matrix but the embedding table) over the time per token. ``--micro``
adds each weight shape's matrix-vector product alone, and the GEMM at 512 tokens.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from typing import Any

import numpy as np
from leat.batch import Batch, Row
from leat.modelfile import ModelFile

from leat_backend_cuda import compiler, driver, quants
from leat_backend_cuda.backend import CUDABackend, Matrix, _ready


def architecture(file: ModelFile, ref: str | None):
    if ref:
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)
    from leat.model import architecture_class

    return architecture_class(file)


def one_token_step(path: str, position: int, context: int | None = None) -> tuple[CUDABackend, Any, Batch, Any]:
    """A CUDA backend with the file at ``path`` loaded (its architecture), a one-slot f16 cache of ``context``
    positions (default ``position`` + 64; a server's cache is longer) and a one-token batch at ``position``: what
    the decode-step scripts (``scripts/decode_shapes.py``, ``decode_parts.py``) time."""
    file = ModelFile(path)
    backend = CUDABackend()
    arch = architecture(file, None)(file, backend)
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), 1, context or position + 64, dtype="f16")
    token = np.random.default_rng(0).integers(0, arch.vocab_size, 1)
    return backend, arch, Batch([Row(0, position, token)]), kv


def step_arguments(description: str | None, rounds: int) -> argparse.ArgumentParser:
    """The decode-step scripts' arguments (MODEL, --position, --context, --reps, --rounds), for
    :func:`one_token_step`."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--position", type=int, default=128)
    ap.add_argument("--context", type=int, help="the cache's positions (default: the position + 64)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=rounds)
    return ap


def with_cublas(path: str) -> tuple[CUDABackend, Any]:
    """A CUDA backend with cuBLAS and the file at ``path`` loaded on it (its architecture); exits saying why where
    cuBLAS is missing (the scripts that compare its products with the own kernels)."""
    file = ModelFile(path)
    backend = CUDABackend()
    if backend.cublas is None:
        raise SystemExit(f"cuBLAS is not available: {backend.describe()['cublas']}")
    return backend, architecture(file, None)(file, backend)


def matrices(arch: Any) -> list[tuple[str, Matrix]]:
    """Every weight matrix an architecture holds, found by walking its attributes."""
    found: dict[int, tuple[str, Matrix]] = {}

    def walk(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, Matrix):
            found.setdefault(id(obj), (path, obj))
        elif depth < 4 and isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]", depth + 1)
        elif depth < 4 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for key, value in vars(obj).items():
                if key not in ("backend", "file", "params"):
                    walk(value, f"{path}.{key}" if path else key, depth + 1)

    walk(arch, "", 0)
    return list(found.values())


def decode_bytes(arch: Any) -> int:
    embedding = getattr(arch, "embedding", None)
    output = getattr(arch, "output", None)
    return sum(m.memory.nbytes for _, m in matrices(arch) if m is not embedding or m is output)


def median(values: list[float]) -> float:
    return float(np.median(values))


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    file = ModelFile(args.model)
    cls = architecture(file, args.architecture)
    started = time.perf_counter()
    backend = CUDABackend(graphs=not args.no_graphs, tensor_cores=not args.no_tensor_cores)
    arch = cls(file, backend)
    backend.device.synchronize()
    load_seconds = time.perf_counter() - started
    layouts = arch.kv_layouts(arch.params)
    vocab = arch.vocab_size
    rng = np.random.default_rng(0)
    size = sum(m.memory.nbytes for _, m in matrices(arch))
    step_bytes = decode_bytes(arch)
    rows: list[dict[str, Any]] = []
    info = backend.describe()
    print(f"# {file.path.name}: {size / 2**30:.2f} GiB of matrices, {step_bytes / 1e9:.2f} GB read per decode step")
    where = f"{info['device']} ({info['arch']}), driver {info['driver']}, NVRTC {info['nvrtc']}"
    print(f"# {where}, load {load_seconds:.1f} s")

    def row(test: str, tokens: int, seconds: list[float], extra: dict | None = None) -> None:
        rates = [tokens / s for s in seconds]
        entry = {"test": test, "t/s": median(rates), "min": min(rates), "max": max(rates), **(extra or {})}
        rows.append(entry)

    if args.pp:
        kv = backend.allocate_kv(layouts, 1, args.pp + 16, dtype=args.kv)
        tokens = rng.integers(0, vocab, args.pp)
        batch = Batch([Row(0, 0, tokens)])
        backend.to_host(arch.forward(batch, kv))  # warm-up
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            backend.to_host(arch.forward(batch, kv))
            times.append(time.perf_counter() - t)
        row(f"pp{args.pp}", args.pp, times)
        del kv

    if args.tg:
        for depth in [0, *args.depth]:
            kv = backend.allocate_kv(layouts, 1, depth + args.tg + 16, dtype=args.kv)
            if depth:
                for start in range(0, depth, 512):
                    chunk = rng.integers(0, vocab, min(512, depth - start))
                    arch.forward(Batch([Row(0, start, chunk)]), kv)
            token = int(rng.integers(0, vocab))
            backend.to_host(backend.run(arch.forward, Batch([Row(0, depth, np.array([token]))]), kv))  # capture
            times, device_times = [], []
            for _ in range(args.reps):
                t = time.perf_counter()
                for i in range(args.tg):
                    logits = backend.run(arch.forward, Batch([Row(0, depth + i, np.array([token]))]), kv)
                    token = int(np.argmax(backend.to_host(logits)[0])) % vocab
                times.append(time.perf_counter() - t)
                timer = driver.Timer(backend.device)
                with timer:
                    for i in range(args.tg):
                        backend.run(arch.forward, Batch([Row(0, depth + i, np.array([token]))]), kv)
                device_times.append(timer.seconds)
            label = f"tg{args.tg}" + (f" @ d{depth}" if depth else "")
            bandwidth = step_bytes / (median(times) / args.tg) / 1e9
            row(label, args.tg, times, {"GB/s": bandwidth})
            row(label + " device", args.tg, device_times, {"GB/s": step_bytes / (median(device_times) / args.tg) / 1e9})
            del kv
        for batch_size in args.batch:
            kv = backend.allocate_kv(layouts, batch_size, args.tg + 16, dtype=args.kv)
            tokens = rng.integers(0, vocab, batch_size)

            def step(i: int, tokens=tokens) -> Batch:
                return Batch([Row(s, i, np.array([int(t)])) for s, t in enumerate(tokens)])

            backend.to_host(backend.run(arch.forward, step(0), kv))
            timer = driver.Timer(backend.device)
            with timer:
                for i in range(args.tg):
                    backend.run(arch.forward, step(i), kv)
            row(f"tg{args.tg} x{batch_size} device", args.tg * batch_size, [timer.seconds])
            del kv
    if backend.graph_failures:
        print("# graph capture failed:", backend.graph_failures)

    return rows, (backend, arch)


def profiles(backend: CUDABackend, arch: Any, kv_dtype: str) -> None:
    """Where one prefill of 512 tokens and one decode step at depth 512 spend their device time."""
    kv = backend.allocate_kv(arch.kv_layouts(arch.params), 1, 1024, dtype=kv_dtype)
    tokens = np.random.default_rng(2).integers(0, arch.vocab_size, 512)
    for label, batch in (
        ("prefill 512", Batch([Row(0, 0, tokens)])),
        ("decode @512", Batch([Row(0, 512, tokens[:1])])),
    ):
        table = profile(backend, lambda b=batch: _ready(arch.forward(b, kv)))
        total = sum(t for _, t in table.values())
        print(f"# profile {label}: {total * 1e3:.2f} ms in kernels")
        for name, (count, seconds) in sorted(table.items(), key=lambda kv: -kv[1][1])[:16]:
            print(f"#   {seconds * 1e3:8.3f} ms {100 * seconds / total:5.1f}% {count:5d}x {name}")


def profile(backend: CUDABackend, call) -> dict[str, tuple[int, float]]:
    """Device time per kernel name over one call, captured as a graph with an event pair around every
    launch and replayed (so the host's launch overhead does not count)."""
    cu = driver._cu()
    records = []
    original = driver.Kernel.__call__

    def timed(kernel, grid, block, *args, smem=0):
        start, end = driver.check(cu.cuEventCreate(0)), driver.check(cu.cuEventCreate(0))
        external = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL  # a real record node inside a graph
        driver.check(cu.cuEventRecordWithFlags(start, backend.device.stream, external))
        original(kernel, grid, block, *args, smem=smem)
        driver.check(cu.cuEventRecordWithFlags(end, backend.device.stream, external))
        records.append((kernel.name, start, end))

    call()  # warm-up
    driver.Kernel.__call__ = timed
    try:
        graph = driver.Graph(backend.device, call)
    finally:
        driver.Kernel.__call__ = original
    graph.replay()
    backend.device.synchronize()
    table: dict[str, tuple[int, float]] = {}
    for name, start, end in records:
        seconds = driver.check(cu.cuEventElapsedTime(start, end)) / 1e3
        count, total = table.get(name, (0, 0.0))
        table[name] = (count + 1, total + seconds)
        cu.cuEventDestroy(start)
        cu.cuEventDestroy(end)
    return table


def micro(backend: CUDABackend, arch: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each distinct weight shape alone: matrix-vector (1 token) bandwidth, GEMM (512 tokens) rate."""
    seen = {}
    for name, m in matrices(arch):
        seen.setdefault((m.qtype, m.rows, m.cols), (name, m))
    rng = np.random.default_rng(1)
    for (qtype, rows_, cols), (name, m) in sorted(seen.items(), key=lambda kv: -kv[1][1].memory.nbytes):
        x = backend._permanent(rng.standard_normal((512, cols)).astype(np.float32), "bench")
        one = x.view((1, cols))
        out = backend._empty((1, rows_))
        for kind, shape in args.variants:
            if kind == "q" and not quants.LAYOUTS[qtype].integer:
                continue
            kernel = variant(backend, qtype, kind, shape)
            grid = (-(-rows_ // (4 * shape[1])),)
            smem = quants.gemv_q_smem(qtype, shape[0], cols) if kind == "q" else 0
            if kind == "q":
                grid = (min(grid[0], backend.device.sm_count * kernel.occupancy(128, smem)),)
                params = (
                    m.ptr,
                    0,
                    0,
                    m.blocks,
                    0,
                    0,
                    one,
                    out,
                    0,
                    0,
                    None,
                    None,
                    None,
                    None,
                    None,
                    0.0,
                    rows_,
                    0,
                    0,
                    cols,
                    *quants.GEMV_Q_NO_ROPE,
                )
            else:
                params = (m.ptr, m.blocks, one, out, None, rows_, cols)
            seconds = time_it(backend, lambda k=kernel, g=grid, p=params, sm=smem: k(g, 128, *p, smem=sm), 50)
            rows.append(
                {
                    "test": f"gemv{'_q' if kind == 'q' else ''} {qtype.name} {rows_}x{cols} R{shape[1]} U{shape[2]}",
                    "us": seconds * 1e6,
                    "GB/s": m.memory.nbytes / seconds / 1e9,
                }
            )
        seconds = time_it(backend, lambda x=x, m=m: backend.matmul(x, m), 5)
        rows.append(
            {
                "test": f"gemm {qtype.name} {rows_}x{cols} n512",
                "us": seconds * 1e6,
                "TFLOP/s": 2 * 512 * rows_ * cols / seconds / 1e12,
            }
        )


_variants: dict[tuple, driver.Module] = {}


def variant(backend: CUDABackend, qtype, kind: str, shape: tuple[int, int, int]) -> driver.Kernel:
    namer = quants.gemv_q_name if kind == "q" else quants.gemv_name
    name = namer(qtype, shape[0], (shape[1], shape[2]))  # mode 0
    key = (qtype, name)
    if key not in _variants:
        built = compiler.compile_program("matmul.cu", [name], backend.device.arch)
        smem = {name: quants.GEMV_Q_MAX_SMEM} if kind == "q" else {}
        _variants[key] = driver.Module(backend.device, built.cubin, built.names, built.params, smem)
    return _variants[key][name]


def step_ms(backend: CUDABackend, forward, batch, kv, reps: int = 20) -> float:
    """Milliseconds of one forward step of ``batch`` as the engine runs it (``backend.run``: graph-replayed where a
    graph fits), captured afresh (so a path changed since is what runs), then ``reps`` steps timed on the device."""
    backend._captured.clear()
    backend.to_host(backend.run(forward, batch, kv))
    timer = driver.Timer(backend.device)
    with timer:
        for _ in range(reps):
            backend.run(forward, batch, kv)
    return timer.seconds / reps * 1e3


def time_it(backend: CUDABackend, call, reps: int) -> float:
    """Device seconds per call: ``reps`` calls captured in a graph, replayed twice, the second timed."""
    call()
    graph = driver.Graph(backend.device, lambda: [call() for _ in range(reps)])
    graph.replay()
    timer = driver.Timer(backend.device)
    with timer:
        graph.replay()
    return timer.seconds / reps


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"| {'test':44s} | {'t/s':>10s} | {'GB/s':>8s} | {'us':>9s} | {'TFLOP/s':>7s} |")
    print(f"| {'-' * 44} | {'-' * 10}: | {'-' * 8}: | {'-' * 9}: | {'-' * 7}: |")
    for r in rows:
        cells = [f"{r[k]:10.1f}" if k in r else " " * 10 for k in ("t/s",)]
        cells += [f"{r[k]:8.0f}" if k in r else " " * 8 for k in ("GB/s",)]
        cells += [f"{r[k]:9.1f}" if k in r else " " * 9 for k in ("us",)]
        cells += [f"{r[k]:7.1f}" if k in r else " " * 7 for k in ("TFLOP/s",)]
        print(f"| {r['test']:44s} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--architecture", help="module:Class (default: the installed plugin for the file)")
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--depth", type=int, nargs="*", default=[], help="also decode after this many tokens")
    parser.add_argument("--batch", type=int, nargs="*", default=[], help="also decode this many sequences at once")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv", default="f16", choices=["f16", "f32", "q8_0"])
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-tensor-cores", action="store_true")
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--variants", default="q:1,2,2", help="matrix-vector kernels for --micro: q|f:NC,R,U;...")
    parser.add_argument("--profile", action="store_true", help="device time per kernel of one prefill and decode")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    args.variants = [
        (v.split(":")[0], tuple(int(n) for n in v.split(":")[1].split(","))) for v in args.variants.split(";")
    ]
    rows, (backend, arch) = bench(args)
    print_rows(rows)
    if args.micro:
        more: list[dict[str, Any]] = []
        micro(backend, arch, more, args)
        print_rows(more)
        rows += more
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.profile:
        profiles(backend, arch, args.kv)


if __name__ == "__main__":
    main()
