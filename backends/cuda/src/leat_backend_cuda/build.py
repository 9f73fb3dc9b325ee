"""Compile every kernel program into the cache ahead of time, in parallel processes.

    python -m leat_backend_cuda.build [--arch sm_90] [--no-cache]

Loading a model compiles only the programs its tensor types need, one after another; this fills
the cache for all of them at once (on a fresh machine, or to check that everything compiles).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

from leat_backend_cuda import compiler, deltanet, mla, moe, quants, vision, wgmma


def programs() -> list[tuple[str, list[str]]]:
    from leat_backend_cuda.backend import FLASH_KERNELS, OPS_KERNELS, gemv_split

    split = gemv_split()  # the products' programs as the backend compiles them (with the split shapes by default)
    return (
        [("ops.cu", OPS_KERNELS), ("flash.cu", FLASH_KERNELS)]
        + [("matmul.cu", quants.kernel_names(q, split=split)) for q in quants.LAYOUTS]
        + moe.programs()
        + mla.programs()
        + vision.programs()
        + deltanet.programs()
    )


def _build(job: tuple[str, list[str], str, bool]) -> tuple[str, float, int, bool]:
    file, names, arch, use_cache = job
    started = time.perf_counter()
    built = compiler.compile_program(file, names, arch, use_cache=use_cache)
    return names[0], time.perf_counter() - started, len(built.cubin), built.cached


def jobs(arch: str) -> list[tuple[str, list[str], str]]:
    """Every program to compile for a GPU of ``arch``, with the target each is compiled for: on sm_90 also
    wgmma.cu's (Hopper's warpgroup products), for sm_90a."""
    out = [(file, names, arch) for file, names in programs()]
    if arch == "sm_90":
        out += [(file, names, wgmma.WGMMA_ARCH) for file, names in wgmma.programs()]
    return out


def build_all(arch: str, use_cache: bool = True, workers: int | None = None) -> list[tuple[str, float, int, bool]]:
    work = [(file, names, target, use_cache) for file, names, target in jobs(arch)]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_build, work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=None, help="target, e.g. sm_90 (default: the GPU's own)")
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args()
    arch = args.arch
    if arch is None:
        from leat_backend_cuda.driver import Device

        arch = Device().arch
    started = time.perf_counter()
    for first, seconds, size, cached in build_all(arch, not args.no_cache):
        print(f"{first:40s} {seconds:6.2f} s {size / 1024:8.1f} KiB{' (cached)' if cached else ''}")
    print(f"built for {arch} in {time.perf_counter() - started:.1f} s, NVRTC {compiler.nvrtc_version()}")


if __name__ == "__main__":
    main()
