"""The CUDA backend: GGUF blocks on the device, NVRTC-compiled kernels, decode steps replayed as
CUDA graphs.

Activations are float32 :class:`~leat_backend_cuda.driver.DeviceArray` s. Weights stay in their
GGUF form (see ``quants.py``); matrices of types without kernels are dequantized to float32 on the
host at upload. Products of quantized weights by 1-2 tokens use the integer matrix-vector kernel
(gemv_q: x as int16, fused with the norm before and the gated unit or residual after); 3-32 tokens
gemm_few (tensor cores, each weight read once; ``quants.gemm_few_shape``); more the tensor-core GEMM,
and cuBLAS where installed from ``CUBLAS_MIN_TOKENS`` (from ``CUBLAS_MIN_TOKENS_F16`` for a matrix with an f16
copy, gemm_few's range included), f16 products with float32 accumulation throughout.
Float weights take the float32 matrix-vector kernel up to 8 tokens. ``tensor_cores=False`` keeps
every product in float32. Every op is asynchronous on one stream; only :meth:`to_host` waits.

Graphs: :meth:`run` captures one forward per (forward, KV cache, token bucket, logits bucket) the
first time a batch of that shape comes, with the batch's host arrays bound to static device
buffers, and replays it afterwards: a step then costs one small upload and one launch.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from leat.backend import Backend, KVPages, RopeSpec
from leat.batch import Batch, Row
from leat.errors import LeatError, UnsupportedQuantType
from leat.modelfile import Tensor

from leat_backend_cuda import compiler, cublas, driver, quants
from leat_backend_cuda.deltanet import RecurrentOps
from leat_backend_cuda.driver import DeviceArray, Memory
from leat_backend_cuda.mla import LatentAttentionOps
from leat_backend_cuda.moe import ExpertOps
from leat_backend_cuda.vision import VisionOps
from leat_backend_cuda.wgmma import WG_BLOCKS_PER_SM, WarpgroupProducts, wg_tokens

Q = gguf.GGMLQuantizationType
F32, I32, U16 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint16)
log = logging.getLogger("leat.cuda")
OPS_KERNELS = (
    [
        "rms_norm",
        "rope",
        "rope_norm",
        "attention_combine",
        "silu_mul",
        "add",
        "scale",
        "softcap",
        "gelu_mul",
        "take_rows",
        "x_to_f16",
        "rms_norm_f16",
        "matmul_f32_naive",
        "splitk_sum",
        "scale_rows_bias",
        "scale_split",
        "scale_silu_mul",
        "scale_add",
        "split_plane",
        "gather_ints",
        "flash_tiles",
        "argmax_rows",
        "top_k_rows",
        "kv_write<float>",
        "kv_write<u16>",
        "kv_write<i8>",
    ]
    + [f"rope_kv_write<{kv}, {norm}>" for kv in ("float", "u16", "i8") for norm in ("false", "true")]
    + [
        f"{k}<{kv}, {dl}, 4>"
        for k in ("attention", "attention_wide")
        for kv in ("float", "u16", "i8")
        for dl in (1, 2, 4, 8)
    ]
)
FLASH_DIMS = (64, 128)  # head dimensions of the tensor-core prefill attention
FLASH_KINDS = ("u16", "i8")  # the caches it reads: f16, q8_0 (decoded into its f16 tiles)
FLASH_KERNELS = [
    f"{k}<{kind}, {d}>" for k in ("flash_attention", "attention_tc") for kind in FLASH_KINDS for d in FLASH_DIMS
]
ROPE_KV_MAX_DIM = 512  # head dimensions rope_kv_write holds (a k head in shared memory)
GROUP_HEADS = 4  # query heads per attention block (the GB template argument)
#: positions of a decode step's attention split are a multiple of this (a block's 4 warps take 32 per step): at short
#: contexts more splits, so more blocks (H200, device time of 128 one-token steps, 32 against 64: the 12-layer
#: qwen3moe file 1,227 against 1,190 tok/s; the 8B file 371.7 against 362.9, at depth 512 351.8 against 347.8). The
#: decode kernel cuts each token's own range by it (H100, the 8B file in a cache of 8,192 positions, a step at
#: position 128: 2.874 ms against 3.239 when a graph's split, sized for the whole cache, left it to one split)
ATTENTION_SPLIT_KEYS = 32
#: decode attention on tensor cores (flash.cu's attention_tc) takes a split's keys in multiples of this: a run of 16
#: for each of its 4 warps
ATTENTION_TC_KEYS = 64
#: attention_tc is the decode kernel for 64- and 128-dim heads over an f16 or q8_0 cache where a KV head has at least
#: this many query heads (its mma rows; 4 is the fewest timed: H100, the 8B file's tg128 at depth 4096 303.0 and 298.8
#: against 287.1 and 278.1 tok/s, at depth 0 335.6 and 344.2 against 336.8 and 331.2; fifty-first session).
#: LEAT_CUDA_ATTENTION_TC=0: never, =1: at any group size
ATTENTION_TC_MIN_GROUP = 4
#: most splits attention_combine merges (its shared memory, COMBINE_MAX_SPLITS in ops.cu), and its threads a block
COMBINE_MAX_SPLITS, COMBINE_THREADS = 1024, 128
# KV storage: (the kernels' KV type, the element). q8_0 keeps GGUF's Q8_0 blocks (an f16 scale and 32 int8
# along the head dimension) split into two allocations per layer and kind: the quants laid out as a float
# cache would be, and the scales [pages, page_size, kv_heads, dim / 32]. A 34-byte block would leave rows
# at 2-byte alignment; split, each row's quants start at a multiple of 32 bytes (8-byte loads of 8 quants,
# as the f16 cache's 16-byte loads), and a page is still one contiguous range of each allocation, so
# copy_page and read/write_pages copy pages as they do for f32 and f16.
KV_DTYPES = {"f32": ("float", F32), "f16": ("u16", U16), "q8_0": ("i8", np.dtype(np.int8))}
TOP_K_MAX = 64  # top_k on the device: at most this many per row
# Token counts a graph is captured for: decode and speculative steps up to 64, then steps that carry prefill
# chunks beside their decode rows. Up to TILED_GRAPH_TOKENS a graph attends token by token (each token a row of
# its own); past it, as the eager path does: tile-wise on tensor cores (flash.cu, its tiles made on the device by
# ops.cu's flash_tiles). A 512-token step of the 8B bench file takes ~17 ms on an H200 and ~20 ms of the eager
# path's host time on the H200's host (twenty-sixth session, scripts/prefill_host.py), where the device used to
# take ~30 ms and the host ~10 (pp512 9,005-9,457 then): the eager step waited for the host. Through these graphs
# pp512 gained 20% against the eager step in one call (twenty-seventh session).
TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
LOGIT_BUCKETS = TOKEN_BUCKETS[: TOKEN_BUCKETS.index(64) + 1]
TILED_GRAPH_TOKENS = 256
#: the share of the device's memory that must be free for a new graph of a prompt's chunk (over LOGIT_BUCKETS[-1]
#: tokens) to be captured: a graph's private pool stays reserved while the graph lives (the 8B file's 512-token step
#: ~0.9 GiB, once per logits bucket a step shape meets); short of it such steps run eagerly, so that graphs do not
#: take what eager steps need. Decode and speculative steps' graphs (their pools are small, and without them a step
#: waits on the host) are captured regardless
GRAPH_FREE_SHARE = 0.1
# A prefill chunk in a graph attends token by token (no flash tiles): sum over chunks of tokens x last position
# up to which that costs less than the eager path's Python (a 128-token chunk from position 1920)
#: products of at least this many tokens go to cuBLAS where it is installed (cublas.py); fewer to the
#: own kernels, which read each quantized weight once instead of decoding it to f16 first (on an H200 the
#: two tie at 128 tokens a step and cuBLAS leads from 192)
CUBLAS_MIN_TOKENS = 160
#: the same for a weight decoded to f16 once, at load (``Matrix.f16``): cuBLAS then reads the copy and decodes
#: nothing. With its epilogue in the consumer's kernel and q, k and v as one product (``_launch_cublas``) it leads
#: from 12 tokens (the 8B file on an H200, graph-replayed decode steps, scripts/prefill_paths.py's way, seventeenth
#: session: 12 rows 5.75 ms against gemm_few's 6.37, 16 rows 5.80 against 6.51, 8 rows 5.61 against 5.13); graphs
#: are captured for 8 and 12 tokens, none between, so 9-11 go as 12 do
CUBLAS_MIN_TOKENS_F16 = 9
#: products of this many tokens or more go to gemm_few (up to quants.GEMM_FEW_MAX_TOKENS, where gemm_few_shape says)
GEMM_FEW_MIN_TOKENS = 3
#: products of this many tokens up to GEMM_ROWS_MAX_TOKENS go to gemm_rows (x shared in shared memory by a block's
#: warps, weights decoded straight into fragments) instead of the GEMM, where cuBLAS does not take them (a weight
#: without an f16 copy, or no cuBLAS)
GEMM_ROWS_MIN_TOKENS = 33
GEMM_ROWS_MAX_TOKENS = 128
#: blocks per multiprocessor gemm_rows's split over K aims at (H200, the 8B file's products at 33-128 tokens: gate
#: and up best split in 2, q, o and down in 8, the output matrix not at all: about two blocks per SM)
GEMM_ROWS_BLOCKS_PER_SM = 2
#: threads of argmax_rows's block (one per row): a decode step's argmax is on the engine's critical path between two
#: graphs: 256 threads reading a 128k vocabulary one float each at a time (8 warps, a load or two in flight each)
#: may take ~0.1 ms (an estimate), where the H200's step logs show decode steps 0.18 ms apart beyond their graphs at
#: 1 and 64 rows (ninth session, calls 3-4: docs/changelog.md)
ARGMAX_THREADS = 1024
#: argmax_async answers that may be in flight at once (the engine reads a step's after queueing the next)
READBACKS = 4
#: f16 weight rows decoded per cuBLAS product: large enough that a layer's matrices go whole (few, large
#: products beat chunks small enough to stay in L2; docs/benchmarks.md has the measurement)
CUBLAS_SCRATCH_BYTES = 128 << 20
#: f16 weight copies are cut from slabs of this size in load order, so that matrices loaded one after the other (a
#: layer's q, k and v) lie one after the other and cuBLAS multiplies them as one matrix (``_cublas_gemms``; the 8B
#: file's q, k and v at 64 tokens on an H200: 14.8 us as one product against 25.1 as three); a slab's unused end is
#: the cost (the 8B file: ~1 GB of 15)
F16_SLAB_BYTES = 1 << 30
#: the share of the device's memory that weights decoded to f16 once, at load, may take (see ``f16_budget``),
#: for a file of at most F16_WEIGHTS_FILE_SHARE of it (its copies take up to ~4x its size)
F16_WEIGHTS_SHARE = 0.25
F16_WEIGHTS_FILE_SHARE = F16_WEIGHTS_SHARE / 4
FLAT_ATTENTION_BUDGET = 128 * 2048
FLASH_TILES_THREADS = 1024  # ops.cu's flash_tiles: one block, a thread a token (TOKEN_BUCKETS[-1] at most)


def gemv_split() -> bool:
    """LEAT_CUDA_GEMV_SPLIT: 1 or unset (the default: tg128 +1.9% and +2.5% on the 8B bench file, H100, fifty-third
    session) lets the shape rule split the one-token products it names over K inside a block (quants.GEMV_Q_SPLIT,
    gemv_q_shape); 0 leaves every product whole."""
    setting = os.environ.get("LEAT_CUDA_GEMV_SPLIT", "").strip() or "1"
    if setting not in ("0", "1"):
        raise LeatError(f"LEAT_CUDA_GEMV_SPLIT={setting}: 0 (off) or 1 (the small one-token products split over K)")
    return setting == "1"


def runs_ahead() -> int:
    """LEAT_CUDA_RUNS_AHEAD=N (1-8): the runs of x a thread of gemv_q loads before it rounds them in the block's
    prologue (runs.cuh's quantize_runs, compiled with -DLEAT_RUNS_AHEAD=N; half as many with the norm inside, which
    loads the norm's weights too): one trip to L2 for N runs. 1 or unset (the default: 4 measured level on an H100,
    tg128 +0.6% and +0.2%, fifty-third session, and more cost registers) rounds each run once its own loads are back."""
    setting = os.environ.get("LEAT_CUDA_RUNS_AHEAD", "").strip() or "1"
    if not setting.isdigit() or not 1 <= int(setting) <= 8:
        raise LeatError(f"LEAT_CUDA_RUNS_AHEAD={setting}: the runs of x a thread loads at once, 1 (the default) to 8")
    return int(setting)


def _host_dequantizable() -> frozenset[Q]:
    """Types gguf-py can dequantize: the host fallback covers them."""
    out = set()
    for qtype in Q:
        _, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
        except (NotImplementedError, ValueError, KeyError):
            continue
        out.add(qtype)
    return frozenset(out)


@dataclass
class F16Copy:
    """A weight's f16 copy: ``nbytes`` at ``ptr``, a piece of ``slab`` (see ``F16_SLAB_BYTES``)."""

    slab: Memory
    ptr: int
    nbytes: int


@dataclass
class Matrix:
    """A weight matrix on the device: [rows, cols] of ``qtype`` in the layout of quants.py."""

    name: str
    qtype: Q
    shape: tuple[int, ...]
    rows: int
    cols: int
    blocks: int
    memory: Memory
    kernels: driver.Module | None  # None: float32 rows not a multiple of 8 (the naive kernel)
    f16: F16Copy | None = None  # the weight decoded to f16 rows once, for cuBLAS's products (see f16_budget)

    @property
    def ptr(self) -> int:
        return self.memory.ptr


@dataclass
class KVCache(KVPages):
    k: list[Memory] = field(default_factory=list)
    v: list[Memory] = field(default_factory=list)
    dtype: str = "f32"
    k_scale: list[Memory] = field(default_factory=list)  # q8_0: per layer, the f16 scale planes (see KV_DTYPES)
    v_scale: list[Memory] = field(default_factory=list)
    device_tables: list[Memory] = field(default_factory=list)  # per group: the device copy of tables[g]
    recurrent: dict[int, Any] = field(default_factory=dict)  # per recurrent layer: its deltanet.Recurrent
    dirty: bool = True


@dataclass
class _Ids:
    """argmax_async's answer: the ids on the device (what ``run``'s ``fed`` reads) and, once ``event`` has
    passed, in the pinned ``landing`` buffer."""

    device: DeviceArray
    landing: driver.Pinned
    event: driver.Event

    def result(self) -> np.ndarray:
        self.event.wait()
        return self.landing.array[: self.device.nbytes].view(np.int32).astype(np.int64)


def _mapped_size(array: Any) -> int | None:
    """The size of the mapped file an array views (a GGUF's tensors are views of its mmap), or None."""
    while array is not None and not isinstance(array, mmap.mmap):
        array = getattr(array, "base", None)
    return len(array) if array is not None else None


def _with_tokens(batch: Batch, fed: Any) -> Batch:
    """``batch`` with its tokens taken from ``fed`` (see ``run``) on the host: the eager path's way."""
    if fed is None:
        return batch
    ids, index = fed
    tokens = ids.result()[np.asarray(index)]
    return Batch([Row(r.slot, r.start, tokens[i : i + 1], r.all_logits) for i, r in enumerate(batch.rows)])


@dataclass
class RopeWrite:
    """What gemv_q's ROPE epilogue takes (kernels/matmul.cu): each segment's role in ``roles`` (2 bits a segment:
    0 out, 1 q rotated out, 2 k rotated into the K cache, 3 v into the V cache) and the kernel arguments after it."""

    roles: int
    rest: tuple

    @property
    def arguments(self) -> tuple:
        return (self.roles, *self.rest)


@dataclass
class _Captured:
    graph: driver.Graph
    pool: driver.Pool
    inputs: DeviceArray  # int32 [3 x tokens + logits]: tokens, positions, token slots, then logit rows
    logits: DeviceArray


class Pending(DeviceArray):
    """An op whose launch waits for its consumer, so that the two can run as one kernel: an RMS norm
    applied by the matrix-vector product that reads it, a product fused into the residual add or the
    gated unit that consumes it. ``fusion`` says what it is; any other use (its ``ptr``) launches it."""

    __slots__ = ("_launch", "_real", "fused", "fusion")

    def __init__(self, shape: tuple[int, ...], launch: Callable[[], DeviceArray], fusion: tuple):
        self.shape, self.dtype = tuple(shape), F32
        self._launch, self._real, self.fusion = launch, None, fusion
        self.fused = False  # consumed by a fused kernel: launch it only if something else asks

    def materialize(self) -> DeviceArray:
        if self._real is None:
            self._real = self._launch()
            self._launch = None
        return self._real

    @property
    def ptr(self) -> int:  # type: ignore[override]
        return self.materialize().ptr

    @property
    def owner(self) -> Any:  # type: ignore[override]
        return self.materialize().owner

    def waiting(self, kind: str) -> bool:
        return self._real is None and self.fusion[0] == kind

    def view(self, shape, offset_items: int = 0) -> DeviceArray:
        if self._real is not None or offset_items:
            return self.materialize().view(shape, offset_items)
        return Pending(shape, lambda: self.materialize().view(shape), ("view", self))  # stays pending


def _ready(x: Any) -> Any:
    return x.materialize() if isinstance(x, Pending) else x


def _normed(x: Pending) -> tuple:
    """A pending RMS norm taken in by the kernel that reads it: (its input, weight, eps) as kernel arguments."""
    _, source, weight, eps = x.fusion
    x.fused = True
    return _ready(source), weight, float(eps)


def _rope_pair(q: Any, k: Any) -> bool:
    """Whether q and k are both still to be rotated by the same RoPE, and both from a per-head norm or neither (so
    that one rope_kv_write launch rotates both)."""
    if not (isinstance(q, Pending) and isinstance(k, Pending) and q.waiting("rope") and k.waiting("rope")):
        return False
    (_, qx, q_positions, q_spec), (_, kx, k_positions, k_spec) = q.fusion, k.fusion
    same = q_positions is k_positions and q_spec is k_spec and q.shape[2] == k.shape[2] <= ROPE_KV_MAX_DIM
    return same and _is_norm(qx) == _is_norm(kx)


def _waiting_product(x: Any) -> Pending | None:
    """The gemv_q product still waiting behind ``x`` (itself or through a pending view), or None."""
    if isinstance(x, Pending) and x.waiting("view"):
        x = x.fusion[1]
    return x if isinstance(x, Pending) and x.waiting("matmul") and not x.fused else None


def _is_norm(x: Any) -> bool:
    return isinstance(x, Pending) and x.waiting("norm")


class CUDABackend(VisionOps, ExpertOps, LatentAttentionOps, RecurrentOps, WarpgroupProducts, Backend):
    name = "cuda"
    asynchronous = True
    feeds_tokens = True
    bidirectional = True
    recurrent_state = True  # Qwen3.5's linear layers: deltanet.py
    prefill_tokens_per_step = 2048
    # cuBLAS loads the kernels of a product size class the first time it meets one (an H200's first 2,048-token step of
    # the 8B file took 106 ms, the next 59): a step past the graphs' sizes (eager, cuBLAS's smaller class), one of
    # half the prefill budget and one of all of it
    warm_up_steps = (TOKEN_BUCKETS[-1] + 16, 1024, prefill_tokens_per_step)
    quant_types = frozenset(quants.LAYOUTS) | _host_dequantizable()

    @classmethod
    def probe(cls) -> str | None:
        return driver.probe()

    def __init__(
        self,
        precision: str = "f32",
        device: int = 0,
        graphs: bool = True,
        tensor_cores: bool = True,
        fuse: bool = True,
        poison: bool = False,
        use_cublas: bool = True,
        **options: Any,
    ):
        if precision != "f32":
            raise ValueError(f"the cuda backend keeps activations in f32 (precision 'f32'), not {precision!r}")
        super().__init__(precision, **options)
        self.device = driver.Device(device)
        self.graphs = graphs
        self.tensor_cores = tensor_cores
        self.fuse = fuse
        self.pool = driver.Pool(self.device, self._grew, poison)
        self._pool = self.pool  # where new activations come from (a graph's own pool while capturing)
        self._modules: dict[str, driver.Module] = {}
        self._inputs: OrderedDict[int, tuple[Any, DeviceArray]] = OrderedDict()
        self._tokens_meta: OrderedDict[int, tuple[Batch, DeviceArray, DeviceArray, int]] = OrderedDict()
        self._rope: dict[int, tuple[RopeSpec, DeviceArray]] = {}
        self._by_input: OrderedDict[int, tuple[DeviceArray, list[Pending]]] = OrderedDict()
        self._tiles: OrderedDict[tuple[int, int], tuple[Batch, DeviceArray]] = OrderedDict()
        self._halves: OrderedDict[int, tuple[DeviceArray, DeviceArray, DeviceArray]] = OrderedDict()
        self._captured: dict[tuple, _Captured] = {}
        self.flat_attention_budget = FLAT_ATTENTION_BUDGET
        self._uncapturable: set[tuple] = set()  # graph keys whose capture failed: those shapes run eagerly
        self._capturing = False
        self._tiled_batch: Batch | None = None  # a graph's batch being captured with tile-wise attention
        self.graph_failures: list[str] = []
        self.ops = self._module("ops", "ops.cu", OPS_KERNELS, {})
        # where argmax_async's ids land on the host: a ring, as a step's ids are read after the next is queued
        self._landing = [(driver.Pinned(4096), driver.Event(self.device)) for _ in range(READBACKS)]
        self._readbacks = 0
        # products of at least cublas_min_tokens tokens: weights decoded to f16 rows in `_f16_weights`
        # (a chunk of rows at a time), multiplied by cuBLAS (cublas.py); None: the own GEMM
        self.cublas = cublas.open_handle(self.device) if use_cublas and tensor_cores else None
        self.cublas_min_tokens = CUBLAS_MIN_TOKENS
        self.cublas_min_tokens_f16 = CUBLAS_MIN_TOKENS_F16
        #: token counts (first, last) that go to gemm_few; its instantiation (None: quants.gemm_few_shape's)
        self.few_tokens = (GEMM_FEW_MIN_TOKENS, quants.GEMM_FEW_MAX_TOKENS)
        self.few_shape: tuple[int, int] | None = None
        #: the gated unit's gate and up products in one gemm_few launch (x read once for both, silu applied in it)
        self.few_gated = True
        #: token counts (first, last) that go to gemm_rows, its instantiation (None: NT 8, RT 2) and the blocks its
        #: split over K aims at
        self.rows_tokens = (GEMM_ROWS_MIN_TOKENS, GEMM_ROWS_MAX_TOKENS)
        self.rows_shape: tuple[int, int] | None = None
        self.rows_blocks = GEMM_ROWS_BLOCKS_PER_SM * self.device.sm_count
        #: token counts (first, last) that go to gemm_wg, Hopper's warpgroup products (wgmma.py; (1, 0): none)
        self.wg_tokens = wg_tokens(self.device.arch)
        self.wg_blocks = WG_BLOCKS_PER_SM * self.device.sm_count  # the blocks its split over K aims at
        #: one-token products of few rows split over K inside their blocks (gemv_split: LEAT_CUDA_GEMV_SPLIT)
        self.gemv_split = gemv_split()
        #: runs of x a gemv_q thread loads at once in its prologue (runs_ahead: LEAT_CUDA_RUNS_AHEAD)
        self.runs_ahead = runs_ahead()
        self._wg_orders: OrderedDict[tuple, tuple[DeviceArray, DeviceArray]] = OrderedDict()
        self._f16_weights = Memory(CUBLAS_SCRATCH_BYTES) if self.cublas else None
        #: bytes of f16 weight copies the upload may keep: a prefill product through cuBLAS then multiplies the
        #: kept copy instead of decoding the weight again each step (on the H200 the decoding took 28% of a
        #: 512-token step, scripts/kernel_profile.py). Matrices get copies in load order while they fit; decode
        #: steps still read the quantized weights. 0: none kept (the decode-each-step path, less memory). None:
        #: decided at the first upload, from the size of the file it maps (a small file's copies, or none)
        self.f16_budget: int | None = None if self.cublas else 0
        self._f16_slab: list | None = None  # [the slab f16 copies are cut from now, bytes of it taken]

    def describe(self) -> dict[str, Any]:
        free, total = self.device.free_memory()
        return {
            "backend": self.name,
            "precision": self.precision,
            "device": self.device.name,
            "arch": self.device.arch,
            "driver": self.device.driver_version,
            "nvrtc": ".".join(map(str, compiler.nvrtc_version())),
            "memory_free": free,
            "memory_total": total,
            "graphs": self.graphs,
            "tensor_cores": self.tensor_cores,
            "fuse": self.fuse,
            "cublas": self.cublas.version if self.cublas else f"not used ({cublas.missing() or 'off'})",
        }

    def kv_budget_bytes(self) -> int:
        free, _ = self.device.free_memory()
        return int(free * 0.8)

    def timer(self) -> driver.Timer:
        self.device.activate()
        return driver.Timer(self.device)

    # -- kernels -------------------------------------------------------------------------------------
    def _module(
        self,
        key: str,
        file: str,
        names: list[str],
        smem: dict[str, int],
        arch: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> driver.Module:
        module = self._modules.get(key)
        if module is None:
            built = compiler.compile_program(file, names, arch or self.device.arch, extra)
            module = self._modules[key] = driver.Module(self.device, built.cubin, built.names, built.params, smem)
        return module

    def _type_kernels(self, qtype: Q) -> driver.Module:
        names = quants.kernel_names(qtype, split=self.gemv_split)
        smem = {quants.gemm_name(qtype, kt): size for kt, size in quants.GEMM_SMEM.items()}
        smem |= {name: quants.GEMV_Q_MAX_SMEM for name in names if name.startswith("gemv_q")}
        smem |= {
            quants.gemm_few_name(qtype, v, glu): quants.gemm_few_smem(v, glu)
            for v in quants.GEMM_FEW_VARIANTS
            for glu in (False, True)
        }
        ahead = (f"-DLEAT_RUNS_AHEAD={self.runs_ahead}",) if self.runs_ahead > 1 else ()
        return self._module(qtype.name, "matmul.cu", names, smem, extra=ahead)

    # -- memory -------------------------------------------------------------------------------------
    def _grew(self, nbytes: int) -> None:
        self.allocations.scratch += nbytes

    def _pending(self, shape: tuple[int, ...], launch: Callable[[], DeviceArray], fusion: tuple) -> DeviceArray:
        """An op that waits for its consumer (:class:`Pending`), for the mixins that cannot name the class."""
        return Pending(shape, launch, fusion)

    def _empty(self, shape: tuple[int, ...], dtype: np.dtype = F32) -> DeviceArray:
        self.device.activate()
        nbytes = math.prod(shape) * dtype.itemsize
        block = self._pool.take(nbytes)
        return DeviceArray(block.ptr, shape, dtype, block)

    def _count(self, kind: str, nbytes: int) -> None:
        self.allocations.weights += nbytes
        self.allocations.by_type[kind] = self.allocations.by_type.get(kind, 0) + nbytes

    def upload(self, tensor: Tensor) -> Matrix | DeviceArray:
        self.device.activate()
        shape = tuple(int(s) for s in tensor.shape)
        qtype = tensor.qtype
        if qtype not in self.quant_types:
            raise UnsupportedQuantType(
                f"tensor {tensor.name} is {qtype.name}, which the cuda backend cannot use (no kernel, and gguf "
                "cannot dequantize it)"
            )
        if len(shape) == 1 or qtype not in quants.LAYOUTS:
            values = gguf.quants.dequantize(np.asarray(tensor.data), qtype).astype(np.float32).reshape(shape)
            if len(shape) == 1:
                array = self._permanent(values, tensor.qtype.name)
                return array
            qtype, data = Q.F32, values
        else:
            data = np.asarray(tensor.data)
        rows, cols = int(np.prod(shape[:-1])), shape[-1]
        layout = quants.LAYOUTS[qtype]
        if cols % layout.block:  # float32 rows that the 8-wide kernels cannot step through
            host = np.ascontiguousarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(-1)
            qtype, kernels = Q.F32, None
        else:
            host, kernels = np.ascontiguousarray(data).view(np.uint8).reshape(-1), self._type_kernels(qtype)
        if kernels and quants.LAYOUTS[qtype].planes:
            memory = self._upload_planes(qtype, host)
        else:
            memory = Memory(host.nbytes)
            self.device.upload(memory.ptr, host)
            self.device.synchronize()  # the host copy may be a temporary (a dequantized tensor)
        self._count(tensor.qtype.name, memory.nbytes)
        blocks = quants.blocks_of(qtype, rows, cols) if kernels else 0
        matrix = Matrix(tensor.name, qtype, shape, rows, cols, blocks, memory, kernels)
        if self.f16_budget is None:
            total, file = self.device.free_memory()[1], _mapped_size(tensor.data)
            self.f16_budget = int(F16_WEIGHTS_SHARE * total) if file and file <= F16_WEIGHTS_FILE_SHARE * total else 0
        if kernels and len(shape) == 2 and cols % 8 == 0:
            matrix.f16 = self._f16_copy(2 * rows * cols)
            if matrix.f16 is not None:
                self._decode_f16(matrix, matrix.f16, 0, rows)
                self._count("f16 copies", matrix.f16.nbytes)
        return matrix

    def _f16_copy(self, nbytes: int) -> F16Copy | None:
        """Room for an f16 copy of ``nbytes`` while ``f16_budget`` has it: the rest of the slab the last copy came
        from where it fits (so that matrices loaded one after the other adjoin), else a new slab of F16_SLAB_BYTES
        (or ``nbytes``; at most the budget left)."""
        assert self.f16_budget is not None
        if nbytes > self.f16_budget:
            return None
        slab = self._f16_slab
        if slab is None or slab[1] + nbytes > slab[0].nbytes:
            slab = self._f16_slab = [Memory(min(max(F16_SLAB_BYTES, nbytes), self.f16_budget)), 0]
        self.f16_budget -= nbytes
        copy = F16Copy(slab[0], slab[0].ptr + slab[1], nbytes)
        slab[1] += nbytes
        return copy

    def _decode_f16(self, weight: Matrix, out: Memory | F16Copy, start: int, count: int) -> None:
        """Rows ``start`` to ``start + count`` of ``weight`` decoded to f16 rows at ``out``."""
        layout = quants.LAYOUTS[weight.qtype]
        per_row = weight.cols // layout.block
        units = count * per_row * layout.units
        decode = weight.kernels[f"dequantize_f16<{layout.struct}>"]
        decode((-(-units // 256),), 256, weight.ptr, weight.blocks, out, start * per_row, count * per_row)

    def _upload_planes(self, qtype: Q, raw: np.ndarray) -> Memory:
        """A tensor of a planar layout (quants.device_bytes): the file's bytes uploaded as they are, then split
        into planes on the device (each padded to 16 bytes), rather than repacked by numpy first."""
        planes = quants.LAYOUTS[qtype].planes
        block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
        blocks = raw.size // block_bytes
        padded = [-(-blocks * size // 16) * 16 for size in planes]
        memory = Memory(sum(padded))
        staging = Memory(raw.nbytes)
        self.device.upload(staging.ptr, raw)
        self.device.fill(memory.ptr, 0, memory.nbytes)
        start = offset = 0
        for size, room in zip(planes, padded, strict=True):
            grid = max(1, min(-(-blocks * size // 256), 16 * self.device.sm_count))
            self.ops["split_plane"]((grid,), 256, staging, memory.ptr + start, blocks, block_bytes, offset, size)
            start, offset = start + room, offset + size
        self.device.synchronize()  # before the staging copy (and the caller's mapped bytes) go
        return memory

    def dequantize(self, weight: Matrix) -> DeviceArray:
        """A weight as float32 [rows, cols], decoded on the device (equal to gguf-py's dequantize)."""
        out = self._empty((weight.rows, weight.cols))
        if weight.kernels is None:
            self.device.copy(out.ptr, weight.ptr, out.nbytes)
            return out
        layout = quants.LAYOUTS[weight.qtype]
        units = weight.blocks * layout.units
        weight.kernels[f"dequantize<{layout.struct}>"]((-(-units // 256),), 256, weight.ptr, weight.blocks, out)
        return out

    def _permanent(self, values: np.ndarray, kind: str) -> DeviceArray:
        values = np.ascontiguousarray(values, np.float32)
        memory = Memory(values.nbytes)
        self.device.upload(memory.ptr, values)
        self.device.synchronize()
        self._count(kind, values.nbytes)
        return DeviceArray(memory.ptr, values.shape, F32, memory)

    def allocate_kv(self, layouts, slots, context, pages=None, page_size=16, dtype="f32", groups=None) -> KVCache:
        self.device.activate()
        if dtype not in KV_DTYPES:
            raise LeatError(f"the cuda backend stores KV as {' or '.join(KV_DTYPES)}, not {dtype!r}")
        element = KV_DTYPES[dtype][1]
        if dtype == "q8_0":
            dims = {d for layout in layouts for d in (layout.head_dim, layout.stored_value_dim)}
            if any(d % 32 for d in dims):
                raise LeatError(f"q8_0 KV needs head dimensions that are multiples of 32, not {sorted(dims)}")
        kv = KVCache.create(layouts, slots, context, pages, page_size, groups, dtype=dtype)
        for layer, layout in enumerate(layouts):
            for dim, kind in ((layout.head_dim, "k"), (layout.stored_value_dim, "v")):
                values = kv.layer_pages(layer) * page_size * layout.kv_heads * dim
                planes = [(getattr(kv, kind), values * element.itemsize)]
                if dtype == "q8_0":
                    planes.append((getattr(kv, f"{kind}_scale"), values // 16))  # an f16 scale per 32 values
                for store, nbytes in planes:
                    memory = Memory(nbytes)
                    self.device.fill(memory.ptr, 0, memory.nbytes)
                    store.append(memory)
                    self.allocations.kv += memory.nbytes
        kv.device_tables = [Memory(table.nbytes) for table in kv.tables]
        self._sync_pages(kv)
        return kv

    def set_pages(self, kv: KVCache, slot: int, pages: np.ndarray, group: int = 0) -> None:
        super().set_pages(kv, slot, pages, group)
        kv.dirty = True

    def _sync_pages(self, kv: KVCache) -> None:
        if kv.dirty:
            if self._capturing:
                raise LeatError("page table changed during graph capture")
            for memory, table in zip(kv.device_tables, kv.tables):
                self.device.upload(memory.ptr, np.ascontiguousarray(table, np.int32))
            kv.dirty = False

    def _group_memory(self, kv: KVCache, group: int) -> list[Memory]:
        """K, V (then q8_0's K and V scales) of each of ``group``'s layers: the CPU backend's order."""
        layers = kv.layers_of(group)
        return [kind[layer] for kind in (kv.k, kv.v, kv.k_scale, kv.v_scale) if kind for layer in layers]

    def copy_page(self, kv: KVCache, source: int, target: int, group: int = 0) -> None:
        self.device.activate()
        for memory in self._group_memory(kv, group):
            page = memory.nbytes // kv.pages[group]
            self.device.copy(memory.ptr + target * page, memory.ptr + source * page, page)

    def read_pages(self, kv: KVCache, pages: list[int], group: int = 0) -> list[np.ndarray]:
        """K then V pages of each of ``group``'s layers (then q8_0's scale planes, K then V) as host bytes,
        [len(pages), page bytes] each."""
        self.device.activate()
        out = []
        for memory in self._group_memory(kv, group):
            size = memory.nbytes // kv.pages[group]
            host = np.empty((len(pages), size), np.uint8)
            for i, page in enumerate(pages):
                self.device.download(host[i], memory.ptr + page * size)
            out.append(host)
        return out

    def write_pages(self, kv: KVCache, pages: list[int], contents: list[np.ndarray], group: int = 0) -> None:
        self.device.activate()
        for memory, host in zip(self._group_memory(kv, group), contents, strict=True):
            size = memory.nbytes // kv.pages[group]
            for i, page in enumerate(pages):
                self.device.upload(memory.ptr + page * size, np.ascontiguousarray(host[i]))
        self.device.synchronize()

    def from_host(self, values: np.ndarray) -> DeviceArray:
        """A host array as a float32 activation on the device."""
        host = np.ascontiguousarray(values, np.float32)
        array = self._empty(host.shape)
        self.device.upload(array.ptr, host)
        self.device.synchronize()  # the host copy may be a temporary
        return array

    def to_host(self, x: DeviceArray) -> np.ndarray:
        self.device.activate()
        x = _ready(x)
        out = np.empty(x.shape, x.dtype)
        self.device.download(out, x.ptr)
        return out

    def argmax(self, x: DeviceArray) -> np.ndarray:
        return self.argmax_async(x).result()

    def argmax_async(self, x: DeviceArray) -> _Ids:
        """Each row's argmax into device memory, then copied into a pinned host buffer, an event after it."""
        x = _ready(x)
        cols = x.shape[-1]
        out = self._empty((x.size // cols,), I32)
        self.ops["argmax_rows"]((x.size // cols,), ARGMAX_THREADS, x, out, cols)
        self._readbacks = (self._readbacks + 1) % len(self._landing)
        landing, event = self._landing[self._readbacks]
        if landing.nbytes < out.nbytes:
            landing = driver.Pinned(max(out.nbytes, 2 * landing.nbytes))
            self._landing[self._readbacks] = (landing, event)
        driver.check(driver._cu().cuMemcpyDtoHAsync(landing.ptr, out.ptr, out.nbytes, self.device.stream))
        event.record()
        return _Ids(out, landing, event)

    def top_k(self, x: DeviceArray, k: int) -> tuple[np.ndarray, np.ndarray]:
        x = _ready(x)
        cols = x.shape[-1]
        rows, k = x.size // cols, min(int(k), cols)
        if not 1 <= k <= TOP_K_MAX:
            return super().top_k(x, k)
        values, ids = self._empty((rows, k)), self._empty((rows, k), I32)
        self.ops["top_k_rows"]((rows,), 1024, x, values, ids, cols, k)
        return self.to_host(values), self.to_host(ids).astype(np.int64)

    # -- host inputs ---------------------------------------------------------------------------------
    def _ints(self, values: np.ndarray) -> DeviceArray:
        """``values`` as int32 on the device; the arrays of the batches in flight are uploaded once."""
        hit = self._inputs.get(id(values))
        if hit is not None and hit[0] is values:
            self._inputs.move_to_end(id(values))
            return hit[1]
        if self._capturing:
            raise LeatError("an op asked for a host array that is not a graph input during capture")
        host = np.ascontiguousarray(values, np.int32)
        array = self._empty(host.shape, I32)
        self.device.upload(array.ptr, host)
        self._remember(self._inputs, id(values), (values, array))
        return array

    @staticmethod
    def _remember(cache: OrderedDict, key: int, value: Any, size: int = 32) -> None:
        cache[key] = value
        while len(cache) > size:
            cache.popitem(last=False)

    def _token_rows(self, batch: Batch) -> tuple[DeviceArray, DeviceArray, int]:
        """Per token: its slot and its position, and one more than the highest position."""
        hit = self._tokens_meta.get(id(batch))
        if hit is not None and hit[0] is batch:
            return hit[1], hit[2], hit[3]
        slots = np.repeat([r.slot for r in batch.rows], [len(r.tokens) for r in batch.rows]).astype(np.int32)
        positions = self._ints(batch.positions)
        array = self._empty(slots.shape, I32)
        self.device.upload(array.ptr, slots)
        span = int(batch.positions.max()) + 1
        self._remember(self._tokens_meta, id(batch), (batch, array, positions, span))
        return array, positions, span

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, weight: Matrix | DeviceArray, tokens: np.ndarray) -> DeviceArray:
        self.device.activate()
        ids = self._ints(tokens)
        n = len(tokens)
        if isinstance(weight, DeviceArray):
            raise LeatError("embedding tables must be matrices")
        if weight.kernels is None:
            return self.take_rows(DeviceArray(weight.ptr, (weight.rows, weight.cols), F32, weight.memory), tokens)
        out = self._empty((n, weight.cols))
        layout = quants.LAYOUTS[weight.qtype]
        units = weight.cols // layout.block * layout.units
        weight.kernels[f"embed<{layout.struct}>"](
            (-(-units // 128), n), 128, weight.ptr, weight.blocks, ids, out, weight.cols
        )
        return out

    def matmul(self, x: DeviceArray, weight: Matrix, bias: DeviceArray | None = None) -> DeviceArray:
        k = x.shape[-1]
        if k != weight.cols:
            raise ValueError(f"matmul: x has {k} columns but {weight.name} has {weight.cols}")
        n, m = x.size // k, weight.rows
        if self._fusable(weight, n, k):
            product = Pending(x.shape[:-1] + (m,), lambda: self._launch_products(product), ("matmul", x, weight, bias))
            return self._sibling(x, product)
        # x may still be a pending norm: the products that read x as f16 rows take the norm in (_f16_rows)
        if self._wg_takes(weight, n, k):
            return self._gemm_wg(x, weight, bias, self._empty(x.shape[:-1] + (m,)), n)
        few = self._few_shape(weight, n, k)
        if few is not None and self.fuse and self.few_gated and bias is None:  # silu_mul may take it and its sibling
            shape = x.shape[:-1] + (m,)
            return Pending(
                shape, lambda: self._gemm_few(x, weight, None, self._empty(shape), n, few), ("few", x, weight)
            )
        if few is None and self._deferred_cublas(weight, n, k):
            product = Pending(x.shape[:-1] + (m,), lambda: self._launch_cublas(product), ("cublas", x, weight, bias))
            return self._sibling(x, product)
        out = self._empty(x.shape[:-1] + (m,))
        if weight.kernels is None:
            warps = m * n
            self.ops["matmul_f32_naive"]((-(-warps // 4),), 128, weight.ptr, _ready(x), out, bias, m, n, k)
            return out
        layout = quants.LAYOUTS[weight.qtype]
        if layout.integer and n <= min(quants.GEMV_Q_MAX_TOKENS, self.few_tokens[0] - 1):
            smem = quants.gemv_q_smem(weight.qtype, n, k)
            if smem <= quants.GEMV_Q_MAX_SMEM:
                x = x if n <= quants.GEMV_Q_FUSED_TOKENS else _ready(x)  # norm fusion: 1-2 tokens
                return self._gemv_q(x, [(weight, bias)], out=out)[0]
        if few is not None:
            return self._gemm_few(x, weight, bias, out, n, few)
        if self.cublas is not None and k % 8 == 0 and n >= self._cublas_from(weight):
            self._cublas_product(x, weight, bias, out, n, m, k)
            return out
        if self.tensor_cores and self.rows_tokens[0] <= n <= self.rows_tokens[1] and k % quants.GEMM_ROWS_KC == 0:
            return self._gemm_rows(x, weight, bias, out, n)
        if (n > quants.GEMV_MAX_TOKENS or layout.integer) and self.tensor_cores:
            kt = 256 if k % 256 == 0 else 32
            if kt == 256 or (layout.small_block and k % 32 == 0):  # else the float kernel
                self._gemm(x, weight, bias, out, n, m, k, kt)
                return out
        x = _ready(x)
        for start in range(0, n, quants.GEMV_MAX_TOKENS):
            c = min(quants.GEMV_MAX_TOKENS, n - start)
            rows, _ = quants.GEMV_SHAPES[c]
            weight.kernels[quants.gemv_name(weight.qtype, c)](
                (-(-m // (4 * rows)),),
                128,
                weight.ptr,
                weight.blocks,
                x.ptr + start * k * 4,
                out.ptr + start * m * 4,
                bias,
                m,
                k,
            )
        return out

    def _cublas_from(self, weight: Matrix) -> int:
        """Tokens from which a product with ``weight`` goes to cuBLAS (where it is installed)."""
        return self.cublas_min_tokens_f16 if weight.f16 is not None else self.cublas_min_tokens

    def _few_shape(self, weight: Matrix, n: int, k: int) -> tuple[int, int] | None:
        """gemm_few's instantiation for ``n`` tokens times ``weight``, or None where another kernel does it."""
        if (
            weight.kernels is None
            or not self.tensor_cores
            or k % 8
            or not self.few_tokens[0] <= n <= self.few_tokens[1]
        ):
            return None
        layout = quants.LAYOUTS[weight.qtype]
        if not layout.integer and n <= quants.GEMV_MAX_TOKENS:
            return None
        if self.cublas is not None and n >= self._cublas_from(weight):
            return None  # cuBLAS takes it (matmul)
        return self.few_shape or quants.gemm_few_shape(n, weight.rows)

    def _sibling(self, x: DeviceArray, product: Pending) -> Pending:
        """``product`` remembered among the pending products that read ``x`` (its launch may take them along)."""
        siblings = self._by_input.get(id(x))
        if siblings is None or siblings[0] is not x:
            siblings = (x, [])
            self._remember(self._by_input, id(x), siblings, size=4)
        siblings[1].append(product)
        return product

    def _waiting_siblings(self, product: Pending, kind: str, fits: Callable[[Pending], bool]) -> list[Pending]:
        """``product`` and up to two more products of its input still waiting as ``kind`` (and not taken by a fused
        consumer) for which ``fits``, in the order they were asked for."""
        x = product.fusion[1]
        siblings = self._by_input.get(id(x))
        if siblings is None or siblings[0] is not x:
            return [product]
        others = [p for p in siblings[1] if p is not product and p.waiting(kind) and not p.fused and fits(p)][:2]
        return [p for p in siblings[1] if p is product or any(p is other for other in others)]

    def _deferred_cublas(self, weight: Matrix, n: int, k: int) -> bool:
        """Whether a product of ``weight``'s f16 copy through cuBLAS waits for its consumer: silu_mul and add then
        take its epilogue into their kernel, and a launch takes its siblings along (_launch_cublas)."""
        return (
            self.fuse
            and self.cublas is not None
            and weight.f16 is not None
            and k % 8 == 0
            and n >= self._cublas_from(weight)
            and n > min(quants.GEMV_Q_MAX_TOKENS, self.few_tokens[0] - 1)  # else gemv_q's (matmul)
        )

    def _fusable(self, weight: Matrix, n: int, k: int) -> bool:
        """Whether a product may wait for its consumer: the integer matrix-vector kernel with fusions."""
        return (
            self.fuse
            and weight.kernels is not None
            and quants.LAYOUTS[weight.qtype].integer
            and n <= min(quants.GEMV_Q_FUSED_TOKENS, self.few_tokens[0] - 1)
            and quants.gemv_q_smem(weight.qtype, n, k) <= quants.GEMV_Q_MAX_SMEM
        )

    def _launch_products(self, product: Pending) -> DeviceArray:
        """Launch a pending product together with up to two others waiting on the same input and of
        the same type and row length (q, k and v: one launch instead of three)."""
        _, x, weight, _ = product.fusion
        group = self._waiting_siblings(product, "matmul", lambda p: p.fusion[2].qtype == weight.qtype)
        outs = self._gemv_q(x, [(p.fusion[2], p.fusion[3]) for p in group])
        return _settle(product, group, outs)

    def _launch_cublas(self, product: Pending) -> DeviceArray:
        """Launch a pending cuBLAS product together with up to two others waiting on the same x (q, k and v): their
        products side by side in one output, one cuBLAS call where their f16 copies adjoin, one epilogue."""
        _, x, weight, bias = product.fusion
        k, n = weight.cols, x.size // weight.cols
        group = self._waiting_siblings(product, "cublas", lambda p: p.fusion[2].cols == k)
        if len(group) == 1:
            out = self._empty(product.shape)
            self._cublas_product(x, weight, bias, out, n, weight.rows, k)
            return out
        y, xscale = self._cublas_gemms(x, [p.fusion[2] for p in group], n)
        outs = [self._empty(p.shape) for p in group] + [None] * (3 - len(group))
        biases = [p.fusion[3] for p in group] + [None] * (3 - len(group))
        rows = [p.fusion[2].rows for p in group] + [0] * (3 - len(group))
        self.ops["scale_split"](_epilogue_grid(sum(rows), n), 256, y, xscale, *outs, *biases, *rows, n)
        return _settle(product, group, outs)

    def _cublas_gemms(self, x, weights: list[Matrix], n: int) -> tuple[DeviceArray, DeviceArray]:
        """x's f16 rows times each of ``weights`` (f16 copies of one row length) through cuBLAS, side by side in one
        [n, their rows] output, one cuBLAS call for each run of copies that adjoin in memory (see F16_SLAB_BYTES);
        returns it and x's row scales, which its epilogue is to apply."""
        k = weights[0].cols
        xh, xscale = self._f16_rows(x, n, k)
        total = sum(w.rows for w in weights)
        y = self._empty((n, total))
        column = 0
        for run in _adjoining(weights):
            rows = sum(w.rows for w in run)
            assert run[0].f16 is not None
            self.cublas.gemm_f16(run[0].f16.ptr, xh.ptr, y.ptr + 4 * column, rows, n, k, total)
            column += rows
        return y, xscale

    def _gemv_q(
        self, x, segments, residual=None, up: Matrix | None = None, out=None, rope: RopeWrite | None = None
    ) -> list[DeviceArray]:
        """One gemv_q launch: ``x`` times each (weight, bias) of ``segments`` (up to 3, same type and
        row length); a pending RMS norm of ``x`` is applied in the kernel; ``residual`` is added to the
        first output; with ``up``, the single segment is the gate of silu(x G^T) * (x U^T); with ``rope``, the
        segments' roles (q rotated, k rotated into the cache, v into the cache) in the epilogue (_write_kv_fused),
        an output only for q's."""
        mode, norm_weight, eps = 0, None, 0.0
        if isinstance(x, Pending) and x.waiting("norm"):
            _, x, norm_weight, eps = x.fusion
            mode |= quants.GEMV_Q_NORM
        x = _ready(x)
        if up is not None:
            mode |= quants.GEMV_Q_GLU
        k = x.shape[-1]
        n = x.size // k
        first = segments[0][0]
        roles = rope.roles if rope is not None else 0  # k's and v's rows (roles 2, 3) go into the cache: no output
        outs = (
            [out]
            if out is not None
            else [
                self._empty(x.shape[:-1] + (w.rows,)) if (roles >> (2 * i)) & 3 < 2 else None
                for i, (w, _) in enumerate(segments)
            ]
        )
        rows, units, variant = quants.gemv_q_shape(n, mode, sum(w.rows for w, _ in segments), k, self.gemv_split)
        if rope is not None:
            mode |= quants.GEMV_Q_ROPE
        kernel = first.kernels[quants.gemv_q_name(first.qtype, n, (rows, units), mode | variant)]
        threads = quants.gemv_q_threads(variant)
        split_rows = rows * (2 if up is not None else 1) if variant & quants.GEMV_Q_SPLIT else 0  # gate's and up's
        smem = quants.gemv_q_smem(first.qtype, n, k, split_rows)
        groups = sum(-(-w.rows // (4 * rows)) for w, _ in segments)
        grid = min(groups, self.device.sm_count * kernel.occupancy(threads, smem))
        padded = list(zip(segments, outs)) + [((None, None), None)] * (3 - len(segments))
        weights = [s[0] for s, _ in padded]
        second = up if up is not None else weights[1]
        kernel(
            (grid,),
            threads,
            first.ptr,
            second.ptr if second else 0,
            weights[2].ptr if weights[2] else 0,
            *[w.blocks if w else 0 for w in weights],
            x,
            *[o for _, o in padded],
            *[s[1] for s, _ in padded],
            residual,
            norm_weight,
            float(eps),
            *[w.rows if w else 0 for w in weights],
            k,
            *(rope.arguments if rope is not None else quants.GEMV_Q_NO_ROPE),
            smem=smem,
        )
        return outs

    def _f16_rows(self, x: DeviceArray, n: int, k: int) -> tuple[DeviceArray, DeviceArray]:
        """``x`` as f16 rows and their scales (x_to_f16), made once for the products that share it; a pending
        norm goes straight to f16 rows (rms_norm_f16: the same values, no float32 rows in between)."""
        hit = self._halves.get(id(x))
        if hit is not None and hit[0] is x:  # q, k and v (gate and up) read the same activations
            return hit[1], hit[2]
        xh = self._empty((n, k), U16)
        xscale = self._empty((n,), F32)
        if isinstance(x, Pending) and x.waiting("norm"):
            _, source, weight, eps = x.fusion
            self.ops["rms_norm_f16"]((n,), _threads(k), source, weight, xh, xscale, k, float(eps))
        else:
            self.ops["x_to_f16"]((n,), _threads(k), _ready(x), xh, xscale, k)
        self._remember(self._halves, id(x), (x, xh, xscale), size=2)
        return xh, xscale

    def _cublas_product(self, x, weight: Matrix, bias, out: DeviceArray, n: int, m: int, k: int) -> None:
        """``out = x weight^T + bias`` through cuBLAS: the weight decoded to f16 rows a chunk at a time
        (``CUBLAS_SCRATCH_BYTES`` at a time), then one epilogue applies x's scales."""
        xh, xscale = self._f16_rows(x, n, k)
        if weight.f16 is not None:  # decoded once, at load
            self.cublas.gemm_f16(weight.f16.ptr, xh.ptr, out.ptr, m, n, k, m)
        else:
            rows = max(1, min(m, self._f16_weights.nbytes // (2 * k)))
            for start in range(0, m, rows):
                count = min(rows, m - start)
                self._decode_f16(weight, self._f16_weights, start, count)
                self.cublas.gemm_f16(self._f16_weights.ptr, xh.ptr, out.ptr + 4 * start, count, n, k, m)
        self.ops["scale_rows_bias"](_epilogue_grid(m, n), 256, out, xscale, bias, m, n)

    def _gemm_few(
        self, x, weight: Matrix, bias, out: DeviceArray, n: int, shape: tuple[int, int], up: Matrix | None = None
    ) -> DeviceArray:
        """gemm_few: tensor cores, each weight read once, 8 * shape[0] tokens and 16 * shape[1] rows a block; with
        ``up`` (same type and shape as ``weight``, the gate), silu(x weight^T) * (x up^T) in one launch."""
        m, k = weight.rows, weight.cols
        xh, xscale = self._f16_rows(x, n, k)
        glu = up is not None
        weight.kernels[quants.gemm_few_name(weight.qtype, shape, glu)](
            (-(-m // (16 * shape[1])),),
            256,
            weight.ptr,
            up.ptr if up is not None else 0,
            weight.blocks,
            xh,
            xscale,
            out,
            bias,
            m,
            n,
            k,
            smem=quants.gemm_few_smem(shape, glu),
        )
        return out

    def _gemm_rows(self, x, weight: Matrix, bias, out: DeviceArray, n: int) -> DeviceArray:
        """gemm_rows: a block's warps share x in shared memory, each decodes its rows' weights into fragments; split
        over K so that the grid has about ``rows_blocks`` blocks (partial sums added by splitk_sum)."""
        m, k = weight.rows, weight.cols
        xh, xscale = self._f16_rows(x, n, k)
        shape = self.rows_shape or quants.GEMM_ROWS_VARIANTS[0]
        grid = (-(-m // (64 * shape[1])), 1, -(-n // (8 * shape[0])))
        chunks = k // quants.GEMM_ROWS_KC
        splits = max(1, min(chunks, int(self.rows_blocks / (grid[0] * grid[2]) + 0.5)))
        chunk = -(-chunks // splits) * quants.GEMM_ROWS_KC
        splits = -(-k // chunk)
        target = out if splits == 1 else self._empty((splits, n, m))
        weight.kernels[quants.gemm_rows_name(weight.qtype, shape)](
            (grid[0], splits, grid[2]), 128, weight.ptr, weight.blocks, xh, xscale, target, bias, m, n, k, chunk
        )
        if splits > 1:
            self._split_sum(target, out, n * m, splits)
        return out

    def _split_sum(self, parts: DeviceArray, out: DeviceArray, total: int, splits: int) -> None:
        """``out`` = the sum of a split-K product's ``splits`` partial outputs of ``total`` values each."""
        grid = max(1, min(-(-total // 256), 8 * self.device.sm_count))
        self.ops["splitk_sum"]((grid,), 256, parts, out, total, splits)

    def _gemm(self, x, weight: Matrix, bias, out: DeviceArray, n: int, m: int, k: int, kt: int) -> None:
        """The tensor-core GEMM, split over K when its tiles alone would leave most of the GPU idle."""
        xh, xscale = self._f16_rows(x, n, k)
        tiles = -(-m // 128) * -(-n // 64)
        steps = k // kt
        # split only when the tiles leave multiprocessors without a block (H200, pp512: the Q4_K
        # products and split sums took 41.4 ms split in two, 40.1 ms whole; see NOTES.md)
        splits = min(steps, -(-2 * self.device.sm_count // tiles)) if tiles < self.device.sm_count else 1
        chunk = -(-steps // splits) * kt
        splits = -(-k // chunk)
        target = out if splits == 1 else self._empty((splits, n, m))
        weight.kernels[quants.gemm_name(weight.qtype, kt)](
            (-(-m // 128), -(-n // 64), splits),
            256,
            weight.ptr,
            weight.blocks,
            xh,
            xscale,
            target,
            bias,
            m,
            n,
            k,
            chunk,
            smem=quants.GEMM_SMEM[kt],
        )
        if splits > 1:
            self._split_sum(target, out, n * m, splits)

    def rms_norm(self, x: DeviceArray, weight: DeviceArray | None, eps: float) -> DeviceArray:
        x = _ready(x)
        if self.fuse:  # its consumer may take it in: gemv_q (1-2 tokens) or the f16 rows of a larger product
            return Pending(x.shape, lambda: self._rms_norm(x, weight, eps), ("norm", x, weight, eps))
        return self._rms_norm(x, weight, eps)

    def _rms_norm(self, x: DeviceArray, weight: DeviceArray | None, eps: float) -> DeviceArray:
        cols = x.shape[-1]
        out = self._empty(x.shape)
        self.ops["rms_norm"]((x.size // cols,), _threads(cols), x, weight, out, cols, float(eps))
        return out

    def _rope_table(self, spec: RopeSpec) -> DeviceArray:
        hit = self._rope.get(id(spec))
        if hit is not None and hit[0] is spec:
            return hit[1]
        half = spec.dims // 2
        inv_freq = spec.base ** (-np.arange(half, dtype=np.float64) * 2 / spec.dims)
        if spec.freq_factors is not None:
            inv_freq = inv_freq / np.asarray(spec.freq_factors, np.float64)[:half]
        host = np.ascontiguousarray(inv_freq * spec.scale, np.float64)
        memory = Memory(host.nbytes)
        self.device.upload(memory.ptr, host)
        self.device.synchronize()
        table = DeviceArray(memory.ptr, host.shape, np.float64, memory)
        self._rope[id(spec)] = (spec, table)
        return table

    def rope(self, x: DeviceArray, positions: np.ndarray, spec: RopeSpec) -> DeviceArray:
        if self.fuse:  # attention may take q and k in still to be rotated: one launch with the cache write (_write_kv)
            return Pending(x.shape, lambda: self._rotate(x, positions, spec), ("rope", x, positions, spec))
        return self._rotate(x, positions, spec)

    def _rotate(self, x: DeviceArray, positions: np.ndarray, spec: RopeSpec) -> DeviceArray:
        n, heads, head_dim = x.shape
        out = self._empty(x.shape)
        if _is_norm(x):  # per-head q/k norms: the norm runs inside rope_norm
            kernel, threads, inputs = "rope_norm", _threads(head_dim), _normed(x)
        else:
            kernel, threads, inputs = "rope", _threads(head_dim // 2), (_ready(x),)
        self.ops[kernel](
            (n * heads,),
            threads,
            *inputs,
            out,
            self._ints(positions),
            self._rope_table(spec),
            heads,
            head_dim,
            spec.dims,
            int(spec.neox),
            float(spec.attn_factor),
        )
        return out

    def attention(
        self,
        q,
        k,
        v,
        kv: KVCache,
        layer: int,
        batch: Batch,
        scale: float,
        softcap: float | None = None,
        sinks: DeviceArray | None = None,
    ) -> DeviceArray:
        if any(row.bidirectional for row in batch.rows):
            return self._attend_open(q, k, v, kv, layer, batch, scale, softcap or 0.0, sinks)
        return self._attend(q, k, v, kv, layer, batch, scale, softcap or 0.0, sinks)

    def _attend(
        self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float, softcap: float, sinks=None
    ) -> DeviceArray:
        n, heads, dk = q.shape
        kv_heads, dv = v.shape[1], v.shape[2]  # v may still be pending: _write_kv may take its product in
        slots, positions, span = self._token_rows(batch)
        q, (kind, (_, _, k_scale, v_scale, table), per_slot) = self._write_kv(k, v, kv, layer, slots, positions, q)
        # a prefill (some row has several tokens, or a graph past TILED_GRAPH_TOKENS; never a captured decode step):
        # tensor cores over an f16 or q8_0 cache (flash.cu decodes q8_0 into its f16 tiles)
        prefill = n > len(batch.rows) or batch is self._tiled_batch
        flash = n > quants.GEMV_MAX_TOKENS and prefill and kind in FLASH_KINDS and dk == dv
        if flash and dk in FLASH_DIMS and sinks is None:
            return self._flash(q, kv, layer, batch, (kind, k_scale, v_scale, table), slots, positions, scale, softcap)
        lanes = -(-max(dk, dv) // 32)
        dl = next((d for d in (1, 2, 4, 8) if d >= lanes), None)
        if dl is None:
            raise LeatError(f"attention heads of {max(dk, dv)} dimensions exceed the kernel's 256")
        # many query tokens (a prefill): one key per lane; a decode step: flash.cu's attention_tc (16 query heads a
        # block on tensor cores, ATTENTION_TC_MIN_GROUP), else one key per warp step (the faster of the two SIMT
        # kernels for decode, also at depth 4096: measured on an H200, see NOTES.md)
        variant = "attention_wide" if n > quants.GEMV_MAX_TOKENS and dk % 8 == 0 else "attention"
        switch = os.environ.get("LEAT_CUDA_ATTENTION_TC")
        tc = switch == "1" or (switch != "0" and heads // kv_heads >= ATTENTION_TC_MIN_GROUP)
        tc = tc and variant == "attention" and kind in FLASH_KINDS and dk == dv and dk in FLASH_DIMS
        per_block, keys = (16, ATTENTION_TC_KEYS) if tc else (GROUP_HEADS, ATTENTION_SPLIT_KEYS)
        chunks = -(-(heads // kv_heads) // per_block)
        splits, split = self._decode_splits(n * kv_heads * chunks, span, keys)
        out = self._empty((n, heads * dv))
        part_ml, part_acc = self._split_parts(n * heads, splits, dv)
        if tc:
            kernel = self._module("flash", "flash.cu", FLASH_KERNELS, {})[f"attention_tc<{kind}, {dk}>"]
        else:
            kernel = self.ops[f"{variant}<{kind}, {dl}, {GROUP_HEADS}>"]
        kernel(
            (n, kv_heads * chunks, splits),
            128,
            q,
            kv.k[layer],
            kv.v[layer],
            k_scale,
            v_scale,
            table,
            slots,
            positions,
            out if splits == 1 else None,
            part_ml,
            part_acc,
            *((heads, kv_heads) if tc else (heads, kv_heads, dk, dv)),
            per_slot,
            kv.page_size,
            kv.layouts[layer].window or 0,
            split if variant == "attention_wide" else keys,  # attention cuts each token's own range
            float(scale),
            float(softcap),
            sinks,
        )
        if splits > 1:
            self._merge_splits(part_ml, part_acc, out, n * heads, splits, dv, sinks, heads)
        return out

    def _split_parts(self, rows: int, splits: int, dv: int) -> tuple[Any, Any]:
        """A split decode attention's partial results for attention_combine: each row's (max, sum) and unnormalized
        values a split; (None, None) for one split (the kernel writes the output)."""
        if splits == 1:
            return None, None
        return self._empty((rows * splits * 2,)), self._empty((rows * splits * dv,))

    def _decode_splits(self, blocks: int, span: int, keys: int) -> tuple[int, int]:
        """(splits, positions a split) of a decode attention launch of ``blocks`` blocks a split over ``span``
        positions: about two blocks a multiprocessor (measured: more splits cost more in the combine than they gained
        at depth 4096, before the combine's loads went out together), splits a multiple of ``keys`` positions, at most
        COMBINE_MAX_SPLITS of them. The kernels cut each token's own range into the splits (a graph's launch is sized
        for the cache's whole context)."""
        splits = max(1, min(-(-2 * self.device.sm_count // blocks), -(-span // keys), COMBINE_MAX_SPLITS))
        per_split = -(-span // splits)
        split = -(-per_split // keys) * keys  # rounded up to a multiple of keys
        return -(-span // split), split

    def _merge_splits(self, part_ml, part_acc, out, rows: int, splits: int, dv: int, sinks, heads: int) -> None:
        """attention_combine: ``rows`` (token, head) rows of ``dv`` values merged from ``splits`` partial results each
        (``part_ml``: each split's max and sum; ``part_acc``: its unnormalized values) into ``out``; ``sinks`` a logit a
        head, or None. A block a row and COMBINE_THREADS of its values."""
        threads = min(COMBINE_THREADS, _threads(dv))
        self.ops["attention_combine"](
            (rows, -(-dv // threads)), threads, part_ml, part_acc, out, splits, dv, sinks, heads
        )

    def _write_kv(self, k, v, kv: KVCache, layer: int, slots, positions, q=None) -> tuple[Any, tuple[str, tuple, int]]:
        """Each token's k and v into ``layer``'s pages, and ``q`` made ready: q, and the KV kernels' element kind, the
        cache as the attention kernels take it (K, V, q8_0's scale planes or None, the layer's device page table) and
        the pages per slot. Where q and k are both still to be rotated (rope, rope_norm), one rope_kv_write launch
        rotates them and writes the cache."""
        fused = self._write_kv_fused(q, k, v, kv, layer, slots, positions)
        if fused is not None:
            return fused
        v = _ready(v)
        n, kv_heads, dk = k.shape
        self._sync_pages(kv)
        kind = KV_DTYPES[kv.dtype][0]
        scales = (kv.k_scale[layer], kv.v_scale[layer]) if kv.dtype == "q8_0" else (None, None)
        table = kv.device_tables[kv.group_of[layer]]  # a windowed group's entries behind the window are -1
        cache = (kv.k[layer], kv.v[layer], *scales, table)
        per_slot = kv.tables[0].shape[1]
        sizes = (kv_heads, dk, v.shape[2], per_slot, kv.page_size)
        if q is None or not _rope_pair(q, k):
            k = _ready(k)
            self.ops[f"kv_write<{kind}>"]((n,), 128, k, v, *cache, slots, positions, *sizes)
            return _ready(q), (kind, cache, per_slot)
        (_, qx, rope_positions, spec), (_, kx, _, _) = q.fusion, k.fusion
        norm = _is_norm(qx)
        qx, qw, qe = _normed(qx) if norm else (qx, None, 0.0)
        kx, kw, ke = _normed(kx) if norm else (kx, None, 0.0)
        q.fused = k.fused = True
        heads = q.shape[1]
        qy = self._empty(q.shape)
        self.ops[f"rope_kv_write<{kind}, {'true' if norm else 'false'}>"](
            (n * (heads + kv_heads),),
            _threads(dk),
            qx,
            kx,
            v,
            qw,
            kw,
            qe,
            ke,
            qy,
            *cache,
            slots,
            positions,
            self._ints(rope_positions),
            self._rope_table(spec),
            heads,
            kv_heads,
            dk,
            v.shape[2],
            spec.dims,
            int(spec.neox),
            float(spec.attn_factor),
            per_slot,
            kv.page_size,
        )
        return qy, (kind, cache, per_slot)

    def _write_kv_fused(self, q, k, v, kv: KVCache, layer: int, slots, positions) -> tuple[Any, tuple] | None:
        """_write_kv without rope_kv_write, where it can be: one token's q, k and v still waiting as gemv_q products
        of one x, q and k to be rotated by one RoPE of adjacent pairs with no per-head norm, a float32 or f16 cache.
        Their products run with the rotation and the cache write in gemv_q's epilogue (GEMV_Q_ROPE: the same values
        bit for bit), q, k and v in one launch where they share a type (else q and k, then v); None where it does
        not apply."""
        if q is None or not _rope_pair(q, k) or _is_norm(q.fusion[1]):
            return None
        _, qx, rope_positions, spec = q.fusion
        n, _, dk = q.shape
        kind = KV_DTYPES[kv.dtype][0]
        products = [_waiting_product(a) for a in (qx, k.fusion[1], v)]
        if n != 1 or kind == "i8" or spec.neox or dk % 2 or spec.dims % 2 or None in products:
            return None
        qp, kp, vp = products
        x, qtype = qp.fusion[1], qp.fusion[2].qtype
        if kp.fusion[1] is not x or vp.fusion[1] is not x or kp.fusion[2].qtype != qtype:
            return None
        # (products, roles): q out rotated (1), k rotated into the cache (2), v into the cache (3); 2 bits a segment
        if vp.fusion[2].qtype == qtype:
            launches = [([qp, kp, vp], 1 | 2 << 2 | 3 << 4)]
        else:
            launches = [([qp, kp], 1 | 2 << 2), ([vp], 3)]
        if not all(self._rope_twin(x, group) for group, _ in launches):
            return None
        self._sync_pages(kv)
        table = kv.device_tables[kv.group_of[layer]]
        per_slot = kv.tables[0].shape[1]
        rest = (slots, positions, table, self._ints(rope_positions), self._rope_table(spec), kv.k[layer], kv.v[layer])
        rest += (int(kind == "u16"), dk, spec.dims, per_slot, kv.page_size, float(spec.attn_factor))
        outs = []
        for group, roles in launches:
            outs += self._gemv_q(x, [(p.fusion[2], p.fusion[3]) for p in group], rope=RopeWrite(roles, rest))
        for pending in (*products, q, k):
            pending.fused = True  # taken in: launched again only if something else asks for it
        return outs[0].view(q.shape), (kind, (kv.k[layer], kv.v[layer], None, None, table), per_slot)

    def _rope_twin(self, x, group: list[Pending]) -> bool:
        """Whether the launch of ``group``'s products has a ROPE twin: the rule's shape for them, rows a warp even
        and not pipelined (split or not), compiled with GEMV_Q_ROPE."""
        weight = group[0].fusion[2]
        mode = quants.GEMV_Q_NORM if isinstance(x, Pending) and x.waiting("norm") else 0
        rows_all = sum(p.fusion[2].rows for p in group)
        rows, units, variant = quants.gemv_q_shape(1, mode, rows_all, weight.cols, self.gemv_split)
        name = quants.gemv_q_name(weight.qtype, 1, (rows, units), mode | variant | quants.GEMV_Q_ROPE)
        pipelined = variant & quants.GEMV_Q_PIPE
        return not pipelined and rows % 2 == 0 and weight.kernels is not None and name in weight.kernels.kernels

    def _flash(self, q, kv: KVCache, layer: int, batch: Batch, cache, slots, positions, scale: float, softcap: float):
        """Tensor-core attention for a prefill over an f16 or q8_0 cache (kernels/flash.cu): the batch's rows cut
        into tiles of consecutive tokens, one block per tile, KV head and chunk of its query heads. ``cache``: the
        cache's element kind, its scale planes (q8_0; else None) and the layer's device page table."""
        kind, k_scale, v_scale, table = cache
        n, heads, dim = q.shape
        kv_heads = kv.layouts[layer].kv_heads
        group = heads // kv_heads
        per_block = 4 if group >= 3 else group  # query heads per block; its 4 warps split the tile's tokens
        tiles = self._flash_tiles(batch, 16 * 4 // per_block, kv, slots, positions)
        out = self._empty((n, heads * dim))
        self._module("flash", "flash.cu", FLASH_KERNELS, {})[f"flash_attention<{kind}, {dim}>"](
            (tiles.size // 2, kv_heads * -(-group // per_block)),
            128,
            q,
            kv.k[layer],
            kv.v[layer],
            k_scale,
            v_scale,
            table,
            slots,
            positions,
            tiles,
            out,
            heads,
            kv_heads,
            kv.tables[0].shape[1],
            kv.page_size,
            kv.layouts[layer].window or 0,
            float(scale),
            float(softcap),
            per_block,
        )
        return out

    def _flash_tiles(self, batch: Batch, tile: int, kv: KVCache, slots, positions) -> DeviceArray:
        """(first token, count) of each run of up to ``tile`` consecutive tokens of one row, on the device. A graph's
        are made there (ops.cu's flash_tiles, from the tokens' slots and positions), with room for the most tiles a
        step of its tokens can have (a tile per ``tile`` tokens and one more a row, a row a slot); the spare
        entries' count is 0."""
        key = (id(batch), tile, self._capturing)  # the capture makes its own: the eager run's are not in the graph
        hit = self._tiles.get(key)
        if hit is not None and hit[0] is batch:
            return hit[1]
        if batch is self._tiled_batch:
            n = len(batch)
            if n > FLASH_TILES_THREADS:
                raise LeatError(f"flash_tiles takes up to {FLASH_TILES_THREADS} tokens, not {n}")
            capacity = min(n, -(-n // tile) + kv.tables[0].shape[0])
            array = self._empty((2 * capacity,), I32)
            self.ops["flash_tiles"]((1,), FLASH_TILES_THREADS, slots, positions, array, n, tile, capacity)
            self._remember(self._tiles, key, (batch, array))
            return array
        tiles, first = [], 0
        for row in batch.rows:
            count = len(row.tokens)
            tiles += [(start, min(tile, first + count - start)) for start in range(first, first + count, tile)]
            first += count
        host = np.asarray(tiles, np.int32).reshape(-1)
        array = self._empty(host.shape, I32)
        self.device.upload(array.ptr, host)
        self._remember(self._tiles, key, (batch, array))
        return array

    def _elementwise(self, kernel: str, *args: Any, like: DeviceArray) -> DeviceArray:
        args = tuple(_ready(a) for a in args)
        out = self._empty(like.shape)
        n = like.size
        self.ops[kernel]((max(1, min(-(-n // 256), 8 * self.device.sm_count)),), 256, *args, out, n)
        return out

    def silu_mul(self, gate: DeviceArray, up: DeviceArray) -> DeviceArray:
        if isinstance(gate, Pending) and isinstance(up, Pending) and gate.waiting("matmul") and up.waiting("matmul"):
            _, x, wg, bg = gate.fusion
            _, x2, wu, bu = up.fusion
            if (
                x is x2
                and bg is None
                and bu is None
                and wg.qtype == wu.qtype
                and (wg.rows, wg.cols) == (wu.rows, wu.cols)
            ):
                gate.fused = up.fused = True
                return self._gemv_q(x, [(wg, None)], up=wu)[0]
        if isinstance(gate, Pending) and isinstance(up, Pending) and gate.waiting("few") and up.waiting("few"):
            _, x, wg = gate.fusion
            _, x2, wu = up.fusion
            if x is x2 and wg.qtype == wu.qtype and (wg.rows, wg.cols) == (wu.rows, wu.cols):
                gate.fused = up.fused = True
                n = x.size // wg.cols
                shape = self._few_shape(wg, n, wg.cols)
                assert shape is not None  # the products were deferred because gemm_few takes them
                return self._gemm_few(x, wg, None, self._empty(gate.shape), n, shape, up=wu)
        if isinstance(gate, Pending) and isinstance(up, Pending) and gate.waiting("cublas") and up.waiting("cublas"):
            _, x, wg, bg = gate.fusion
            _, x2, wu, bu = up.fusion
            if x is x2 and (wg.rows, wg.cols) == (wu.rows, wu.cols):  # both products, their epilogues, one kernel
                gate.fused = up.fused = True
                n = x.size // wg.cols
                y, xscale = self._cublas_gemms(x, [wg, wu], n)
                out = self._empty(gate.shape)
                self.ops["scale_silu_mul"](_epilogue_grid(wg.rows, n), 256, y, xscale, bg, bu, out, wg.rows, n)
                return out
        return self._elementwise("silu_mul", gate, up, like=gate)

    def gelu_mul(self, gate: DeviceArray, up: DeviceArray | None = None) -> DeviceArray:
        if up is None:
            return self._gelu(gate)
        return self._elementwise("gelu_mul", gate, up, like=gate)

    def add(self, a: DeviceArray, b: DeviceArray) -> DeviceArray:
        if a.shape != b.shape:
            raise ValueError(f"add: shapes {a.shape} and {b.shape} differ")
        for product, other in ((b, a), (a, b)):
            if isinstance(product, Pending) and product.waiting("matmul"):
                _, x, weight, bias = product.fusion
                product.fused = True
                return self._gemv_q(x, [(weight, bias)], residual=_ready(other))[0]
            if isinstance(product, Pending) and product.waiting("cublas"):  # the epilogue in the add's kernel
                _, x, weight, bias = product.fusion
                product.fused = True
                n = x.size // weight.cols
                y, xscale = self._cublas_gemms(x, [weight], n)
                out = self._empty(a.shape)
                self.ops["scale_add"](
                    _epilogue_grid(weight.rows, n), 256, y, xscale, bias, _ready(other), out, weight.rows, n
                )
                return out
            if isinstance(product, Pending) and product.waiting("combine"):  # a MoE layer's weighted sum
                product.fused = True
                return self._combine(*product.fusion[1:], residual=_ready(other))
        return self._elementwise("add", a, b, like=a)

    def scale(self, x: DeviceArray, factor: float) -> DeviceArray:
        return self._elementwise("scale", x, float(factor), like=x)

    def softcap(self, x: DeviceArray, cap: float) -> DeviceArray:
        return self._elementwise("softcap", x, float(cap), like=x)

    def reshape(self, x: DeviceArray, shape: tuple[int, ...]) -> DeviceArray:
        shape = tuple(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(x.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != x.size:
            raise ValueError(f"cannot reshape {x.shape} to {shape}")
        return x.view(shape)

    def take_rows(self, x: DeviceArray, index: np.ndarray) -> DeviceArray:
        if isinstance(x, Pending) and x.waiting("norm"):  # a row-wise norm commutes with taking rows
            _, rows, weight, eps = x.fusion
            return self.rms_norm(self.take_rows(rows, index), weight, eps)
        x = _ready(x)
        cols = x.size // x.shape[0]
        out = self._empty((len(index),) + x.shape[1:])
        self.ops["take_rows"]((len(index),), _threads(cols), x, self._ints(index), out, cols)
        return out

    # -- graphs --------------------------------------------------------------------------------------
    def run(self, forward: Callable[[Batch, Any], Any], batch: Batch, kv: Any, fed: Any = None) -> Any:
        """One forward step, replaying a captured graph where the batch fits one.

        A graph treats every token as a row of its own (its slot, its position): each writes its K/V,
        then attends to its slot's cache up to its position. That is exact for any batch: decode rows,
        speculative rows (a token and its draft), and prefill chunks, whose tokens attend like
        consecutive decode steps of one slot. The logits rows the batch asks for are picked inside
        the graph. Up to ``TILED_GRAPH_TOKENS`` tokens, a chunk deep into a long prompt is cheaper through
        the eager path's tile-wise attention (``FLAT_ATTENTION_BUDGET``); past them a graph attends tile-wise
        itself (its tiles made on the device), and a batch over ``TOKEN_BUCKETS[-1]`` tokens runs eagerly.
        """
        self.device.activate()
        shape = self._graph_shape(batch, kv)
        key = (forward, id(kv), *(shape or ()))
        if shape is None or key in self._uncapturable:
            return forward(_with_tokens(batch, fed), kv)
        captured = self._captured.get(key)
        if captured is None:
            try:
                if shape[0] > LOGIT_BUCKETS[-1]:
                    self._graph_room()
                captured = self._captured[key] = self._capture(forward, kv, *shape)
                if not any(k[1] == id(kv) for k in self._captured if k != key):  # graphs go with their cache
                    weakref.finalize(kv, self._forget, id(kv))
            except Exception as e:  # noqa: BLE001 - a graph is an optimization: record why, run this shape eagerly
                self.graph_failures.append(f"{type(e).__name__}: {e}")
                # said where it happens: steps of this shape now pay the eager path's host time (a figure printed
                # after this is not the graphs' figure)
                log.warning(
                    "cuda: no graph for steps of %s tokens (%s: %s); they run eagerly", shape[0], type(e).__name__, e
                )
                self._uncapturable.add(key)
                return forward(_with_tokens(batch, fed), kv)
        tokens, logits = shape
        self._replaying(kv, batch)  # the recurrent states the graph continues (deltanet.py)
        n, picked = len(batch), len(batch.logit_index)
        inputs = np.zeros(3 * tokens + logits, np.int32)
        inputs[:n] = batch.tokens
        inputs[tokens : tokens + n] = batch.positions
        inputs[2 * tokens : 3 * tokens] = -1  # padding tokens belong to no slot: no KV write, no attention
        inputs[2 * tokens : 2 * tokens + n] = np.repeat(
            [r.slot for r in batch.rows], [len(r.tokens) for r in batch.rows]
        )
        inputs[3 * tokens : 3 * tokens + picked] = batch.logit_index
        self._sync_pages(kv)
        self.device.upload(captured.inputs.ptr, inputs)
        if fed is not None:  # the tokens come from the last step's argmax, on the device
            ids, index = fed
            self.ops["gather_ints"]((-(-n // 256),), 256, ids.device, self._ints(index), captured.inputs, n)
        captured.graph.replay()
        return captured.logits.view((picked,) + captured.logits.shape[1:])

    def _graph_shape(self, batch: Batch, kv: Any) -> tuple[int, int] | None:
        """(token bucket, logits bucket) of the graph that runs ``batch``, or None to run it eagerly. Up to 64
        tokens a graph computes every token's logits (decode and speculative steps); past that, a bucket of
        the rows the batch asks for."""
        n = len(batch)
        if not self.graphs or not isinstance(kv, KVCache) or n > TOKEN_BUCKETS[-1]:
            return None
        if batch.inputs is not None or any(r.bidirectional for r in batch.rows):
            return None  # an image's row (its inputs are embeddings, not tokens; it attends both ways): eagerly
        tokens = next(b for b in TOKEN_BUCKETS if b >= n)
        if tokens > TILED_GRAPH_TOKENS:  # attention as the eager path's (tile-wise where it is there): any depth
            if kv.recurrent or any(layout.latent for layout in kv.layouts):
                return None  # latent and recurrent layers would still go token by token: eagerly, as before
        else:
            chunks = (r for r in batch.rows if len(r.tokens) > 1 and not r.all_logits)
            if sum(len(r.tokens) * (r.start + len(r.tokens)) for r in chunks) > self.flat_attention_budget:
                return None  # token by token, a deep chunk's attention costs more than the eager path's host time
        wanted = len(batch.logit_index)
        logits = tokens if tokens <= LOGIT_BUCKETS[-1] else next((b for b in LOGIT_BUCKETS if b >= wanted), tokens)
        return tokens, logits

    def _graph_room(self) -> None:
        """Raises unless ``GRAPH_FREE_SHARE`` of the device's memory is free for a new chunk's graph."""
        free, total = self.device.free_memory()
        if free < GRAPH_FREE_SHARE * total:
            raise LeatError(
                f"{free >> 20} MiB of the device's {total >> 20} MiB free, under the {GRAPH_FREE_SHARE:.0%} a new "
                "graph needs"
            )

    def _capture(self, forward: Callable, kv: KVCache, tokens: int, logits: int) -> _Captured:
        self._sync_pages(kv)
        pool = driver.Pool(self.device, self._grew, self.pool.poison)
        inputs_block = pool.take((3 * tokens + logits) * 4)
        inputs = DeviceArray(inputs_block.ptr, (3 * tokens + logits,), I32, inputs_block)
        batch = Batch([Row(0, 0, np.zeros(1, np.int64)) for _ in range(tokens)])
        batch.logit_index = np.zeros(logits, np.int64)
        view = lambda i, length=tokens: inputs.view((length,), i * tokens)
        self._inputs[id(batch.tokens)] = (batch.tokens, view(0))
        self._inputs[id(batch.positions)] = (batch.positions, view(1))
        self._inputs[id(batch.logit_index)] = (batch.logit_index, view(3, logits))
        self._tokens_meta[id(batch)] = (batch, view(2), view(1), kv.context)
        placeholder = np.zeros(3 * tokens + logits, np.int32)
        placeholder[2 * tokens : 3 * tokens] = -1
        self.device.upload(inputs.ptr, placeholder)
        self.device.synchronize()
        saved, self._pool = self._pool, pool
        self._tiled_batch = batch if tokens > TILED_GRAPH_TOKENS else None
        try:
            _ready(forward(batch, kv))  # an eager run first, on padding only, builds what ops create lazily
            self.device.synchronize()
            self._capturing = True
            graph = driver.Graph(self.device, lambda: _ready(forward(batch, kv)))
        finally:
            self._pool, self._capturing, self._tiled_batch = saved, False, None
            for key in (id(batch.tokens), id(batch.positions), id(batch.logit_index)):
                self._inputs.pop(key, None)
            self._tokens_meta.pop(id(batch), None)
        out = graph.result
        graph.result = None
        return _Captured(graph, pool, inputs, out)

    def _forget(self, kv_id: int) -> None:
        for key in [k for k in self._captured if k[1] == kv_id]:
            del self._captured[key]
        self._uncapturable = {k for k in self._uncapturable if k[1] != kv_id}

    def release_graphs(self) -> None:
        """Drop every captured graph and the memory it reserved."""
        self._captured.clear()
        self._uncapturable.clear()


def _settle(product: Pending, group: list[Pending], outs: list) -> DeviceArray:
    """The outputs of ``group``'s one launch handed to its other members; ``product``'s returned."""
    for member, out in zip(group, outs):
        if member is not product:
            member._real, member._launch = out, None
    return outs[group.index(product)]


def _adjoining(weights: list[Matrix]) -> list[list[Matrix]]:
    """``weights`` in runs whose f16 copies follow one another in memory (one cuBLAS product each)."""
    runs: list[list[Matrix]] = []
    for w in weights:
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and last.f16 is not None
            and w.f16 is not None
            and last.f16.ptr + last.f16.nbytes == w.f16.ptr
        ):
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


def _epilogue_grid(m: int, n: int) -> tuple[int, int]:
    """The grid of an epilogue over ``n`` tokens' ``m`` values each (256 threads a block, a block row per token)."""
    return (min(-(-m // 256), 16), min(n, 65535))


def _threads(work: int) -> int:
    """Threads for a block that strides over ``work`` items: a multiple of 32 from 32 to 256."""
    return max(32, min(256, -(-work // 32) * 32))
