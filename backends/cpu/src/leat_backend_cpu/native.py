"""The C kernels of the CPU backend's quantized path (``kernels/cpu.c``), compiled on first use.

Products with 2-D weights kept as the file's GGUF blocks: more activation rows than ``GEMV_ROWS`` (a prompt) go
through ``gemm``, which rounds the activations to int16 per 32 values (:func:`activation_range`), decodes 16 weight
rows at a time to int16 and multiplies them with exact integer dot products (AVX-512 VNNI, or AVX2's ``vpmaddwd``),
each decoded panel reused by every token (CPUs with neither decode tiles of rows to float32 for BLAS instead; ``gemmb``
decodes the panels a block at a time where the library has it). A few rows (decode steps) go through ``igemv`` for
the types of ``Kernels.integer_gemv`` (the same int16 activations, each 32 weight values decoded to int16 in
registers; ``igemvb`` a block at a time, or for Q4_0, Q4_1 and Q5_0 two and for Q4_K and Q6_K four groups, where the
library has it), else ``gemv``, which decodes blocks in registers and multiplies in float32. Attention over float32 or
f16 KV pages, rms_norm, the gated activations and rope are one C call each. Work is split over ``threads`` threads
(the caller's and a pool's; the C file says how).

The source is compiled with the system's C compiler (``$CC``, else clang on an x86 CPU without AVX-512, else
``cc``; :func:`_compiler`) for this CPU (``-march=native``) into ``$LEAT_HOME/cpu`` (default ``~/.cache/leat/cpu``),
keyed by the source, the flags, the compiler's version and the CPU's feature flags, so a second start compiles
nothing. Where Python's headers are installed the library is also an
extension module, and the kernels are called through it (``kernels/call.c``); else, or with ``LEAT_CPU_CTYPES=1``,
through ctypes. :func:`unavailable` says why the kernels cannot be built here (the backend then takes its numpy
path).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from leat.sha256 import sha256

Q = gguf.GGMLQuantizationType
# the types kernels/cpu.c decodes (its functions are named by the type's lower-case name)
KERNEL_TYPES = frozenset(
    {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4, Q.IQ4_NL, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS}
)
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-pthread",
    "-shared",
    "-fPIC",
    # vectorised sums need reassociation; inf and nan keep their meaning (no -ffinite-math-only)
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-ffp-contract=fast",
)
ATTENTION_STORAGE = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}  # KV page dtypes attend() reads
GEMV_ROWS = 8  # activation rows up to which a product decodes blocks in registers
# types whose decode products take int16 activations and integer dot products (igemv_), where the GEMM does: faster
# than the float32 GEMV for these (AVX-512 VNNI, one thread, SmolLM2's weights 6.9 -> 5.9 ms on a busy machine, 8.0 ->
# 7.6 on a quieter one, where memory bandwidth bounds both; AVX2, two threads, SmolLM2's tg32 89-96 -> 105-115 tok/s,
# docs/benchmarks.md); the others keep it
INTEGER_GEMV = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0})
# and these where the library has them from the blocks' bytes (kernels/cpu.c's igemvb_: AVX2, and AVX-512 VBMI, where
# a random-weight Llama 3.2 1B-shaped Q4_K_M file decodes at 15.4 tok/s on one thread against the float32 GEMV's 2.6,
# docs/benchmarks.md); through igroup_ they were slower than the float32 GEMV (that file, 2 threads: 8.2 against 10.2)
K_QUANT_GEMV = frozenset({Q.Q4_K, Q.Q6_K})
# float32 bytes of weight rows decoded at once for a prompt's BLAS product, without the integer GEMM: a whole weight of
# a small model, since each BLAS call forks and joins its threads, which costs milliseconds on a busy machine
TILE_BYTES = 8 << 20


@dataclass(eq=False)
class QuantizedWeight:
    """A 2-D GGUF tensor as stored: ``blocks`` [rows, bytes per row] (the file's mmapped bytes, not a copy)."""

    qtype: Q
    shape: tuple[int, int]
    blocks: np.ndarray
    address: int = field(init=False)
    kernels: dict[str, Callable[..., None]] = field(init=False)  # its type's gemv, dequant (gemm, igemv) entry points
    # a decode step's product: step(x, n, y, *step_range, threads), igemv's (with its activation range) or gemv's
    step: Callable[..., None] = field(init=False)
    step_range: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        self.blocks = np.ascontiguousarray(self.blocks).view(np.uint8).reshape(self.shape[0], -1)
        self.address = self.blocks.ctypes.data
        lib = library()
        kinds = ("gemv", "dequant", "gemm") if lib.has_gemm else ("gemv", "dequant")
        name = self.qtype.name.lower()
        kinds += ("igemv",) if lib.has_gemm and self.qtype in lib.integer_gemv else ()
        self.kernels = {kind: lib.entry(f"{kind}_{name}") for kind in kinds}
        for kind in ("igemv", "gemm"):  # by blocks (AVX2's Q4_K and Q6_K; AVX-512 VBMI's Q4_0, Q4_1, Q5_0 decode)
            if kind in kinds and lib.has(f"{kind}b_{name}"):
                self.kernels[kind] = lib.entry(f"{kind}b_{name}")
        integer = "igemv" in self.kernels
        self.step = functools.partial(self.kernels["igemv" if integer else "gemv"], self.address, *self.shape)
        self.step_range = (activation_range(self.qtype),) if integer else ()

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


@dataclass(eq=False)
class QuantizedStack:
    """A 3-D GGUF tensor as stored (a MoE layer's experts, MLA's per-head matrices): ``stack[i]`` is matrix i, a
    :class:`QuantizedWeight` over its rows of ``blocks`` [count, rows, bytes per row] (the file's bytes, not a copy)."""

    qtype: Q
    shape: tuple[int, int, int]
    blocks: np.ndarray
    matrices: tuple[QuantizedWeight, ...] = field(init=False)

    def __post_init__(self):
        self.blocks = np.ascontiguousarray(self.blocks).view(np.uint8).reshape(self.shape[0], self.shape[1], -1)
        self.matrices = tuple(QuantizedWeight(self.qtype, self.shape[1:], matrix) for matrix in self.blocks)

    def __getitem__(self, index: int) -> QuantizedWeight:
        return self.matrices[index]

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def cache_dir() -> Path:
    home = os.environ.get("LEAT_HOME")
    return Path(home) / "cpu" if home else Path.home() / ".cache" / "leat" / "cpu"


def _compiler() -> str | None:
    """``$CC``; else, on an x86 CPU without AVX-512, clang where installed: GCC 12 lowers the kernels' 16-float
    vectors to AVX2 through the stack (a scalar times a vector as 16 stores, sums through general registers), and
    its ``gemv_q4_1`` ran 8.7x slower than clang 14's (1,403 against 160 us for a 1536 x 576 product, one thread,
    a 2-core AMD EPYC with AVX2); else ``cc``."""
    if "CC" in os.environ:
        return shutil.which(os.environ["CC"])
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686")
    if x86 and "avx512f" not in _cpu_flags().split() and (clang := shutil.which("clang")):
        return clang
    return shutil.which("cc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


# each entry point's arguments: p a pointer (an array, an int address or None), l int64, i int, f float (kernels/call.c)
SIGNATURES = {
    "gemv": "pllplpi",
    "gemm": "pllplpfi",
    "igemv": "pllplpfi",
    "igemvb": "pllplpfi",
    "gemmb": "pllplpfi",
    "dequant": "ppllpi",
    "attend": "p" * 8 + "l" * 9 + "ffi",
    "rms_norm": "pppllf",
    "gated": "pppli",
    "rope": "pppplllli",
}
CTYPES = {"p": ctypes.c_void_p, "l": ctypes.c_int64, "i": ctypes.c_int, "f": ctypes.c_float}


def _python_headers() -> str | None:
    """The directory of Python.h, where this Python has its headers."""
    include = sysconfig.get_paths().get("include")
    return include if include and (Path(include) / "Python.h").exists() else None


class Kernels:
    """The compiled kernels: ``kernels.entry(name)`` is a callable taking numpy arrays (or addresses) and numbers in
    the order of the C function's parameters. Built with Python's headers, the library is also an extension module
    whose ``call`` (kernels/call.c) runs them; without the headers, ctypes does."""

    def __init__(self, path: Path, direct: bool):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.has_gemm = bool(self.lib.has_gemm())
        #: the types whose decode steps go through igemv
        self.integer_gemv = INTEGER_GEMV | {q for q in K_QUANT_GEMV if self.has(f"igemvb_{q.name.lower()}")}
        self.direct = direct
        self._call = None
        if direct:
            spec = importlib.util.spec_from_file_location("leat_cpu_kernels", path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self._call = module.call

    def has(self, name: str) -> bool:
        return hasattr(self.lib, name)

    @functools.cache  # noqa: B019 - one Kernels per process (library() is cached)
    def entry(self, name: str) -> Callable[..., None]:
        signature = SIGNATURES[name.split("_")[0] if name.split("_")[0] in SIGNATURES else name]
        function = getattr(self.lib, name)
        if self._call is not None:
            return functools.partial(self._call, ctypes.cast(function, ctypes.c_void_p).value, signature)
        function.argtypes = [CTYPES[kind] for kind in signature]

        def call(*args: Any) -> None:
            function(*(address(a) if isinstance(a, np.ndarray) else a for a in args))

        return call


@functools.cache
def library() -> Kernels:
    """The compiled kernels, built on the first call of this process or loaded from the cache: with their Python entry
    point where Python's headers are (and it builds and loads), else for ctypes alone."""
    compiler = _compiler()
    if compiler is None:
        raise OSError(f"no C compiler ({os.environ.get('CC', 'cc')}) to build the quantized kernels")
    kernels = resources.files("leat_backend_cpu").joinpath("kernels")
    source = kernels.joinpath("cpu.c").read_text()
    for qtype in sorted(KERNEL_TYPES):
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        source += f"KERNELS({qtype.name.lower()}, {block}, {size})\n"
    headers = None if os.environ.get("LEAT_CPU_CTYPES") else _python_headers()
    if headers:
        flags = [*FLAGS, f"-I{headers}", f"-DPYTHON_VERSION={sys.version_info[0]}{sys.version_info[1]}"]
        try:
            return Kernels(_build(compiler, source + kernels.joinpath("call.c").read_text(), flags), direct=True)
        except (OSError, ImportError):  # headers of another build of Python, say: the kernels without call.c
            pass
    return Kernels(_build(compiler, source, list(FLAGS)), direct=False)


def _build(compiler: str, source: str, flags: list[str]) -> Path:
    """The library of ``source`` in the cache, compiled there first when it is not."""
    version = subprocess.run([compiler, "--version"], check=True, capture_output=True, text=True).stdout
    key = sha256("\0".join([source, *flags, version, _cpu_flags()]).encode()).hexdigest()[:24]
    path = cache_dir() / f"cpu-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            (Path(tmp) / "cpu.c").write_text(source)
            built = Path(tmp) / "cpu.so"
            command = [compiler, *flags, "cpu.c", "-o", built.name]
            result = subprocess.run(command, check=False, cwd=tmp, capture_output=True)
            if result.returncode != 0:
                raise OSError(f"{compiler} could not build the quantized kernels:\n{result.stderr.decode()}")
            os.replace(built, path)  # atomic: another process may be building the same file
    return path


def address(array: np.ndarray) -> int:
    """The address of a contiguous array's data (ctypes' buffer view: a third of ``array.ctypes.data``'s cost)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError):  # read-only or empty
        return array.ctypes.data


@functools.cache
def unavailable() -> str | None:
    """None when the kernels are built and loaded, else why not."""
    try:
        library()
    except OSError as e:
        return str(e)
    return None


def matmul(x: np.ndarray, weight: QuantizedWeight, threads: int) -> np.ndarray:
    """x [n, k] float32 times the transpose of ``weight`` [m, k]: -> [n, m] float32."""
    x = np.ascontiguousarray(x, np.float32)
    (n, k), m = x.shape, weight.shape[0]
    y = np.empty((n, m), np.float32)
    if n <= GEMV_ROWS:
        weight.step(x, n, y, *weight.step_range, threads)
    elif "gemm" in weight.kernels:
        weight.kernels["gemm"](weight.address, m, k, x, n, y, activation_range(weight.qtype), threads)
    else:  # no AVX-512 VNNI: tiles of decoded rows times x with BLAS
        tile = max(1, min(m, TILE_BYTES // (4 * k)))
        decoded = np.empty((tile, k), np.float32)
        dequant = weight.kernels["dequant"]
        transposed = np.empty((m, n), np.float32)  # tiles of rows of y.T are contiguous: BLAS writes them in place
        for first in range(0, m, tile):
            rows = min(tile, m - first)
            # one thread: decoding is a few percent of the BLAS product, and a second pool would fight BLAS's
            dequant(weight.address + first * weight.blocks.shape[1], None, rows, k, decoded, 1)
            np.matmul(decoded[:rows], x.T, out=transposed[first : first + rows])
        y[:] = transposed.T
    return y


def activation_range(qtype: Q) -> int:
    """The largest |q| of a prompt's activations rounded to int16 per 32 values for ``qtype``'s GEMM: 32767, or
    16383 for Q6_K, whose decoded integers (scale folded in) reach 4096, so that 32 products stay inside int32."""
    return 16383 if qtype == Q.Q6_K else 32767


def dequantize(weight: QuantizedWeight, threads: int) -> np.ndarray:
    """All of ``weight`` as float32 [m, k]."""
    out = np.empty(weight.shape, np.float32)
    weight.kernels["dequant"](weight.address, None, weight.shape[0], weight.shape[1], out, threads)
    return out


def rows(weight: QuantizedWeight, ids: np.ndarray, threads: int) -> np.ndarray:
    """Rows ``ids`` of ``weight`` as float32 [len(ids), k] (an embedding lookup)."""
    ids = np.ascontiguousarray(ids, np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= weight.shape[0]):
        raise IndexError(f"row ids must be in [0, {weight.shape[0]}), not {ids.min()}..{ids.max()}")
    out = np.empty((len(ids), weight.shape[1]), np.float32)
    weight.kernels["dequant"](weight.address, ids, len(ids), weight.shape[1], out, threads)
    return out


def can_attend(keys: np.ndarray, values: np.ndarray) -> bool:
    """Whether :func:`attend` reads these KV pages: float32 or f16, head dimensions that are multiples of 16."""
    return keys.dtype in ATTENTION_STORAGE and keys.shape[-1] % 16 == 0 and values.shape[-1] % 16 == 0


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    table: np.ndarray,
    start: int,
    window: int | None,
    scale: float,
    softcap: float | None,
    sinks: np.ndarray | None,
    out: np.ndarray,
    threads: int,
) -> None:
    """One sequence's attention: queries q [queries, heads, dim] at positions start.. against the pages ``keys`` and
    ``values`` [pages, page_size, kv_heads, dim] (float32 or float16) through its page-table row ``table``, after
    the queries' own k and v [queries, kv_heads, dim] are stored there (rounded to the pages' dtype), into ``out``
    [queries, heads * value_dim] (a contiguous float32 view). Masks, soft-cap and sinks as
    :meth:`leat.backend.Backend.attention` says."""
    q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
    table = np.ascontiguousarray(table, np.int32)
    sinks = None if sinks is None else np.ascontiguousarray(sinks, np.float32)
    (queries, heads, dim), (_, page_size, kv_heads, value_dim) = q.shape, values.shape
    library().entry(f"attend_{ATTENTION_STORAGE[keys.dtype]}")(
        q,
        k,
        v,
        keys,
        values,
        table,
        sinks,
        out,
        queries,
        heads,
        kv_heads,
        dim,
        value_dim,
        page_size,
        start,
        window or 0,
        out.shape[1],
        scale,
        softcap or 0.0,
        threads,
    )


def keep_freed_memory(keep: bool) -> None:
    """Whether glibc keeps freed memory (up to 64 MiB, blocks up to 32 MiB) for the next allocation: off while a model
    loads, on from its KV cache (``kernels/cpu.c`` says why)."""
    library().lib.keep_freed_memory(int(keep))


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, float32."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    scale = None if weight is None else np.ascontiguousarray(weight, np.float32)
    library().entry("rms_norm")(x, scale, out, x.size // x.shape[-1], x.shape[-1], eps)
    return out


def gated(gate: np.ndarray, up: np.ndarray, gelu: bool) -> np.ndarray:
    """silu(gate) * up, or (``gelu``) the tanh GELU of gate times up, float32."""
    gate, up = np.ascontiguousarray(gate, np.float32), np.ascontiguousarray(up, np.float32)
    out = np.empty_like(gate)
    library().entry("gated")(gate, up, out, gate.size, int(gelu))
    return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, dims: int, neox: bool) -> np.ndarray:
    """x [n, heads, head_dim] rotated by cos, sin [n, dims / 2] (float32, contiguous); see RopeSpec for ``neox``."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    n, heads, head_dim = x.shape
    library().entry("rope")(x, cos, sin, out, n, heads, head_dim, dims, int(neox))
    return out
