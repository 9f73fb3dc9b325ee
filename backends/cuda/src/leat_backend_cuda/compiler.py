"""Run-time compilation of the kernels in ``kernels/`` with NVRTC, cached on disk.

A *program* is one ``.cu`` file plus the kernel names to instantiate from it (template
instantiations are named by C++ expressions such as ``gemv<TQ4_K, 1, 2, 2>`` and resolved to
their mangled names through NVRTC's name expressions). The cubin and the name map are cached
under ``$LEAT_HOME/cuda`` (default ``~/.cache/leat/cuda``), keyed by the sources, the options,
the names, the target architecture and the NVRTC version, so a second start compiles nothing.
Compilation needs no GPU and no driver: the tests build every program for sm_90 and sm_89.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from leat.errors import LeatError

HEADERS = ("common.cuh", "kv.cuh", "quants.cuh", "runs.cuh", "iq_grids.cuh", "mma.cuh", "wgmma.cuh", "decode_tc.cuh")
OPTIONS = ("-std=c++17", "--fmad=true")


class CompileError(LeatError):
    """NVRTC rejected a kernel source."""


@dataclass(frozen=True)
class Compiled:
    cubin: bytes
    names: dict[str, str]  # name expression -> mangled (lowered) name
    params: dict[str, list[str]]  # name expression -> PTX parameter types (".u64", ".f32", ...)
    log: str
    cached: bool


def source(name: str) -> str:
    return resources.files("leat_backend_cuda").joinpath("kernels", name).read_text()


def cache_dir() -> Path:
    home = os.environ.get("LEAT_HOME")
    return Path(home) / "cuda" if home else Path.home() / ".cache" / "leat" / "cuda"


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")


def compile_program(
    file: str, names: list[str], arch: str, extra: tuple[str, ...] = (), use_cache: bool = True
) -> Compiled:
    """Compile ``kernels/<file>`` for ``arch`` (e.g. "sm_90") and resolve ``names``."""
    from cuda.bindings import nvrtc

    text = source(file)
    headers = {h: source(h) for h in HEADERS}
    options = [*OPTIONS, f"--gpu-architecture={arch}", *extra]
    version = nvrtc_version()
    key = hashlib.sha256(
        json.dumps([file, text, sorted(headers.items()), options, sorted(names), version]).encode()
    ).hexdigest()[:32]
    where = cache_dir() / f"{file.split('.')[0]}-{arch}-{key}"
    if use_cache and where.with_suffix(".cubin").exists() and where.with_suffix(".json").exists():
        try:
            meta = json.loads(where.with_suffix(".json").read_text())
            cubin = where.with_suffix(".cubin").read_bytes()
            return Compiled(cubin, meta["names"], meta["params"], meta.get("log", ""), True)
        except (OSError, ValueError, KeyError):
            pass  # a damaged entry: compile again and overwrite it

    err, prog = nvrtc.nvrtcCreateProgram(
        text.encode(),
        file.encode(),
        len(headers),
        [s.encode() for s in headers.values()],
        [h.encode() for h in headers],
    )
    _check(err, "nvrtcCreateProgram")
    try:
        templated = [n for n in names if "<" in n]  # extern "C" kernels keep their own names
        for name in templated:
            _check(nvrtc.nvrtcAddNameExpression(prog, name.encode())[0], f"nvrtcAddNameExpression({name})")
        opts = [o.encode() for o in options]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffers it is given: bytearrays, never bytes (``b" " * 1`` is the interpreter's
        # shared one-byte object: an empty log's terminator once turned every later b" " into b"\x00")
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\x00 \n")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile {file} for {arch}:\n{log_text}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin_buffer = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin_buffer)[0], "nvrtcGetCUBIN")
        cubin = bytes(cubin_buffer)
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = bytearray(size)
        _check(nvrtc.nvrtcGetPTX(prog, ptx)[0], "nvrtcGetPTX")
        lowered = {n: n for n in names if "<" not in n}
        for name in templated:
            err, mangled = nvrtc.nvrtcGetLoweredName(prog, name.encode())
            _check(err, f"nvrtcGetLoweredName({name})")
            lowered[name] = mangled.decode() if isinstance(mangled, bytes) else str(mangled)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    params = _entry_params(ptx.decode(errors="replace"), lowered)
    if use_cache:
        meta = {"names": lowered, "params": params, "log": log_text, "nvrtc": list(version), "arch": arch}
        _store(where, cubin, meta)
    return Compiled(cubin, lowered, params, log_text, False)


def _entry_params(ptx: str, lowered: dict[str, str]) -> dict[str, list[str]]:
    out = {}
    for name, mangled in lowered.items():
        start = ptx.index(f".entry {mangled}(")
        out[name] = re.findall(r"\.param\s+(\.\w+)", ptx[start : ptx.index(")", start)])
    return out


def _store(where: Path, cubin: bytes, meta: dict) -> None:
    """Write the cache entry atomically (another process may be compiling the same program)."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        for suffix, data in ((".cubin", cubin), (".json", json.dumps(meta).encode())):
            fd, tmp = tempfile.mkstemp(dir=where.parent, prefix=where.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, where.with_suffix(suffix))
    except OSError:
        pass  # an unwritable cache only costs a compile next time
