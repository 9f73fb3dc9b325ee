#!/usr/bin/env python3
"""What the GPU would run for a kernel, without a GPU: registers, spills and the instructions of its innermost loop.

    python scripts/kernel_sass.py "gemv_q<TQ4_KP, 1, 4, 1, 3>" ["gemv_q<TQ4_K, 1, 4, 1, 3>" ...]
        [--file matmul.cu] [--arch sm_90] [--opcode IDP] [--cuobjdump PATH]

Each name is compiled with NVRTC for ``--arch`` (the program of ``--file``, as the backend compiles it) and read
back with ``cuobjdump -sass`` and ``-res-usage``. The loop is the shortest backward branch that contains an
instruction starting with ``--opcode`` (IDP: the dp2a of gemv_q's integer products; HMMA: the tensor-core
kernels). cuobjdump and the nvdisasm it calls are in the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``
wheels (``pip download`` them and unzip both into one folder: no CUDA toolkit needed); pass cuobjdump's path or put
it on the PATH, with nvdisasm beside it or on the PATH. Divide a loop's instructions by the weights one pass of it
decodes to compare kernels.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from leat_backend_cuda import compiler

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
BACKWARD = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\S*\s+(?:\S+,\s*)?0x([0-9a-f]+)")


def innermost_loop(sass: str, opcode: str) -> list[str]:
    """The opcodes of the shortest backward-branch span holding ``opcode`` (empty where there is none)."""
    code = [(int(at, 16), op) for at, op in INSTRUCTION.findall(sass)]
    marks = [at for at, op in code if op.startswith(opcode)]
    spans = []
    for match in BACKWARD.finditer(sass):
        source, target = int(match.group(1), 16), int(match.group(2), 16)
        if target < source and any(target <= at <= source for at in marks):
            spans.append((target, source))
    if not spans:
        return []
    first, last = min(spans, key=lambda span: span[1] - span[0])
    return [op for at, op in code if first <= at <= last]


def cuobjdump(tool: Path, cubin: Path, *args: str) -> str:
    """``cuobjdump ARGS CUBIN``'s output, with the nvdisasm beside ``tool`` found first on the PATH."""
    env = dict(os.environ, PATH=f"{tool.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run([tool, *args, cubin], capture_output=True, text=True, env=env, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help="kernel name expressions, as quants.py writes them")
    parser.add_argument("--file", default="matmul.cu")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--opcode", default="IDP")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = parser.parse_args()
    tool = Path(args.cuobjdump)
    built = compiler.compile_program(args.file, args.names, args.arch, use_cache=False)
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "program.cubin"
        cubin.write_bytes(built.cubin)
        usage = cuobjdump(tool, cubin, "-res-usage")
        resources, function = {}, None
        for line in usage.splitlines():
            if found := re.search(r"Function (\S+):", line):
                function = found.group(1)
            elif (found := re.search(r"REG:(\d+) STACK:(\d+)", line)) and function:
                resources[function] = (int(found.group(1)), int(found.group(2)))
        for name in args.names:
            mangled = built.names[name]
            sass = cuobjdump(tool, cubin, "-sass", "-fun", mangled)
            loop = innermost_loop(sass, args.opcode)
            registers, stack = resources.get(mangled, (0, 0))
            counts = Counter(op.split(".")[0] for op in loop)
            print(f"{name}: {registers} registers, {stack} bytes of stack; innermost loop: {len(loop)} instructions")
            print("    " + ", ".join(f"{op} {count}" for op, count in counts.most_common(12)))


if __name__ == "__main__":
    main()
