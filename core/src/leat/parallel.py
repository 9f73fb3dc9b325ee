"""Tensor parallelism: one :class:`~leat.backend.Backend` made of N backends of one kind (its "ranks").

Architectures stay as they are: :class:`TensorParallel` takes their ``upload`` and op calls and runs each on every
rank. Weights are split by their GGUF role, as Megatron-LM splits a transformer (:func:`split_of`):

- column-parallel, split by output rows: attention q/k/v (so each rank holds whole query heads and whole KV head
  groups), the gated MLP's gate and up, the output matrix (by vocabulary rows); their products come out split
  along their last axis, and attention, RoPE and the activations run on each rank's heads alone;
- row-parallel, split by input columns: the attention output and the MLP's down projection; each rank's product is
  a partial sum, and one all-reduce (:meth:`Collective.sum`) after it makes the whole again on every rank;
- per-head 3-D tensors (MLA's ``attn_k_b``/``attn_v_b``, gpt-oss's sinks) by heads, MoE experts within each expert
  (gate/up by their rows, down by its columns, one all-reduce after the routed sum: every rank routes alike);
- everything else (embeddings, norms, routers, MLA's shared latent projections) replicated.

Activations are :class:`Sharded`: per-rank arrays that are either the whole (replicated) or split in N equal
contiguous parts along one axis. An op that needs the whole of a split activation (a norm over the split axis, an
add of a whole and a split one, the host copy of logits) gathers it first (:meth:`Collective.gather`). The KV cache
is split by KV head: each rank allocates the pages of its own heads (an MLA latent cache, one shared head, is
replicated). So every rank holds about 1/N of the layers' weights and of the KV cache.

The ranks run one after another from this thread; the CPU backend's ranks run in a thread pool instead, so that
each rank's share of the cores works at once. A CUDA backend adopts this by giving each rank its own device and
stream (rank ``r`` gets ``device=r`` among its options) and by a :class:`Collective` over NCCL: one communicator
per rank (``ncclCommInitAll`` in one process driving N devices), ``ncclAllReduce`` / ``ncclAllGather`` queued on
each rank's stream, which CUDA graphs capture like any kernel (NCCL_NVLS_ENABLE=0: no NVLink multicast). That
collective is not written yet: it needs several GPUs to be tested (:class:`NcclCollective`).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import gguf
import numpy as np

from leat.backend import Allocations, Backend, KVLayout, KVPages
from leat.batch import Batch
from leat.errors import BackendUnavailable, LeatError
from leat.modelfile import Tensor

T = gguf.MODEL_TENSOR
_KINDS = {template: kind for kind, template in gguf.TENSOR_NAMES.items()}
COLUMN = {T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_QKV, T.ATTN_Q_B, T.FFN_GATE, T.FFN_UP, T.FFN_GATE_SHEXP}
COLUMN |= {T.FFN_UP_SHEXP, T.FFN_GATE_EXP, T.FFN_UP_EXP, T.OUTPUT}
ROW = {T.ATTN_OUT, T.FFN_DOWN, T.FFN_DOWN_SHEXP, T.FFN_DOWN_EXP}
HEADS = {T.ATTN_K_B, T.ATTN_V_B, T.ATTN_SINKS}
FIRST = "first"  # a row-parallel layer's bias: held by rank 0, zeros elsewhere, so the all-reduce adds it once


def tensor_kind(name: str) -> gguf.MODEL_TENSOR | None:
    """The GGUF kind of a tensor name (``blk.3.attn_q.weight`` -> ATTN_Q), None for a name GGUF does not list."""
    base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.rsplit(".", 1)[0])
    return _KINDS.get(base)


def split_of(name: str, ndim: int) -> int | str | None:
    """How tensor ``name`` of ``ndim`` axes is split over the ranks: the axis cut in N equal parts, :data:`FIRST`,
    or None (replicated)."""
    kind, bias = tensor_kind(name), name.endswith(".bias")
    if kind in COLUMN:
        return ndim - 1 if bias else ndim - 2  # [.., rows, k]: the rows; a bias [.., rows] likewise
    if kind in ROW:
        return FIRST if bias else ndim - 1
    if kind in HEADS:
        return 0
    return None


def shard(tensor: Tensor, axis: int, rank: int, ranks: int) -> Tensor:
    """Part ``rank`` of ``ranks`` of ``tensor`` along ``axis``, in its stored type (rows are independent blocks; a
    cut across a row must fall on the type's block boundaries)."""
    shape, block = tensor.shape, gguf.GGML_QUANT_SIZES[tensor.qtype][0]
    size, last = shape[axis], axis == len(shape) - 1
    part = size // ranks
    if size % ranks or (last and part % block):
        unit = f" in whole blocks of {block} ({tensor.qtype.name})" if last and block > 1 else ""
        raise LeatError(
            f"tensor {tensor.name} {list(shape)} does not split over {ranks} ranks along axis {axis}{unit}: "
            f"run it with a --tensor-parallel that divides {size // (block if last else 1)}"
        )
    data = np.asarray(tensor.data).reshape(*shape[:-1], shape[-1] // block, -1)  # the last axis in whole blocks
    step = part // block if last else part
    piece = np.ascontiguousarray(data[(slice(None),) * axis + (slice(rank * step, (rank + 1) * step),)])
    new = (*shape[:axis], part, *shape[axis + 1 :])
    return Tensor(tensor.name, tensor.qtype, new, piece.reshape(*new[:-1], -1))


def rank_tensors(tensors: Sequence[Tensor], ranks: int) -> list[Tensor]:
    """The tensors one rank holds of a file's ``tensors`` (their data not read: views of the right size), for stating
    per-rank memory without loading (``leat doctor``)."""
    out = []
    for t in tensors:
        axis = split_of(t.name, len(t.shape))
        if isinstance(axis, int):
            shape = (*t.shape[:axis], t.shape[axis] // ranks, *t.shape[axis + 1 :])
            t = Tensor(t.name, t.qtype, shape, np.broadcast_to(np.uint8(0), (t.nbytes // ranks,)))
        out.append(t)
    return out


def check_split(architecture: Any, file: Any, ranks: int) -> None:
    """A model (``file`` of the Architecture class ``architecture``) whose attention heads do not divide over
    ``ranks`` is refused before any weight is read."""
    params = architecture.checked_params(file)
    layouts, heads = architecture.kv_layouts(params), getattr(params, "heads", None)
    counts = {"query heads": heads} if isinstance(heads, int) else {}
    counts |= {f"KV heads (layer {i})": l.kv_heads for i, l in enumerate(layouts) if not l.latent}
    for what, count in counts.items():
        if count % ranks:
            fits = ", ".join(str(n) for n in range(1, count + 1) if count % n == 0)
            raise LeatError(
                f"{file.path.name}: {count} {what} do not split over --tensor-parallel {ranks}: each rank holds whole heads; "
                f"use one of {fits}"
            )


@dataclass
class Sharded:
    """An activation: one array per rank, the whole on each (``axis`` None) or split along ``axis`` in equal parts."""

    parts: list[Any]
    axis: int | None = None


@dataclass
class ShardedWeight:
    """An uploaded tensor: one handle per rank, split as :func:`split_of` says (None: replicated)."""

    name: str
    parts: list[Any]
    axis: int | str | None


@dataclass
class ShardedKV(KVPages):
    """The cache every rank holds part of: the page tables here (the engine's), each rank's own cache in ``ranks``."""

    ranks: list[KVPages] = field(default_factory=list)


class Collective:
    """The communication between ranks: both take one array per rank and give one per rank back."""

    def sum(self, parts: list[Any]) -> list[Any]:
        """The elementwise sum of every rank's array, on every rank (all-reduce)."""
        raise NotImplementedError

    def gather(self, parts: list[Any], axis: int) -> list[Any]:
        """Every rank's array concatenated along ``axis`` in rank order, on every rank (all-gather)."""
        raise NotImplementedError


class HostCollective(Collective):
    """Through the host: what CPU ranks (whose arrays are host memory already) and tests use."""

    def __init__(self, ranks: list[Backend]):
        self.ranks = ranks

    def _everywhere(self, whole: np.ndarray) -> list[Any]:
        return [rank.from_host(whole) for rank in self.ranks]

    def sum(self, parts: list[Any]) -> list[Any]:
        host = [rank.to_host(p) for rank, p in zip(self.ranks, parts, strict=True)]
        return self._everywhere(np.sum(host, axis=0))

    def gather(self, parts: list[Any], axis: int) -> list[Any]:
        host = [rank.to_host(p) for rank, p in zip(self.ranks, parts, strict=True)]
        return self._everywhere(np.concatenate(host, axis=axis))


class NcclCollective(Collective):
    """NCCL over N GPUs of one host (nvidia-nccl-cu13 or cuda-python's bindings): not written until it can run."""

    def __init__(self, ranks: list[Backend]):
        raise BackendUnavailable(
            f"tensor parallel over NCCL needs {len(ranks)} GPUs and is not written yet: no multi-GPU machine has run it"
        )


class TensorParallel(Backend):
    """N backends of one kind, presented as one (see the module's docstring)."""

    def __init__(self, ranks: list[Backend], collective: Collective | None = None, threads: bool = False):
        super().__init__(ranks[0].precision, **ranks[0].options)
        self.ranks, self.n = ranks, len(ranks)
        self.collective = collective or HostCollective(ranks)
        first = type(ranks[0])
        self.name = first.name  # type: ignore[misc]  # as the ranks', so that a draft model loads on the same kind
        self.quant_types, self.bidirectional = first.quant_types, first.bidirectional  # type: ignore[misc]
        self.prefill_tokens_per_step = first.prefill_tokens_per_step  # type: ignore[misc]
        self.warm_up_steps = first.warm_up_steps  # type: ignore[misc]
        self._pool = concurrent.futures.ThreadPoolExecutor(self.n, "leat-rank") if threads else None

    @classmethod
    def of(cls, backend: type[Backend], ranks: int, precision: str = "f32", **options: Any) -> TensorParallel:
        """``ranks`` backends of class ``backend``, rank r with ``device=r`` and 1/``ranks`` of the ``threads`` option
        (default: the cores); host backends' ranks run in threads."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, int(options.pop("threads", None) or cores) // ranks)
        made = [backend(precision=precision, **options, threads=threads, device=r) for r in range(ranks)]
        return cls(made, threads=backend.name == "cpu")

    def describe(self) -> dict[str, Any]:
        return self.ranks[0].describe() | {"tensor_parallel": self.n}

    def kv_budget_bytes(self) -> int:
        return min(rank.kv_budget_bytes() for rank in self.ranks) * self.n

    def _map(self, op: Callable[..., Any], *per_rank: Sequence[Any]) -> list[Any]:
        if self._pool is None:
            return list(map(op, self.ranks, *per_rank))
        return list(self._pool.map(op, self.ranks, *per_rank))

    def _tally(self) -> None:
        total = Allocations()
        for rank in self.ranks:
            for f in fields(Allocations):
                if f.name != "by_type":
                    setattr(total, f.name, getattr(total, f.name) + getattr(rank.allocations, f.name))
            for kind, count in rank.allocations.by_type.items():
                total.by_type[kind] = total.by_type.get(kind, 0) + count
        self.allocations = total

    # -- memory -------------------------------------------------------------------------------------
    def upload(self, tensor: Tensor) -> ShardedWeight:
        axis = split_of(tensor.name, len(tensor.shape))
        if axis is None:
            parts = self._map(lambda rank: rank.upload(tensor))
        elif axis == FIRST:
            zeros = Tensor(tensor.name, gguf.GGMLQuantizationType.F32, tensor.shape, np.zeros(tensor.shape, np.float32))
            parts = self._map(lambda rank, r: rank.upload(tensor if r == 0 else zeros), range(self.n))
        else:
            parts = self._map(lambda rank, r: rank.upload(shard(tensor, int(axis), r, self.n)), range(self.n))
        self._tally()
        return ShardedWeight(tensor.name, parts, axis)

    def allocate_kv(self, layouts, slots, context, pages=None, page_size=16, dtype="f32", groups=None) -> ShardedKV:
        own = [layout if layout.latent else _heads(layout, layout.kv_heads // self.n) for layout in layouts]
        ranks = self._map(lambda rank: rank.allocate_kv(own, slots, context, pages, page_size, dtype, groups))
        self._tally()
        return ShardedKV.create(layouts, slots, context, pages, page_size, groups, ranks=ranks)

    def set_pages(self, kv: Any, slot: int, pages: np.ndarray, group: int = 0) -> None:
        super().set_pages(kv, slot, pages, group)
        for rank, own in zip(self.ranks, kv.ranks, strict=True):
            rank.set_pages(own, slot, pages, group)

    def copy_page(self, kv: Any, source: int, target: int, group: int = 0) -> None:
        self._map(lambda rank, own: rank.copy_page(own, source, target, group), kv.ranks)

    def read_pages(self, kv: Any, pages: list[int], group: int = 0) -> list[np.ndarray]:
        return [a for part in self._map(lambda rank, own: rank.read_pages(own, pages, group), kv.ranks) for a in part]

    def write_pages(self, kv: Any, pages: list[int], contents: list[np.ndarray], group: int = 0) -> None:
        each = len(contents) // self.n  # every rank holds the same storages of its own heads
        mine = [contents[r * each : (r + 1) * each] for r in range(self.n)]
        self._map(lambda rank, own, part: rank.write_pages(own, pages, part, group), kv.ranks, mine)

    # -- activations ----------------------------------------------------------------------------------
    def whole(self, x: Sharded) -> list[Any]:
        """``x`` whole on every rank (gathered where it is split)."""
        return x.parts if x.axis is None else self.collective.gather(x.parts, x.axis)

    def _same(self, *xs: Sharded) -> tuple[list[list[Any]], int | None]:
        """The parts of ``xs`` split alike: as they are where they are, else every one whole."""
        if len({x.axis for x in xs}) == 1:
            return [x.parts for x in xs], xs[0].axis
        return [self.whole(x) for x in xs], None

    def _unsplit(self, x: Sharded) -> list[Any]:
        """``x``'s parts for an op that works along its last axis: the whole where that axis is split."""
        last = len(x.parts[0].shape) - 1
        return self.whole(x) if x.axis == last else x.parts

    def _replicated(self, weight: ShardedWeight | None, op: str) -> list[Any]:
        if weight is None:
            return [None] * self.n
        if weight.axis is not None:
            raise LeatError(f"tensor parallel: {op} takes {weight.name} whole, but it is split over the ranks")
        return weight.parts

    def to_host(self, x: Sharded) -> np.ndarray:
        return self.ranks[0].to_host(self.whole(x)[0])

    def from_host(self, x: np.ndarray) -> Sharded:
        return Sharded(self._map(lambda rank: rank.from_host(x)))

    def reshape(self, x: Sharded, shape: tuple[int, ...]) -> Sharded:
        if x.axis is None:
            return Sharded(self._map(lambda rank, p: rank.reshape(p, shape), x.parts))
        old = list(x.parts[0].shape)
        old[x.axis] *= self.n
        axis = _reshaped_axis(tuple(old), x.axis, shape, self.n)
        if axis is None:
            raise LeatError(
                f"tensor parallel: reshape of {old} split along axis {x.axis} to {list(shape)} splits no axis into "
                f"{self.n} whole parts (heads that do not divide over the ranks?)"
            )
        own = (*shape[:axis], shape[axis] // self.n, *shape[axis + 1 :])
        return Sharded(self._map(lambda rank, p: rank.reshape(p, own), x.parts), axis)

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, weight: ShardedWeight, tokens: np.ndarray) -> Sharded:
        self._replicated(weight, "embed")
        return Sharded(self._map(lambda rank, w: rank.embed(w, tokens), weight.parts))

    def matmul(self, x: Sharded, weight: ShardedWeight, bias: ShardedWeight | None = None) -> Sharded:
        b = bias.parts if bias is not None else [None] * self.n
        if weight.axis == 1:  # row-parallel: each rank's columns times its part of x, then the all-reduce
            if x.axis != len(x.parts[0].shape) - 1:
                raise LeatError(f"tensor parallel: {weight.name} takes an input split along its last axis")
            return Sharded(
                self.collective.sum(self._map(lambda r, p, w, c: r.matmul(p, w, c), x.parts, weight.parts, b))
            )
        xs = self.whole(x)
        y = self._map(lambda rank, p, w, c: rank.matmul(p, w, c), xs, weight.parts, b)
        return Sharded(y, None if weight.axis is None else len(x.parts[0].shape) - 1)

    def rms_norm(self, x: Sharded, weight: ShardedWeight | None, eps: float) -> Sharded:
        parts = self._unsplit(x)
        w = self._replicated(weight, "rms_norm")
        return Sharded(self._map(lambda rank, p, v: rank.rms_norm(p, v, eps), parts, w), _kept(x, parts))

    def layer_norm(self, x: Sharded, weight: ShardedWeight | None, bias: ShardedWeight | None, eps: float) -> Sharded:
        w, b = self._replicated(weight, "layer_norm"), self._replicated(bias, "layer_norm")
        parts = self._unsplit(x)
        return Sharded(self._map(lambda r, p, v, c: r.layer_norm(p, v, c, eps), parts, w, b), _kept(x, parts))

    def rope(self, x: Sharded, positions: np.ndarray, spec: Any) -> Sharded:
        parts = self._unsplit(x)
        return Sharded(self._map(lambda rank, p: rank.rope(p, positions, spec), parts), _kept(x, parts))

    def attention(self, q, k, v, kv: ShardedKV, layer, batch: Batch, scale, softcap=None, sinks=None) -> Sharded:
        if {q.axis, k.axis, v.axis} != {1}:
            raise LeatError("tensor parallel: attention takes q, k and v split by heads")
        s = sinks.parts if sinks is not None else [None] * self.n

        def attend(rank: Backend, q: Any, k: Any, v: Any, own: KVPages, sink: Any) -> Any:
            return rank.attention(q, k, v, own, layer, batch, scale, softcap, sink)

        return Sharded(self._map(attend, q.parts, k.parts, v.parts, kv.ranks, s), 1)

    def mla_attention(self, q_latent, q_rope, latent, k_rope, kv: ShardedKV, layer, batch: Batch, scale) -> Sharded:
        if {q_latent.axis, q_rope.axis} != {1}:
            raise LeatError("tensor parallel: mla_attention takes queries split by heads")
        lat, kr = self.whole(latent), self.whole(k_rope)

        def attend(rank: Backend, ql: Any, qr: Any, la: Any, k: Any, own: KVPages) -> Any:
            return rank.mla_attention(ql, qr, la, k, own, layer, batch, scale)

        return Sharded(self._map(attend, q_latent.parts, q_rope.parts, lat, kr, kv.ranks), 1)

    def head_matmul(self, x: Sharded, weight: ShardedWeight) -> Sharded:
        if weight.axis != 0 or x.axis != 1:
            raise LeatError(f"tensor parallel: head_matmul takes {weight.name} and its input split by heads")
        return Sharded(self._map(lambda rank, p, w: rank.head_matmul(p, w), x.parts, weight.parts), 1)

    def moe(self, x: Sharded, weights: Any, spec: Any) -> Sharded:
        xs, names = self.whole(x), [f.name for f in fields(weights)]
        per_rank = [
            type(weights)(**{n: getattr(weights, n) and getattr(weights, n).parts[r] for n in names})
            for r in range(self.n)
        ]
        return Sharded(self.collective.sum(self._map(lambda rank, p, w: rank.moe(p, w, spec), xs, per_rank)))

    def silu_mul(self, gate: Sharded, up: Sharded) -> Sharded:
        (g, u), axis = self._same(gate, up)
        return Sharded(self._map(lambda rank, a, b: rank.silu_mul(a, b), g, u), axis)

    def gelu_mul(self, gate: Sharded, up: Sharded | None = None) -> Sharded:
        if up is None:
            return Sharded(self._map(lambda rank, a: rank.gelu_mul(a), gate.parts), gate.axis)
        (g, u), axis = self._same(gate, up)
        return Sharded(self._map(lambda rank, a, b: rank.gelu_mul(a, b), g, u), axis)

    def add(self, a: Sharded, b: Sharded) -> Sharded:
        (x, y), axis = self._same(a, b)
        return Sharded(self._map(lambda rank, p, q: rank.add(p, q), x, y), axis)

    def take_rows(self, x: Sharded, index: np.ndarray) -> Sharded:
        parts = self.whole(x) if x.axis == 0 else x.parts
        return Sharded(self._map(lambda rank, p: rank.take_rows(p, index), parts), _kept(x, parts))

    def scale(self, x: Sharded, factor: float) -> Sharded:
        return Sharded(self._map(lambda rank, p: rank.scale(p, factor), x.parts), x.axis)

    def softcap(self, x: Sharded, cap: float) -> Sharded:
        return Sharded(self._map(lambda rank, p: rank.softcap(p, cap), x.parts), x.axis)


def _heads(layout: KVLayout, kv_heads: int) -> KVLayout:
    return KVLayout(kv_heads, layout.head_dim, layout.value_dim, layout.window, layout.latent)


def _kept(x: Sharded, parts: list[Any]) -> int | None:
    """``x``'s split axis if ``parts`` are still its parts, else None (they were gathered)."""
    return x.axis if parts is x.parts else None


def _reshaped_axis(shape: tuple[int, ...], axis: int, new: tuple[int, ...], ranks: int) -> int | None:
    """The axis of ``new`` that a split of ``shape`` along ``axis`` becomes: one whose leading dimensions hold as many
    elements as those before ``axis`` and that divides in ``ranks`` (each part the same contiguous run)."""
    outer = math.prod(shape[:axis])
    for b, size in enumerate(new):
        if math.prod(new[:b]) == outer and size % ranks == 0:
            return b
    return None
