"""The tinygrad backend: every op as tinygrad Tensor operations, on whichever device tinygrad picks.

The device is tinygrad's own choice: its ``DEV`` setting (``DEV=AMD``, ``DEV=NV``, ``DEV=CUDA``,
``DEV=CPU``...) or, unset, the first device that opens. Weights stay in their GGUF form on the device:
F32/F16 as float arrays, the block types of :mod:`leat_backend_tinygrad.quants` as their raw bytes,
dequantized inside each matmul's kernel; other types are dequantized to float32 at load.

Activations are float32 Tensors, left lazy between ops so tinygrad fuses them; only ``to_host``, the
KV writes and MoE routing force computation. Compiled kernels go to tinygrad's cache
(``CACHEDB``, by default ~/.cache/tinygrad/cache.db), so a second start skips compilation.

Decode steps (one token per row) run under TinyJit, one per (forward, KV cache, batch-size bucket), and so
do full-length prefill chunks: see :meth:`TinygradBackend.run`. The paged KV cache is in
:mod:`leat_backend_tinygrad.kv`, the gated delta-net's recurrent state (Qwen3.5) in :mod:`leat_backend_tinygrad.deltanet`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import gguf
import numpy as np
from leat.backend import Backend, KVLayout, RopeSpec
from leat.batch import Batch
from leat.deltanet import DeltaNet
from leat.errors import UnsupportedQuantType
from leat.model import PREFILL_CHUNK
from leat.modelfile import Tensor as FileTensor
from leat.moe import MoESpec, MoEWeights, route
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes
from tinygrad.device import Buffer
from tinygrad.dtype import _to_np_dtype
from tinygrad.helpers import getenv
from tinygrad.uop.ops import Ops

from leat_backend_tinygrad import intx, lanesum, norm, qkv, ring, softmax
from leat_backend_tinygrad.attention import decode_attention, rope_write, write_rows
from leat_backend_tinygrad.deltanet import RecurrentState
from leat_backend_tinygrad.gemm import (
    JOINED_OUTPUTS,
    SPLIT_GROUPS,
    Tiles,
    half_product,
    laid_out,
    staged_product,
    tiles_for,
    tuned_opts,
)
from leat_backend_tinygrad.gemv import LAYOUTS, MAX_ROWS, Shape, as_words, gemv, gemv_segments, unreshaped
from leat_backend_tinygrad.kv import KVCache, PagedKV
from leat_backend_tinygrad.quants import DEQUANTIZERS

Q = gguf.GGMLQuantizationType
# Types gguf-py can dequantize: those without a kernel here are dequantized to float32 at load.
LOAD_DEQUANTIZED = frozenset(
    {Q.BF16, Q.Q2_K, Q.Q3_K, Q.TQ1_0, Q.TQ2_0, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S}
    | {Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS}
)
SPLIT = 16  # a few-row product with a quantized weight sums each output in this many partial sums
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode batches are padded up to one of these, each jitted once
#: the share of a CUDA device's memory the prefill products' float16 weight copies may take, for weights of at most a
#: quarter of it (as the CUDA backend's F16_WEIGHTS_SHARE); F16_BUDGET where tinygrad cannot tell the memory
F16_WEIGHTS_SHARE, F16_BUDGET = 0.25, 8 << 30


def probe_reason() -> str | None:
    """Why tinygrad's default device cannot run here, or None."""
    try:
        dev = Device.DEFAULT
    except Exception as error:  # noqa: BLE001 - a device's failure to open can be any error; probe reports it
        return f"tinygrad finds no usable device: {error}"
    if dev.split(":")[0] == "CPU" and shutil.which(os.environ.get("CC", "clang")) is None:
        return "tinygrad's CPU device needs clang: apt-get install clang (or pick another device with DEV=...)"
    try:
        Device[dev]
    except Exception as error:  # noqa: BLE001
        return f"tinygrad's {dev} device does not open: {error}"
    return None


def _share_kernel_cache_across_threads() -> None:
    """Open tinygrad's kernel cache (sqlite) usable from any thread: the engine runs the model on its
    scheduler thread, while loading (and tests) run on the caller's; tinygrad's own connection is bound
    to the thread that opened it."""
    import sqlite3

    from tinygrad import helpers

    if getattr(helpers, "_leat_shared", False):
        return
    os.makedirs(os.path.dirname(helpers.CACHEDB), exist_ok=True)
    connection = sqlite3.connect(helpers.CACHEDB, timeout=60, isolation_level="IMMEDIATE", check_same_thread=False)
    with contextlib.suppress(sqlite3.OperationalError):
        connection.execute("PRAGMA journal_mode=WAL").fetchone()
    connection.execute("PRAGMA synchronous=NORMAL")
    helpers._db_connection, helpers._leat_shared = connection, True


def _alike(entry: tuple[Tensor, Tensor, Weight] | None, first: tuple[Tensor, Tensor, Weight]) -> bool:
    """Whether the few-row product ``entry`` (``_viewed_product``'s) can share ``first``'s kernel: the same x, the
    same weight type and row length."""
    return (
        entry is not None
        and entry[1] is first[1]
        and entry[2].qtype == first[2].qtype
        and entry[2].data.shape[1:] == first[2].data.shape[1:]
    )


@contextlib.contextmanager
def _outside_capture():
    """Kernels realized inside run now, even within a TinyJit's capture (which would add them to every replay)."""
    from tinygrad.engine.realize import capturing

    held = capturing[:]
    capturing.clear()
    try:
        yield
    finally:
        capturing[:] = held


def _device_memory(device: str) -> int | None:
    """Bytes of memory of tinygrad's CUDA device (``DEV=CUDA``); None elsewhere, where tinygrad does not tell."""
    if device.split(":")[0] != "CUDA":
        return None
    import ctypes

    from tinygrad.runtime.autogen import cuda

    total = cuda.size_t()
    status = cuda.cuDeviceTotalMem_v2(ctypes.byref(total), Device[device].cu_device)
    return total.value if status == 0 and total.value else None


@dataclass
class Weight:
    """One uploaded GGUF tensor: ``data`` on the device (float values, or blocks [..., blocks, block_bytes] for a
    type in DEQUANTIZERS, as uint8 or, for gemv's types, the words its kernel reads), ``host`` the stored bytes
    (the file's map)."""

    data: Tensor
    qtype: Q
    shape: tuple[int, ...]
    host: np.ndarray
    half: Tensor | None = None  # its float16 values, realized, kept for prefill products (TinygradBackend.f16_budget)

    def values(self, index: int | None = None) -> Tensor:
        """float32 values [*shape] (lazy: fused into the op that uses them); ``index`` picks one matrix of a 3-D tensor."""
        if index is None:
            return self._values(self.data, self.shape)
        return self._values(self.data[index], self.shape[1:])

    def _values(self, data: Tensor, shape: tuple[int, ...]) -> Tensor:
        if self.qtype in DEQUANTIZERS:
            data = data.bitcast(dtypes.uint8) if data.dtype != dtypes.uint8 else data  # words (gemv.as_words)
            return DEQUANTIZERS[self.qtype](data).reshape(shape)
        return data.cast(dtypes.float32) if data.dtype != dtypes.float32 else data


@dataclass
class _Step:
    """A decode step under TinyJit: the padded batch its forward is given, and the device inputs that ops
    read in place of that batch's host arrays (TinyJit replays kernels; host values would stay frozen)."""

    forward: Callable[[Batch, Any], Any]
    kv: KVCache
    batch: Batch
    tokens: Tensor | None = None  # [rows] int32
    positions: Tensor | None = None  # [rows] int32
    pages: list[Tensor] = field(default_factory=list)  # per page group: [rows, pages_per_slot] int32, -1 as 0
    at: list[list[UOp]] = field(default_factory=list)  # per page group, per row: bound storage row of its token
    valid: Tensor | None = None  # a padded prefill chunk: [1] int32, its real tokens (KV rows past them are kept)
    last: Tensor | None = None  # a padded prefill chunk: [1] int32, the row of its last real token (its logits)
    slots: list[UOp] = field(default_factory=list)  # per row: its slot, a bound Variable (recurrent states)
    # recurrent states' writes (storage view, new value realized), made once the step's output is: a step that
    # turns out not jittable (MoE routing) writes none, and a bucket's padding rows write their first row's value
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # per rope spec: the rows' cos and sin [rows, 1, dims / 2], gathered from the table once a step, not once a layer
    rope: dict[tuple, tuple[Tensor, Tensor]] = field(default_factory=dict)


PRODUCTS_KEPT = 8  # few-row products remembered for their consumers (a layer's q, k, v, o, gate, up, down)


class _NotJittable(Exception):
    """An op of the forward needs host values of the step (MoE routing): the step runs eagerly."""


def _cos_sin(spec: RopeSpec, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin [n, dims / 2] of each position's angles, computed in float64."""
    half = spec.dims // 2
    inv_freq = spec.base ** (-np.arange(half, dtype=np.float64) * 2 / spec.dims)
    if spec.freq_factors is not None:
        inv_freq = inv_freq / spec.freq_factors[:half]
    angles = (np.asarray(positions, np.float64) * spec.scale)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles) * spec.attn_factor, np.sin(angles) * spec.attn_factor
    return cos.astype(np.float32), sin.astype(np.float32)


def _rope_key(spec: RopeSpec) -> tuple:
    factors = None if spec.freq_factors is None else np.asarray(spec.freq_factors).tobytes()
    return spec.dims, spec.base, spec.neox, spec.scale, spec.attn_factor, factors


class TinygradBackend(RecurrentState, PagedKV, Backend):
    name = "tinygrad"
    quant_types = frozenset(DEQUANTIZERS) | {Q.F32, Q.F16} | LOAD_DEQUANTIZED
    recurrent_state = True
    rewinds_drafts = True
    bidirectional = True

    @classmethod
    def probe(cls) -> str | None:
        return probe_reason()

    def __init__(self, precision: str = "f32", **options: Any):
        if precision != "f32":
            raise ValueError(f"tinygrad backend precision must be f32, not {precision!r}")
        super().__init__(precision, **options)
        _share_kernel_cache_across_threads()
        self.device = Device.DEFAULT
        # CUDA's renderer: float16 loads and stores grouped 8 at a time (16 bytes, as float32's by 4; tinygrad's
        # ALLOW_HALF8, read through its cached getenv). H100, the 8B file: the staged products read x and w in half
        # the instructions and pp512 went +8% (docs/benchmarks.md). ALLOW_HALF8=0 in the environment keeps 4 at a time
        if intx.intrinsic(self.device) and "ALLOW_HALF8" not in os.environ:
            os.environ["ALLOW_HALF8"] = "1"
            getenv.cache_clear()
        self._kv_at = UOp.variable("kv_at", 0, 1 << 30)
        self.jit = os.environ.get("LEAT_TINYGRAD_JIT", "1") != "0"
        # products with this many rows or more dequantize the weight into a temporary copy first (0: never);
        # GPU devices only: on tinygrad's CPU device the fused product is as fast
        cpu = self.device.split(":")[0] in ("CPU", "PYTHON")
        self.gemm_rows = int(os.environ.get("LEAT_TINYGRAD_GEMM_ROWS", "0" if cpu else "16"))
        # those products in float16 (weight copy and x; float32 sums) for tensor cores: GPU devices by default.
        # Agreement then is the backend bar against the f64 oracle (top-1 >= 99%, mean KL < 1e-3), not float32's
        # ~1e-13. LEAT_TINYGRAD_HALF=0 keeps them float32.
        self.half_products = os.environ.get("LEAT_TINYGRAD_HALF", "0" if cpu else "1") != "0"
        # their weights' float16 copies kept across chunks while this many bytes last (_half_values; 0: none, each
        # chunk copies; None: decided at the first copy); LEAT_TINYGRAD_F16_BUDGET sets it, in bytes
        budget = os.environ.get("LEAT_TINYGRAD_F16_BUDGET", "")
        self.f16_budget: int | None = int(budget) if budget else None if self.half_products and not cpu else 0
        # their tensor-core optimisations chosen per shape (gemm.py); LEAT_TINYGRAD_TC_OPTS=0 leaves them to tinygrad
        self.tc_opts = os.environ.get("LEAT_TINYGRAD_TC_OPTS", "1") != "0"
        # or, where NVIDIA's tensor cores and the shape allow, our kernel of tiles staged through shared memory
        # (gemm.staged_product); LEAT_TINYGRAD_STAGED=0 keeps the kernel above for every shape
        self.staged_products = os.environ.get("LEAT_TINYGRAD_STAGED", "1") != "0"
        # every staged product's tiles, "rows,outputs,depth,warp_rows,warp_outputs[,pad,stages,runs,split]" (gemm.Tiles;
        # unset: the first of gemm.TILES that fits the shape; a shape the tiles do not fit keeps the kernel above)
        tiles = os.environ.get("LEAT_TINYGRAD_TILES", "")
        self.staged_tiles = Tiles.parse(tiles) if tiles else None
        # gemm.TILES' ring tiles split the inputs in parts while a product has fewer thread groups than this (gemm.
        # SPLIT_GROUPS; 0: never); LEAT_TINYGRAD_SPLIT_GROUPS sets it
        self.split_groups = int(os.environ.get("LEAT_TINYGRAD_SPLIT_GROUPS", str(SPLIT_GROUPS)))
        # products with up to this many rows and a weight of a gemv.py type use its kernel (0: never)
        self.gemv_rows = int(os.environ.get("LEAT_TINYGRAD_GEMV_ROWS", str(MAX_ROWS)))
        # its threads' shape, "lanes,groups,per_thread" (gemv.Shape; unset: gemv.Shape()'s default)
        shape = os.environ.get("LEAT_TINYGRAD_GEMV_SHAPE", "")
        self.gemv_shape = Shape(*(int(v) for v in shape.split(","))) if shape else None
        # one-row prefill chunks of these lengths run under TinyJit too (the engine's full chunks)
        lengths = os.environ.get("LEAT_TINYGRAD_PREFILL_JIT", str(PREFILL_CHUNK))
        self.prefill_lengths = frozenset(int(x) for x in lengths.split(",") if x.strip())
        # decode steps (every row one token) attend with attention.py's kernels, all rows at once (0: row by row)
        self.decode_attention = os.environ.get("LEAT_TINYGRAD_DECODE_ATTENTION", "1") != "0"
        # a prompt chunk's softmax (its scale, mask, soft cap and sinks) as softmax.py's one kernel where it applies
        # (a device with thread groups); 0: tinygrad's kernels for the Tensor ops (three over the scores)
        self.softmax_kernel = os.environ.get("LEAT_TINYGRAD_SOFTMAX", "1") != "0"
        # decode attention's scores and chunks in one kernel, its combine over lanes (attention.py; thread groups only)
        self.fused_attention = os.environ.get("LEAT_TINYGRAD_FUSED_ATTENTION", "1") != "0"
        # few-row products take their consumer into their kernel: silu_mul of a gate and an up product of the same x
        # (one kernel for both, gemv.py's "glu"), add of a product and the residual ("residual"); 0: each its own
        self.fuse_products = os.environ.get("LEAT_TINYGRAD_FUSE_PRODUCTS", "1") != "0"
        # few-row Q4_K and Q6_K products with x as 16-bit integers (intx.py: integer dot products): "1" every such
        # product (an x the norm kernel did not quantize gets a quantize_x kernel), "normed" only those whose x the
        # norm kernel quantized (q, k, v, gate, up: no kernel more), "0" none. Default "1" where the renderer is
        # CUDA's (its dp2a; H200, 8B file: tg128 +13% in one call for Q4_K, +2.6% more for Q6_K), "0" elsewhere (the
        # portable integer sums are not yet timed)
        mode = os.environ.get("LEAT_TINYGRAD_INT_PRODUCTS", "1" if intx.intrinsic(self.device) else "0")
        if mode not in ("0", "1", "normed"):
            raise ValueError(f"LEAT_TINYGRAD_INT_PRODUCTS={mode!r}: use 0, 1 or normed")
        self.int_products, self.int_products_normed_only = mode != "0", mode == "normed"
        # the types whose products take integer x (LEAT_TINYGRAD_INT_TYPES, comma-separated names; default every type
        # of intx.DOTS: "q4_k" leaves Q6_K's products on float x)
        known = {t.name.lower(): t for t in intx.DOTS}
        names = [n for n in os.environ.get("LEAT_TINYGRAD_INT_TYPES", ",".join(known)).lower().split(",") if n]
        if unknown := sorted(set(names) - known.keys()):
            raise ValueError(f"LEAT_TINYGRAD_INT_TYPES: {', '.join(unknown)}? use names of {', '.join(known)}")
        self.int_types = frozenset(known[n] for n in names)
        self._quantized: dict[int, tuple[Tensor, Any]] = {}  # id(x) -> (x, intx.quantize(x)), the latest few
        # RMS norms of up to this many rows are norm.py's one kernel where it applies (0: tinygrad's own two; unset:
        # any number, prompt chunks too: the 8B file's pp512 +2.9% against tinygrad's two at 512 rows, H100)
        self.norm_rows = int(os.environ.get("LEAT_TINYGRAD_NORM_ROWS", str(sys.maxsize)))
        # the latest few-row products not yet consumed: id(output) -> (output, x, weight), for their consumers
        self._products: dict[int, tuple[Tensor, Tensor, Weight]] = {}
        # the latest prompt-chunk outputs that a staged product's kernel of x's layout can make itself, not yet
        # consumed (_keep_layout, _laid_out): id(output) -> (output, tiles -> the laid-out x or None). A norm's output written in
        # ring.py's layout by the norm kernel, silu_mul's computed by the interleave: no kernel of their own
        self._layouts: dict[int, tuple[Tensor, Callable[[Tiles], Tensor | None]]] = {}
        # float16 copies of several weights side by side (matmuls): ids -> (the weights, the copy)
        self._joined: dict[tuple[int, ...], tuple[tuple[Weight, ...], Tensor]] = {}
        # the latest rotated q and k: id(output) -> (output, input, spec, positions, cos, sin), for attention (_roped)
        self._ropes: dict[int, tuple[Tensor, Tensor, RopeSpec, Any, Tensor, Tensor]] = {}
        self._jits: dict[tuple[Callable, int, int], TinyJit] = {}
        # each jit's input Tensors (with their host dtype), reused step after step
        self._inputs: dict[tuple, dict[int, tuple[np.dtype, Tensor]]] = {}
        self._eager: set[Callable] = set()  # forwards that cannot be jitted
        self._step: _Step | None = None
        self._rope_tables: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._rope_specs: dict[tuple, RopeSpec] = {}  # every spec rope has seen, by _rope_key
        self._nets: weakref.WeakKeyDictionary[DeltaNet, tuple[Tensor, ...]] = weakref.WeakKeyDictionary()

    def describe(self) -> dict[str, Any]:
        from tinygrad.helpers import CACHEDB

        return {
            "backend": self.name,
            "precision": self.precision,
            "device": self.device,
            "DEV": os.environ.get("DEV", "(unset: tinygrad's first working device)"),
            "compiler": type(Device[self.device].compiler).__name__,
            "kernel_cache": CACHEDB,
            "int_products": "normed" if self.int_products_normed_only else int(self.int_products),
            "int_types": ",".join(sorted(t.name.lower() for t in self.int_types)),
            "softmax_kernel": int(self.softmax_kernel),
            "fused_attention": int(self.fused_attention and Device[self.device].renderer.has_local),
            # whether a 512-row chunk's 4096 x 4096 product is staged (gemm.tiles_for), and with what
            "staged_products": repr(self._tiles(512, 4096, 4096)) if self.staged_products else "off",
            "lane_sum": lanesum.mode(self.device) if Device[self.device].renderer.has_local else "loop",
        }

    # -- memory -------------------------------------------------------------------------------------
    def _tensor(self, array: np.ndarray) -> Tensor:
        # GPU devices copy in from a writable buffer: GGUF's memory-mapped tensors are read-only
        return Tensor(np.require(array, requirements=("C", "W")), device=self.device)

    def upload(self, tensor: FileTensor) -> Weight:
        qtype, host = tensor.qtype, np.asarray(tensor.data)
        if qtype in DEQUANTIZERS:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            stored = as_words(host.view(np.uint8).reshape(*tensor.shape[:-1], tensor.shape[-1] // block, size), qtype)
        elif qtype in (Q.F32, Q.F16):
            stored = host.view(np.float32 if qtype == Q.F32 else np.float16).reshape(tensor.shape)
        elif qtype in LOAD_DEQUANTIZED:
            stored = gguf.quants.dequantize(host, qtype).reshape(tensor.shape).astype(np.float32)
        else:
            raise UnsupportedQuantType(f"tensor {tensor.name} is {qtype.name}, which the tinygrad backend cannot use")
        data = self._tensor(stored).realize()
        self.allocations.weights += stored.nbytes
        kind = qtype.name if qtype not in LOAD_DEQUANTIZED else f"{qtype.name} (as F32)"
        self.allocations.by_type[kind] = self.allocations.by_type.get(kind, 0) + stored.nbytes
        return Weight(data, qtype, tuple(tensor.shape), host)

    def _values(self, x: Any) -> Tensor:
        """float32 Tensor of an op argument: a Weight, a Tensor, or a host array (tests, small tables)."""
        if isinstance(x, Weight):
            return x.values()
        if isinstance(x, Tensor):
            return x
        return self._tensor(np.asarray(x, dtype=np.float32))

    def to_host(self, x: Tensor) -> np.ndarray:
        """x as a host array. A realized buffer of x's size (a step's logits, reshaped) is copied out by its
        allocator, as tinygrad's own copy does in the end, without scheduling a copy on the way (tinygrad is pinned
        to 0.14.0, where the tests hold it). With the TinyJit's arguments only Variables (``run``), a 1B file's
        decode step took 1.18-1.23 -> 0.47-0.48 ms of host time on tinygrad's NULL device (2-core machine,
        `scripts/tinygrad_host_profile.py FILE decode`)."""
        base = unreshaped(x)
        buffer = base.realized if base.op is Ops.BUFFER else None
        kind = _to_np_dtype(x.dtype)
        if isinstance(buffer, Buffer) and buffer.nbytes == x.nbytes() and kind is not None:
            out = np.empty(x.shape, kind)
            buffer.allocator._copyout(memoryview(out).cast("B"), buffer._buf)
            return out
        return x.numpy()

    def from_host(self, x: np.ndarray) -> Tensor:
        return self._tensor(np.asarray(x, dtype=np.float32))

    # -- steps under TinyJit --------------------------------------------------------------------------
    def run(self, forward: Callable[[Batch, Any], Any], batch: Batch, kv: Any) -> Any:
        """One forward step; a decode batch (one token per row) or a one-row prefill chunk runs under TinyJit.

        The batch is padded to a bucket of DECODE_BUCKETS with copies of its first row (which write the
        same K/V to the same place); each (forward, KV cache, bucket) has its own TinyJit. The step's
        tokens, positions and page-table rows are copied into Tensors kept for its key (``_input``), which the
        captured kernels read as they read the weights; each row's KV storage row per page group is a bound
        Variable, the TinyJit's only arguments; ops read those in place of the batch's host arrays (embed gathers
        the stored rows on the device, rope gathers rows of a cos/sin table made on the host). The first
        call captures the kernels (TinyJit's usual eager first call is skipped: everything it would
        initialise is realized already), later ones replay them: no graph building or scheduling in
        Python. One-row prefill chunks of a length in ``prefill_lengths`` run under a TinyJit of their own, and
        shorter ones padded to a power of two (``_padded_length``); a prompt chunk with one-token rows replays a TinyJit
        of its own (``_mixed``), and other batches of several rows (several chunks, rows with drafts) run as such
        steps one after the other (``_parts``). A forward that needs host values inside the
        step (MoE routing) runs eagerly from then on. Recurrent states (``gated_delta_net``) are read and written
        per row through its slot, a bound Variable; run() checks that the rows continue them and counts their tokens.
        ``LEAT_TINYGRAD_JIT=0`` turns the JIT off. The logits of a replay stay valid until the next step of
        the same bucket.
        """
        n = len(batch)
        if not self.jit or forward in self._eager or not isinstance(kv, KVCache):
            return forward(batch, kv)
        if batch.inputs is not None or any(row.bidirectional for row in batch.rows):
            return forward(batch, kv)  # an image's row (embeddings for inputs, attending both ways): once per image
        if kv.recurrent and any(self._drafting(row) for row in batch.rows):
            return forward(batch, kv)  # a verified draft keeps the state before it (deltanet.RecurrentState)
        if n == len(batch.rows) and n <= DECODE_BUCKETS[-1]:
            bucket = next(b for b in DECODE_BUCKETS if b >= n)
            key: tuple = (forward, id(kv), bucket)
        elif len(batch.rows) == 1 and n in self.prefill_lengths and self._one_run(kv, batch.rows[0]):
            bucket = n
            key = (forward, id(kv), "prefill", n, batch.rows[0].all_logits)
        elif (bucket := self._padded_length(kv, batch)) is not None:
            key = (forward, id(kv), "padded", bucket, batch.rows[0].all_logits)
        elif (mixed := self._mixed(kv, batch)) is not None:
            chunk_at, bucket, singles = mixed
            key = (forward, id(kv), "mixed", bucket, singles)
        elif (parts := self._parts(kv, batch)) is not None:
            return self._run_parts(forward, batch, kv, parts)
        else:
            return forward(batch, kv)
        if key not in self._jits and key[2] == "prefill" and not self._rope_specs:
            # rope tables are made on the host from the specs an eager step meets (a decode step comes after a
            # prefill); this eager step writes the same K/V the capture below writes again
            forward(batch, kv)
        for spec in self._rope_specs.values():  # tables made inside a capture would be copied again at each replay
            self._rope_table(spec, kv.context)
        extra: list[Tensor] = []
        if key[2] == "padded":  # the chunk's last token repeated up to the bucket; valid and last are inputs
            row = batch.rows[0]
            tokens = np.concatenate([row.tokens, np.repeat(row.tokens[-1:], bucket - n)])
            padded = Batch([replace(row, tokens=tokens)])
            extra = [self._input(key, -2, np.array([n], np.int32)), self._input(key, -1, np.array([n - 1], np.int32))]
        elif key[2] == "mixed":  # decode rows padded to their bucket, then the chunk padded to its length
            chunk = batch.rows[chunk_at]
            ones = [row for i, row in enumerate(batch.rows) if i != chunk_at]
            tokens = np.concatenate([chunk.tokens, np.repeat(chunk.tokens[-1:], bucket - len(chunk.tokens))])
            padded = Batch([*ones, *[ones[0]] * (singles - len(ones)), replace(chunk, tokens=tokens)])
            last = np.append(np.arange(singles), singles + len(chunk.tokens) - 1).astype(np.int32)
            extra = [self._input(key, -2, np.array([len(chunk.tokens)], np.int32)), self._input(key, -1, last)]
        elif bucket > len(batch.rows):
            padded = Batch(batch.rows + [batch.rows[0]] * (bucket - n))
        else:
            padded = batch
        starts = np.asarray([row.start for row in padded.rows], np.int64)
        pages, at = [], []
        for table in kv.tables:
            rows = table[[row.slot for row in padded.rows]]
            page = rows[np.arange(len(padded.rows)), starts // kv.page_size]
            if (page < 0).any():
                raise ValueError(f"a slot has no page for position {starts[int(np.argmin(page))]}")
            pages.append(self._input(key, 2 + len(pages), np.maximum(rows, 0).astype(np.int32)))
            at.extend(self._at_variable(len(at)).bind(int(a)) for a in page * kv.page_size + starts % kv.page_size)
        slots = [UOp.variable(f"slot_{i}", 0, 1 << 20).bind(row.slot) for i, row in enumerate(padded.rows)]
        tokens = self._input(key, 0, padded.tokens.astype(np.int32))
        positions = self._input(key, 1, padded.positions.astype(np.int32))
        valid, last = extra if extra else (None, None)
        jit = self._jits.get(key)
        if jit is None:
            if not any(k[1] == id(kv) for k in self._jits):
                weakref.finalize(kv, self._forget, id(kv))  # a cache's jits go with it
            jit = self._jits[key] = TinyJit(self._jitted_step)
            # capture on the first call: weights, KV storage and rope tables are realized already; a padded chunk's
            # (alone or with decode rows) on its second (its first runs as an eager step would: a one-off pays no capture)
            jit.cnt = 0 if key[2] in ("padded", "mixed") else 1
        self._enter(kv, list(kv.recurrent), batch.rows)
        self._step = _Step(forward, kv, padded, tokens, positions, pages, valid=valid, last=last)
        try:
            # the step's arrays are in its inputs' buffers already (copied in): the TinyJit is given only the bound
            # Variables, so its graphs read those buffers as they read the weights (no node updated a replay)
            logits = jit(*slots, *at)
        except _NotJittable:
            self._eager.add(forward)
            self._forget(id(kv))
            logits = None
        finally:
            self._step = None
        if logits is None:
            return forward(batch, kv)
        self._took(kv, list(kv.recurrent), batch.rows)
        if key[2] == "mixed":  # the rows' logits in the batch's order: its decode rows' and the chunk's last
            order = [singles if i == chunk_at else i - (i > chunk_at) for i in range(len(batch.rows))]
            if order == list(range(len(batch.rows))):  # the chunk last (the engine's usual order) and a full bucket
                return logits
            if chunk_at == len(batch.rows) - 1:
                return logits[:chunk_at].cat(logits[singles:])
            return logits[self._tensor(np.asarray(order, np.int32))]
        if key[2] == "padded" and not batch.rows[0].all_logits:
            return logits
        return logits[:n] if n < bucket else logits

    def _padded_length(self, kv: KVCache, batch: Batch) -> int | None:
        """The jitted length a one-row batch's prefill chunk pads to (:meth:`_chunk_length`), or None."""
        return self._chunk_length(kv, batch.rows[0]) if len(batch.rows) == 1 else None

    def _mixed(self, kv: KVCache, batch: Batch) -> tuple[int, int, int] | None:
        """A batch of one prompt chunk and one-token rows (the engine's continuous batching: a prompt joining
        requests that decode): the chunk's index, the length it pads to (:meth:`_chunk_length`) and the bucket
        of DECODE_BUCKETS the one-token rows pad to (copies of the first, as a decode step's). None for any other
        batch, a row that wants every logit (a draft), or recurrent states (whose chunk would need its own count
        of real tokens)."""
        rows = batch.rows
        chunks = [i for i, row in enumerate(rows) if len(row.tokens) > 1]
        if len(chunks) != 1 or len(rows) < 2 or len(rows) - 1 > DECODE_BUCKETS[-1] or kv.recurrent:
            return None
        if any(row.all_logits for row in rows) or (length := self._chunk_length(kv, rows[chunks[0]])) is None:
            return None
        return chunks[0], length, next(b for b in DECODE_BUCKETS if b >= len(rows) - 1)

    def _parts(self, kv: KVCache, batch: Batch) -> list[list[int]] | None:
        """The rows (indices) of sub-batches, each of a jitted form, for a batch that is not one as a whole (several
        prompt chunks, or rows with drafts): its one-token rows (with its first other row where they make a mixed
        step), then each other row alone. A row reads and writes only its own slot's KV and state, so the rows'
        logits are what the whole batch's step would give. None where splitting gains nothing: one row, or more
        one-token rows than a decode bucket holds."""
        rows = batch.rows
        ones = [i for i, row in enumerate(rows) if len(row.tokens) == 1 and not row.all_logits]
        others = [i for i in range(len(rows)) if i not in ones]
        if len(rows) < 2 or len(ones) > DECODE_BUCKETS[-1] or not others:
            return None
        if ones and self._mixed(kv, Batch([rows[i] for i in [*ones, others[0]]])) is not None:
            return [[*ones, others[0]], *([i] for i in others[1:])]
        return [ones] * bool(ones) + [[i] for i in others]

    def _run_parts(self, forward: Callable[[Batch, Any], Any], batch: Batch, kv: KVCache, parts: list[list[int]]):
        """The batch's logits from one step per part (:meth:`_parts`), in the batch's order."""
        pieces: dict[int, Tensor] = {}
        for part in parts:
            rows = [batch.rows[i] for i in part]
            out = self.run(forward, Batch(rows), kv).clone().realize()  # a later replay would overwrite a jit's output
            at = 0
            for i, row in zip(part, rows):
                count = len(row.tokens) if row.all_logits else 1
                pieces[i], at = out[at : at + count], at + count
        ordered = [pieces[i] for i in range(len(batch.rows))]
        return ordered[0].cat(*ordered[1:])

    def _chunk_length(self, kv: KVCache, row) -> int | None:
        """The jitted length a prefill chunk no longer than the longest jitted one pads to (a power of two, at least
        16 or the longest), or None where it cannot: its tokens not on one run of adjacent storage rows, or the padded
        rows past the cache's context or storage."""
        n = len(row.tokens)
        if not self.prefill_lengths:
            return None
        longest = max(self.prefill_lengths)
        bucket = max(min(16, longest), 1 << (n - 1).bit_length())
        if n < 2 or bucket > longest or row.start + bucket > kv.context or not self._one_run(kv, row):
            return None
        for layer, storage in enumerate(kv.k):
            page = int(kv.tables[kv.group_of[layer]][row.slot][row.start // kv.page_size])
            if page * kv.page_size + row.start % kv.page_size + bucket > storage.shape[0]:
                return None
        return bucket

    def _one_run(self, kv: KVCache, row) -> bool:
        """Whether the row's tokens land on one run of adjacent storage rows in every page group (a prefill
        chunk is jitted only then: its K/V is written by one assign at a bound row)."""
        first, last = row.start // kv.page_size, (row.start + len(row.tokens) - 1) // kv.page_size
        for table in kv.tables:
            pages = table[row.slot][first : last + 1]
            if len(pages) != last - first + 1 or (pages < 0).any() or (np.diff(pages) != 1).any():
                return False
        return True

    def _jitted_step(self, *variables: UOp) -> Tensor:
        """The step's forward; ``variables``: each row's slot, then each page group's rows' storage rows (bound)."""
        step, rows = self._step, len(self._step.batch.rows)
        step.slots, at = list(variables[:rows]), variables[rows:]
        step.at = [list(at[g * rows : (g + 1) * rows]) for g in range(len(step.kv.tables))]
        out = step.forward(step.batch, step.kv).contiguous()
        if step.pending:
            out.realize()
            for target, value in step.pending:
                target.assign(value).realize()
        return out

    def _at_variable(self, index: int) -> UOp:
        return UOp.variable(f"kv_at_{index}", 0, 1 << 30)

    def _forget(self, kv_id: int) -> None:
        for key in [k for k in self._jits if k[1] == kv_id]:
            del self._jits[key]
            self._inputs.pop(key, None)

    def _input(self, key: tuple, index: int, array: np.ndarray) -> Tensor:
        """Input ``index`` of ``key``'s TinyJit: the same realized Tensor at every step, the step's bytes copied
        into its buffer with the allocator's copy-in, as tinygrad's own realize does (``Allocator._copyin``;
        tinygrad is pinned to 0.14.0, where the tests hold it). A new Tensor per input and step costs tinygrad a
        schedule each: a 1B file's decode step took 6.7-7.3 ms of host time that way, 0.9-1.2 ms this way (tinygrad's
        NULL device on a 2-core machine, docs/benchmarks.md). The TinyJit's kernels read the buffer as captured: where
        a new Tensor must be made (another shape), the key's TinyJit goes and the next step captures anew."""
        array = np.ascontiguousarray(array)
        inputs = self._inputs.setdefault(key, {})
        dtype, tensor = inputs.get(index, (None, None))
        if tensor is None or tensor.shape != array.shape or dtype != array.dtype:
            if tensor is not None:
                self._jits.pop(key, None)
            tensor = self._tensor(array).realize()
            inputs[index] = (array.dtype, tensor)
        else:
            buffer = tensor.uop.buffer
            buffer.allocator._copyin(buffer._buf, memoryview(array).cast("B"))
        return tensor

    def _stepping(self, host: Any) -> _Step | None:
        """The jitted step whose batch ``host`` (its tokens, its positions, or itself) belongs to, if any."""
        step = self._step
        if step is not None and any(host is x for x in (step.batch, step.batch.tokens, step.batch.positions)):
            return step
        return None

    def _rope_table(self, spec: RopeSpec, capacity: int) -> tuple[Tensor, Tensor]:
        """cos and sin [capacity, dims / 2] of positions 0 .. capacity - 1, made on the host once per spec."""
        key = (*_rope_key(spec), capacity)
        if key not in self._rope_tables:
            cos, sin = _cos_sin(spec, np.arange(capacity))
            self._rope_tables[key] = (self._tensor(cos).realize(), self._tensor(sin).realize())
        return self._rope_tables[key]

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, weight: Weight, tokens: np.ndarray) -> Tensor:
        step = self._stepping(tokens)
        if step is not None:  # a gather of the stored rows on the device, dequantized there
            # realized here: the layer's norm and its residual add both read it, and left lazy each would repeat the
            # gather and the dequantizing (three kernels)
            return weight._values(weight.data[step.tokens], (len(tokens), *weight.shape[1:])).realize()
        # The rows are taken from the host copy of the stored bytes and dequantized there (as llama.cpp's
        # get_rows): a gather from a [vocab, d] table on the device would read the whole table.
        rows = np.asarray(weight.host).reshape(weight.shape[0], -1)[np.asarray(tokens)]
        values = gguf.quants.dequantize(rows, weight.qtype).reshape(len(tokens), *weight.shape[1:])
        return self._tensor(values.astype(np.float32))

    def matmul(self, x: Tensor, weight: Any, bias: Any = None) -> Tensor:
        x = self._values(x)
        quantized = isinstance(weight, Weight) and weight.qtype in DEQUANTIZERS
        if quantized and self.gemm_rows and x.shape[0] >= self.gemm_rows:
            # Many rows (prefill): dequantize the blocks once into a copy (float32, or float16), then a plain product.
            # Fused into the product, the dequantization would be repeated for every tile of rows (the 8B
            # file's first pp512 did not finish in minutes that way). In float16 (half_products) tensor-core kernels
            # take the product, summing in float32 (gemm.py: tiles staged through shared memory where NVIDIA's tensor
            # cores take them, else opts chosen per shape), and the weight's copy is kept across chunks (_half_values:
            # the 8B file's copies were 17.5 ms of a 166 ms chunk on the H200).
            # x and the product are realized on their own (contiguous): fused with the norm before it, or with a
            # sibling product through silu_mul after it, tinygrad wrote one kernel without tensor cores (the 8B
            # file's gate and up with their norm: 20 ms a layer of a 512-token chunk, 85% of it)
            if self.half_products:
                (rows, inputs), outputs = x.shape, weight.shape[0]
                tiles = self._tiles(rows, outputs, inputs) if self.staged_products else None
                if tiles is not None:  # x cast to float16 as the kernel lays it out (gemm.laid_out)
                    y = staged_product(x, self._half_values(weight), tiles, self._laid_out(x, tiles))
                else:
                    renderer = Device[self.device].renderer
                    opts = tuned_opts(renderer, rows, outputs, inputs) if self.tc_opts else None
                    y = half_product(x.cast(dtypes.float16).contiguous(), self._half_values(weight), opts)
            else:
                y = (x.contiguous() @ weight.values().contiguous().T).contiguous()
        elif quantized and weight.qtype in LAYOUTS and x.shape[0] <= self.gemv_rows and weight.data.ndim == 3:
            # Few rows (decode) of Q8_0, Q4_0, Q4_K, Q6_K, MXFP4: our own kernel, a set of lanes per output
            # reading the row's blocks in storage order (gemv.py)
            y = gemv(self._gemv_x(x, weight.qtype), weight.data, weight.qtype, self.gemv_shape)
            if bias is None and self.fuse_products:  # its consumer may take it in (silu_mul, add): still lazy
                self._products[id(y)] = (y, x, weight)
                while len(self._products) > PRODUCTS_KEPT:
                    del self._products[next(iter(self._products))]
        elif quantized and weight.shape[-1] % SPLIT == 0:
            # Few rows (decode): the product in SPLIT partial sums per output, then their sum, as two kernels.
            # tinygrad gives a one-row product with the dequantization fused one thread per few outputs, each
            # looping over the whole row: 1.3-14x slower on the H200 (a 4096 x 14336 Q6_K product 2.62 ms ->
            # 0.18 ms; the table is in the README).
            n, k = x.shape[0], weight.shape[-1]
            w = weight.values().reshape(1, weight.shape[0], SPLIT, k // SPLIT)
            y = (x.reshape(n, 1, SPLIT, k // SPLIT) * w).sum(-1).contiguous().sum(-1)
        else:
            y = x @ self._values(weight).T
        return y + self._values(bias) if bias is not None else y

    def matmuls(self, x: Any, weights: Sequence[Any], biases: Sequence[Any] | None = None) -> list[Any]:
        """Products of one x: a prompt chunk's staged products of quantized weights as one, the weights' float16
        copies side by side in one copy, while their outputs together are at most gemm.JOINED_OUTPUTS (a layer's q,
        k and v: the 8B file's 4096, 1024 and 1024 outputs fill 128, 32 and 32 thread groups of 128 x 128 alone, on
        an H100's 132 multiprocessors); larger (gate and up) staged apart from one x laid out once (gemm.laid_out:
        ring.py's interleave); else :meth:`matmul` each."""
        x, biases = self._values(x), biases or [None] * len(weights)
        sizes = [w.shape[0] for w in weights]
        rows, inputs, outputs = x.shape[0], weights[0].shape[-1], sum(sizes)
        staged = (
            1 < len(weights)
            and self.half_products
            and self.staged_products
            and self.gemm_rows
            and rows >= self.gemm_rows
            and all(
                isinstance(w, Weight) and w.qtype in DEQUANTIZERS and w.shape == (w.shape[0], inputs) for w in weights
            )
        )
        # one product of the copies side by side, or one tile set for all apart; None: matmul each
        shapes = [outputs] if outputs <= JOINED_OUTPUTS else sizes
        chosen = {self._tiles(rows, n, inputs) for n in shapes} if staged else set()
        tiles = chosen.pop() if len(chosen) == 1 else None
        if tiles is None:
            return super().matmuls(x, weights, biases)
        laid = self._laid_out(x, tiles)
        if outputs <= JOINED_OUTPUTS:
            y = staged_product(x, self._half_values(*weights), tiles, laid)
            ends = list(itertools.accumulate(sizes))
            outs = [y[:, end - size : end] for size, end in zip(sizes, ends)]
        else:
            laid = laid_out(x, tiles, dtypes.float16) if laid is None else laid
            outs = [staged_product(x, self._half_values(w), tiles, laid) for w in weights]
        return [out if b is None else out + self._values(b) for out, b in zip(outs, biases)]

    def _laid_out(self, x: Tensor, tiles: Tiles) -> Tensor | None:
        """x laid out for a staged product of ``tiles`` by the kernel that would make x (a :meth:`rms_norm` or
        :meth:`silu_mul` of a prompt chunk not yet consumed: see _layouts), or None (staged_product lays it out)."""
        made = self._layouts.pop(id(x), None)
        return made[1](tiles) if made is not None and made[0] is x else None

    def _keep_layout(self, y: Tensor, make: Callable[[Tiles], Tensor | None]) -> Tensor:
        """``y``, with ``make`` remembered for a staged product that takes it as x (_laid_out) where ``y`` has rows
        enough for one (a prompt chunk's); the latest few kept."""
        if self.staged_products and self.half_products and self.gemm_rows and y.shape[0] >= self.gemm_rows:
            self._layouts[id(y)] = (y, make)
            while len(self._layouts) > PRODUCTS_KEPT:
                del self._layouts[next(iter(self._layouts))]
        return y

    def _tiles(self, rows: int, outputs: int, inputs: int) -> Tiles | None:
        """The staged product's tiles for this shape (gemm.tiles_for with this backend's settings), or None."""
        renderer = Device[self.device].renderer
        return tiles_for(renderer, rows, outputs, inputs, chosen=self.staged_tiles, split_groups=self.split_groups)

    def _half_values(self, *weights: Weight) -> Tensor:
        """float16 values of quantized weights (their rows one after another) for a prefill product: a copy, made and
        realized at its first such product (never inside a TinyJit's capture) and kept while ``f16_budget`` lasts
        (one weight's on it, several's by their ids); past it, a copy made in each chunk's own kernels. The budget,
        unless set, is F16_WEIGHTS_SHARE of a CUDA device's memory when the weights take at most a quarter of that
        share, else none; F16_BUDGET where tinygrad does not tell the memory."""
        key = tuple(id(w) for w in weights)
        kept = weights[0].half if len(weights) == 1 else self._joined.get(key, (None, None))[1]
        if kept is not None:
            return kept
        values = [w.values() for w in weights]
        half = (values[0] if len(values) == 1 else values[0].cat(*values[1:])).cast(dtypes.float16).contiguous()
        if self.f16_budget is None:
            total = _device_memory(self.device)
            share = total is not None and self.allocations.weights <= F16_WEIGHTS_SHARE / 4 * total
            self.f16_budget = F16_BUDGET if total is None else int(F16_WEIGHTS_SHARE * total) if share else 0
        size = 2 * half.numel()
        if size > self.f16_budget:
            return half
        self.f16_budget -= size
        with _outside_capture():
            half.realize()
        if len(weights) == 1:
            weights[0].half = half
        else:
            self._joined[key] = (weights, half)  # the weights held: their ids stay theirs
        self.allocations.weights += size
        self.allocations.by_type["F16 copies"] = self.allocations.by_type.get("F16 copies", 0) + size
        return half

    def rms_norm(self, x: Tensor, weight: Any, eps: float) -> Tensor:
        x = self._values(x)
        if x.shape[0] <= self.norm_rows and norm.applies(x):  # few rows (decode): one kernel of our own
            w = self._values(weight) if weight is not None else None
            # its output quantized there too where the products after it take integer x (gemv.py's few rows)
            if self.int_products and x.shape[0] <= self.gemv_rows and norm.run_lanes(x.shape[1]) is not None:
                y, quantized = norm.rms_norm_quantized(x, w, eps)
                self._remember_quantized(y, quantized)
                return y

            def make(tiles: Tiles) -> Tensor | None:  # written in ring.py's layout by the norm's own kernel
                if tiles.stages != ring.STAGES:
                    return None
                padded = -(-x.shape[0] // tiles.rows) * tiles.rows
                return norm.rms_norm_laid_out(x, w, eps, tiles.depth, padded)

            return self._keep_layout(norm.rms_norm(x, w, eps), make)
        y = x * ((x * x).mean(axis=-1, keepdim=True) + eps).rsqrt()
        return y * self._values(weight) if weight is not None else y

    def layer_norm(self, x: Tensor, weight: Any, bias: Any, eps: float) -> Tensor:
        x = self._values(x)
        centred = x - x.mean(axis=-1, keepdim=True)
        y = centred * ((centred * centred).mean(axis=-1, keepdim=True) + eps).rsqrt()
        y = y * self._values(weight) if weight is not None else y
        return y + self._values(bias) if bias is not None else y

    def rope(self, x: Tensor, positions: np.ndarray, spec: RopeSpec) -> Tensor:
        x = self._values(x)
        half = spec.dims // 2
        step = self._stepping(positions)
        if step is not None:
            if (key := _rope_key(spec)) not in step.rope:
                table = self._rope_table(spec, step.kv.context)
                cos, sin = (t[step.positions].reshape(-1, 1, half) for t in table)
                step.rope[key] = (cos, sin)
                Tensor.realize(cos, sin)
            cos, sin = step.rope[key]
        else:
            self._rope_specs.setdefault(_rope_key(spec), spec)
            cos, sin = (self._tensor(t[:, None, :]) for t in _cos_sin(spec, positions))
        n, heads = x.shape[0], x.shape[1]
        rotated = x[..., : spec.dims]
        if spec.neox:
            a, b = rotated[..., :half], rotated[..., half:]
            out = (a * cos - b * sin).cat(a * sin + b * cos, dim=-1)
        else:
            pairs = rotated.reshape(n, heads, half, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            out = (
                (a * cos - b * sin)
                .unsqueeze(-1)
                .cat((a * sin + b * cos).unsqueeze(-1), dim=-1)
                .reshape(n, heads, spec.dims)
            )
        out = out.cat(x[..., spec.dims :], dim=-1) if spec.dims < x.shape[-1] else out
        if self.fuse_products:  # a decode step's attention may rotate q and k itself (_roped)
            self._ropes[id(out)] = (out, x, spec, positions, cos, sin)
            while len(self._ropes) > 2:
                del self._ropes[next(iter(self._ropes))]
        return out

    def _attend(self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float, softcap=None, sinks=None):
        """Paged, causal, windowed GQA attention (see Backend.attention); scores soft-capped when
        ``softcap`` is given, each head's ``sinks`` logit in its softmax denominator when given. A bidirectional
        row's queries see through its last position (only eagerly: run() jits no such row), their windows counted
        back from their own positions.
        A latent layout (MLA) stores only keys; its values are the keys' first ``value_dim`` entries."""
        layout: KVLayout = kv.layouts[layer]
        q, k = self._values(q), self._values(k)
        v = self._values(v) if v is not None else None
        decoding = self._decoding(batch, kv, layout)
        float_decoding = decoding and kv.dtype != "q8_0"
        # a decode step's q and k still to be rotated, with v and float storage: rope and both writes as one kernel
        roped = self._roped(q, k, v) if float_decoding else None
        # else several rows' float KV writes as one kernel each (attention.py's write_rows); q8_0's row by row
        batched = float_decoding and len(batch.rows) > 1
        if roped is None:
            if decoding:  # attention.py's kernels read q as a plain buffer: realized contiguous
                q = q.contiguous()
            # computed once, not once per KV write; a float decode step writes k once (one kernel, or one a row for a
            # single row): the write computes it, its rope inside. A prompt chunk's q stays lazy: each row's score
            # product reads its own span once, through the kernel that casts and permutes it (its rope inside)
            Tensor.realize(*(t for t in (q if decoding else None, None if float_decoding else k, v) if t is not None))
        _, heads, dim = q.shape
        kv_heads = layout.kv_heads
        value_dim = layout.value_dim or layout.head_dim
        group = heads // kv_heads
        step = self._stepping(batch)
        page_group = kv.group_of[layer]
        if decoding:
            if step is not None:
                table, positions = step.pages[page_group], step.positions
            else:
                host = kv.table(layer)[[row.slot for row in batch.rows]]
                at = np.asarray(batch.positions, np.int64)
                if (missing := host[np.arange(len(at)), at // kv.page_size] < 0).any():
                    raise ValueError(f"a slot has no page for position {at[int(np.argmax(missing))]}")
                table = self._tensor(np.maximum(host, 0).astype(np.int32))
                positions = self._tensor(at.astype(np.int32))
            if roped is not None:
                (q_in, k_in, spec, cos, sin), storage = roped, (kv.k[layer], kv.v[layer])
                made = self._rope_products(q_in, k_in, v, spec, cos, sin, storage, table, positions, kv.page_size)
                if made is not None:
                    q = made
                else:
                    q_in, k_in, v = self._together(q_in, k_in, v)
                    q = rope_write(
                        q_in, k_in, v, cos, sin, *storage, table, positions, kv.page_size, spec.dims, spec.neox
                    )
            elif not batched:
                for i, row in enumerate(batch.rows):
                    at = step.at[page_group][i] if step else None
                    self._store(kv, layer, "k", row, slice(i, i + 1), k, at)
                    self._store(kv, layer, "v", row, slice(i, i + 1), v, at)
            else:  # every row's key, then value, in a kernel, through the page tables
                write_rows(kv.k[layer], k, table, positions, kv.page_size)
                write_rows(kv.v[layer], v, table, positions, kv.page_size)
            scales = (kv.k_scale[layer], kv.v_scale[layer]) if kv.dtype == "q8_0" else None
            sinks = self._values(sinks).reshape(heads) if sinks is not None else None
            return decode_attention(
                q,
                kv.k[layer],
                kv.v[layer],
                table,
                positions,
                kv.page_size,
                scale,
                layout.window,
                softcap,
                sinks,
                scales,
                self.fused_attention,
            )
        outs = []
        for i, (row, offset) in enumerate(zip(batch.rows, batch.offsets)):
            length = len(row.tokens)
            span = slice(int(offset), int(offset) + length)
            at, table = (step.at[page_group][i], step.pages[page_group][i]) if step else (None, None)
            self._store(kv, layer, "k", row, span, k, at)
            if not layout.latent:
                self._store(kv, layer, "v", row, span, v, at)
            # a prompt chunk's two products in float16 for tensor cores, summed in float32 (half_products)
            kind = dtypes.float16 if self.half_products and self.gemm_rows and length >= self.gemm_rows else None
            keys = self._gather(kv, layer, "k", row.slot, table, kind)
            values = keys[..., :value_dim] if layout.latent else self._gather(kv, layer, "v", row.slot, table, kind)
            qs = q[span].reshape(length, kv_heads, group, dim).permute(1, 2, 0, 3)
            qs = qs if kind is None else qs.cast(kind).contiguous()
            scores = qs.matmul(
                keys.permute(1, 2, 0).unsqueeze(1), dtype=dtypes.float32
            )  # [kv_heads, group, length, total]
            probabilities = self._probabilities(scores, kind, scale, softcap, layout.window, sinks, row, step, offset)
            # [kv_heads, group, length, value_dim]
            out = probabilities.matmul(values.permute(1, 0, 2).unsqueeze(1), dtype=dtypes.float32)
            outs.append(out.permute(2, 0, 1, 3).reshape(length, heads * value_dim))
        return outs[0] if len(outs) == 1 else outs[0].cat(*outs[1:], dim=0)

    def _probabilities(self, scores, kind, scale, softcap, window, sinks, row, step, offset) -> Tensor:
        """A chunk's attention probabilities [kv_heads, group, length, total] from its scores (q . k, float32): scaled,
        soft-capped, masked (causal, windowed; a bidirectional row's queries see through its last position), the
        softmax with each head's ``sinks`` logit in its denominator; float16 where ``kind``. One kernel where
        softmax.py's applies (the queries' positions the step's input, at the row's offset, where jitted), else
        Tensor ops."""
        kv_heads, group, length, total = scores.shape
        if self.softmax_kernel and not row.bidirectional and softmax.applies(scores.device, total):
            if step is not None:  # the step's input: the jitted kernel reads the positions each replay copies in
                positions, first = step.positions, int(offset)
            else:
                positions, first = self._tensor(np.arange(row.start, row.start + length, dtype=np.int32)), 0
            return softmax.probabilities(
                scores,
                positions,
                first,
                scale,
                window,
                softcap,
                None if sinks is None else self._values(sinks),
                kind or dtypes.float32,
            )
        sink = self._values(sinks).reshape(kv_heads, group, 1, 1) if sinks is not None else None
        # realized on their own, a chunk's products are tensor-core kernels (fused with the softmax's reductions, not)
        scores = (scores if kind is None else scores.contiguous()) * scale
        if softcap is not None:
            scores = (scores / softcap).tanh() * softcap
        if step is None:
            query_pos, key_pos = row.start + np.arange(length)[:, None], np.arange(total)[None, :]
            seen = row.start + length - 1 if row.bidirectional else query_pos
        else:  # the queries at the positions the step's input holds
            query_pos = step.positions[int(offset) : int(offset) + length].reshape(length, 1)
            key_pos = Tensor.arange(total).reshape(1, total)
            seen = query_pos
        masked = key_pos > seen
        if window is not None:
            masked = masked | (key_pos <= query_pos - window)
        scores = (masked if step else self._tensor(masked)).where(-math.inf, scores)
        peak = scores.max(axis=-1, keepdim=True)
        if sink is not None:
            peak = peak.maximum(sink)
        weights = (scores - peak).exp()
        denominator = weights.sum(axis=-1, keepdim=True)
        if sink is not None:
            denominator = denominator + (sink - peak).exp()
        return weights / denominator if kind is None else (weights / denominator).cast(kind).contiguous()

    def _decoding(self, batch: Batch, kv: KVCache, layout: KVLayout) -> bool:
        """Whether a layer's attention for ``batch`` runs as attention.py's kernels: every row one token attending
        causally (no image's row), keys and values both stored (not a latent layout), two positions a slot or more,
        the knob on."""
        if not self.decode_attention or layout.latent or kv.page_size * kv.tables[0].shape[1] < 2:
            return False
        return all(len(row.tokens) == 1 and not row.bidirectional for row in batch.rows)

    def attention(
        self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float, softcap: float | None = None, sinks=None
    ) -> Tensor:
        return self._attend(q, k, v, kv, layer, batch, scale, softcap, sinks)

    def mla_attention(self, q_latent, q_rope, latent, k_rope, kv: KVCache, layer: int, batch: Batch, scale: float):
        q = self._values(q_latent).cat(self._values(q_rope), dim=-1)
        key = self._values(latent).cat(self._values(k_rope), dim=-1).unsqueeze(1)
        n, heads, rank = q_latent.shape
        return self._attend(q, key, None, kv, layer, batch, scale).reshape(n, heads, rank)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        g, u = self._product(gate), self._product(up)
        if g is not None and u is not None and g[1] is u[1] and g[2].qtype == u[2].qtype and g[2].shape == u[2].shape:
            x = self._gemv_x(g[1], g[2].qtype)
            return gemv(x, g[2].data, g[2].qtype, self.gemv_shape, up=u[2].data)  # both products, one kernel
        gate, up = self._values(gate), self._values(up)
        if gate.shape != up.shape or gate.ndim != 2:
            return gate.silu() * up
        return self._keep_layout(gate.silu() * up, lambda tiles: laid_out(gate, tiles, dtypes.float16, up))

    def sigmoid_mul(self, gate: Tensor, x: Tensor) -> Tensor:
        return self._values(gate).sigmoid() * self._values(x)

    def gelu_mul(self, gate: Tensor, up: Tensor | None = None) -> Tensor:
        g = self._values(gate)
        inner = math.sqrt(2 / math.pi) * (g + 0.044715 * g * g * g)
        gelu = 0.5 * g * (1 + inner.tanh())
        return gelu * self._values(up) if up is not None else gelu

    def softcap(self, x: Tensor, cap: float) -> Tensor:
        return (self._values(x) / cap).tanh() * cap

    def scale(self, x: Tensor, factor: float) -> Tensor:
        return self._values(x) * factor

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        # The residual stream is realized at each add: a lazy tensor is recomputed by every later
        # realize that needs it (the KV writes realize once per layer), which would make depth quadratic.
        for product, other in ((b, a), (a, b)):
            made = self._product(product)
            if made is not None and isinstance(other, Tensor) and other.shape == product.shape:
                _, x, weight = made
                x = self._gemv_x(x, weight.qtype)
                return gemv(x, weight.data, weight.qtype, self.gemv_shape, residual=self._values(other)).realize()
        return (self._values(a) + self._values(b)).realize()

    def _roped(self, q: Tensor, k: Tensor, v: Tensor | None) -> tuple[Tensor, Tensor, RopeSpec, Tensor, Tensor] | None:
        """(q and k before RoPE, the spec, cos, sin) where ``q`` and ``k`` are rotations by ``rope`` with one spec and
        the same positions (the same objects) and ``v`` has k's shape, for attention.py's ``rope_write``; else None."""
        made = [self._ropes.get(id(t)) for t in (q, k)]
        if v is None or any(m is None or m[0] is not t for m, t in zip(made, (q, k))):
            return None
        (_, q_in, spec, at, cos, sin), (_, k_in, k_spec, k_at, _, _) = made
        if k_spec is not spec or k_at is not at or v.shape != k_in.shape or q_in.shape[2] != k_in.shape[2]:
            return None
        if spec.dims % 2 or (q_in.shape[2] - spec.dims) % 2 or q_in.shape[1] % k_in.shape[1]:  # rope_write's pairs
            return None
        return q_in, k_in, spec, cos, sin

    def _rope_products(self, q_in, k_in, v, spec: RopeSpec, cos, sin, storage, table, positions, page_size: int):
        """q rotated by qkv.py's one kernel (q's and k's products, v's where it is alike, RoPE and both cache writes),
        where q and k are few-row products not yet run of one x and one weight type, the rotation is in pairs
        (2i, 2i + 1) and the device has thread groups; else None (the products, then rope_write)."""
        if spec.neox or not Device[self.device].renderer.has_local:
            return None
        made = [self._viewed_product(t) for t in (q_in, k_in, v)]
        if made[0] is None:
            return None
        if not _alike(made[1], made[0]):
            return None
        _, x, weight = made[0]
        together = made if _alike(made[2], made[0]) else made[:2]
        sizes = tuple(entry[2].data.shape[0] for entry in together)
        shape = qkv.fitted(self.gemv_shape or Shape.for_product(sum(sizes), qtype=weight.qtype), sizes, local=True)
        if shape is None:
            return None
        for entry in together:
            self._products.pop(id(entry[0]), None)
        apart = None if len(together) == 3 else v
        words = [entry[2].data for entry in together]
        return qkv.rope_write_products(
            self._gemv_x(x, weight.qtype),
            words,
            weight.qtype,
            shape,
            apart,
            cos,
            sin,
            *storage,
            table,
            positions,
            page_size,
            spec.dims,
        )

    def _gemv_x(self, x: Tensor, qtype: Q) -> Any:
        """x for a few-row product of a ``qtype`` weight: with ``int_products`` and a weight of ``int_types`` (Q4_K,
        Q6_K), x quantized to 16-bit integers (by the norm kernel that made x, else intx.quantize unless
        ``int_products_normed_only``; once an x, shared by its products: q, k and v, gate and up); else x."""
        if not self.int_products or qtype not in self.int_types or x.shape[-1] % intx.RUN:
            return x
        made = self._quantized.get(id(x))
        if made is None or made[0] is not x:
            return x if self.int_products_normed_only else self._remember_quantized(x, intx.quantize(x))
        return made[1]

    def _remember_quantized(self, x: Tensor, quantized: intx.Quantized) -> intx.Quantized:
        """``quantized`` as x's 16-bit integers for its products (_gemv_x), the latest PRODUCTS_KEPT kept."""
        self._quantized[id(x)] = (x, quantized)
        while len(self._quantized) > PRODUCTS_KEPT:
            del self._quantized[next(iter(self._quantized))]
        return quantized

    def _together(self, *made: Tensor) -> list[Tensor]:
        """``made`` (views of few-row products not yet run, such as a layer's q, k and v), those of them that are
        products of one x with one weight type and row length made by one kernel (gemv.py's ``gemv_segments``: the
        first with the next ones of its kind); the others as they are."""
        entries = [self._viewed_product(t) for t in made]
        first = entries[0]
        if first is None:
            return list(made)
        _, x, weight = first
        alike = [i for i, e in enumerate(entries) if _alike(e, first)]
        if len(alike) < 2:
            return list(made)
        words = [entries[i][2].data for i in alike]
        outs = gemv_segments(self._gemv_x(x, weight.qtype), words, weight.qtype, self.gemv_shape)
        together = list(made)
        for i, out in zip(alike, outs):
            together[i] = out.reshape(made[i].shape)
            self._products.pop(id(entries[i][0]), None)
        return together

    def _viewed_product(self, t: Tensor) -> tuple[Tensor, Tensor, Weight] | None:
        """The few-row product not yet consumed of which ``t`` is a reshape (or itself), if any."""
        u = unreshaped(t)
        return next((e for e in self._products.values() if e[0].uop is u or e[0] is t), None)

    def _product(self, y: Any) -> tuple[Tensor, Tensor, Weight] | None:
        """(y, x, weight) where ``y`` is a few-row product (gemv.py's kernel, no bias) not yet consumed: its consumer
        makes it again with itself in the kernel (y, never realized, never runs)."""
        made = self._products.pop(id(y), None) if isinstance(y, Tensor) else None
        return made if made is not None and made[0] is y else None

    def reshape(self, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return self._values(x).reshape(shape)

    def take_rows(self, x: Tensor, index: np.ndarray) -> Tensor:
        step = self._step
        if step is not None and step.last is not None and index is step.batch.logit_index:
            if step.batch.rows[0].all_logits:
                return self._values(x)  # every row; run() keeps the real ones
            return self._values(x)[step.last]  # the last real token's row, an input of the padded step
        x, index = self._values(x), np.asarray(index)
        if len(index) and np.array_equal(index, np.arange(index[0], index[0] + len(index))):
            return x[int(index[0]) : int(index[0]) + len(index)]
        return x[self._tensor(index.astype(np.int32))]

    def head_matmul(self, x: Tensor, weight: Any) -> Tensor:
        return (self._values(x).permute(1, 0, 2) @ self._values(weight).permute(0, 2, 1)).permute(1, 0, 2)

    def _expert(self, w: Any, e: int) -> Tensor:
        return w.values(e) if isinstance(w, Weight) else self._values(w)[e]

    def moe(self, x: Tensor, weights: MoEWeights, spec: MoESpec) -> Tensor:
        # Routing runs on the host (leat.moe.route, the reference): one small [n, experts] transfer per layer.
        if self._step is not None:
            raise _NotJittable("MoE routing reads the router's logits on the host")
        x = self._values(x)
        logits = self.matmul(x, weights.router, weights.router_bias).numpy()
        selection_bias = weights.selection_bias
        if selection_bias is not None and not isinstance(selection_bias, np.ndarray):
            selection_bias = self._values(selection_bias).numpy()
        ids, gains = route(logits, spec, selection_bias)
        n = x.shape[0]
        out = None
        for expert in (int(e) for e in np.unique(ids)):
            rows, slot = np.nonzero(ids == expert)
            h = x[self._tensor(rows.astype(np.int32))]
            gate = h @ self._expert(weights.gate, expert).T
            up = h @ self._expert(weights.up, expert).T
            if weights.gate_bias is not None:
                gate = gate + self._expert(weights.gate_bias, expert)
            if weights.up_bias is not None:
                up = up + self._expert(weights.up_bias, expert)
            if spec.activation == "silu":
                act = gate.silu() * up
            else:  # gpt-oss's clamped SwiGLU
                g, u = gate.minimum(spec.limit), up.clip(-spec.limit, spec.limit)
                act = g * (g * spec.alpha).sigmoid() * (u + 1)
            y = act @ self._expert(weights.down, expert).T
            if weights.down_bias is not None:
                y = y + self._expert(weights.down_bias, expert)
            # scatter back: a [n, rows] matrix holding each row's gain where it belongs
            place = np.zeros((n, len(rows)), np.float32)
            place[rows, np.arange(len(rows))] = gains[rows, slot]
            contribution = self._tensor(place) @ y
            out = contribution if out is None else out + contribution
        return out.realize()
