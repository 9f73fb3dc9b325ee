"""Many-row float16 products (prefill chunks) as tinygrad kernels of our own: tiles staged through shared memory on
NVIDIA's tensor cores (:func:`staged_product`), else tinygrad's tensor-core kernel with optimisations chosen per shape.

**Staged** (:class:`Tiles`): a thread group computes a tile of the result (``Tiles.rows`` x ``Tiles.outputs``); for each
``Tiles.depth`` inputs its threads copy x's and w's slices into shared memory (16 bytes a thread and load), then each
warp multiplies its share from there with ``mma.sync`` (tinygrad's WMMA op, the m16n8k16 float16 shape, float32 sums),
its fragments read from shared memory in the layout the instruction wants. tinygrad's own tensor-core kernels read
every fragment from global memory; on the H100 the staged kernel took gate/up 4096 -> 14336 at 512 rows in 322.6 us
against 571.2 for the pinned opts below, down 14336 -> 4096 in 373.6 against 807.1 (issue #22; docs/benchmarks.md).
The same kernel with float32 x and w runs the tf32 m16n8k8 shape, which tinygrad's PYTHON device emulates on any
Python (float16 needs 3.12 there): the tests check the tiling there against float64.

**Pinned opts**: the kernel tinygrad builds for

``y[n, o] = sum_k x[n, k] * w[o, k]``, x and w float16, the sums float32: the kernel tinygrad builds for
``x.matmul(w.T, dtype=dtypes.float32)`` (the same ranges, numbered as tinygrad numbers them, and the same reduce of
the float16 products cast to float32), written as a UOp program (``Tensor.custom_kernel``) so that its
``KernelInfo(opts_to_apply=...)`` carries the optimisations (tinygrad's ``Opt``: tensor cores, upcasts, locals): tinygrad
applies those in place of its hand-coded heuristic (``apply_opts`` in tinygrad/codegen/opt/postrange.py). tinygrad
0.14 offers no other way to pin a kernel's optimisations: ``Tensor.contiguous(arg=opts)`` is dropped before
``apply_opts`` (the kernel gets the heuristic's). With no opts for a shape the product is tinygrad's own matmul.

The opts (:data:`TC_OPTS`) were found by tinygrad's beam search (``BEAM=2``) on the H200 for a 512-row chunk of the 8B
file's products (issue #22): gate/up 4096 -> 14336 575.7 us against the heuristic's 935.0, k/v 4096 -> 1024 98.1
against 281.6, q/o 4096 -> 4096 238.3 against 262.6. A product takes the set found for the output size nearest its
own (:func:`opts_for`); shapes they do not divide, too few rows, or other devices keep tinygrad's own (:func:`tuned_opts`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.codegen import full_rewrite_to_sink
from tinygrad.codegen.opt import KernelOptError, Opt, OptOps
from tinygrad.codegen.opt.tc import cuda_81616
from tinygrad.dtype import AddrSpace, DType
from tinygrad.renderer import Renderer
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

TC, UPCAST, LOCAL, SWAP = OptOps.TC, OptOps.UPCAST, OptOps.LOCAL, OptOps.SWAP
#: (largest output size, opts) in order: a product takes the first whose bound its output size is under (None: any);
#: the bounds lie halfway (in log) between the output sizes the opts were found for (1024, 4096, 14336)
TC_OPTS: tuple[tuple[int | None, tuple[Opt, ...]], ...] = (
    (2048, (Opt(TC, 0, (-1, 0, 1)), Opt(UPCAST, 1, 4), Opt(UPCAST, 0, 2), Opt(SWAP, 0, 1))),  # k/v: 1024 outputs
    (7680, (Opt(TC, 0, (-1, 2, 1)), Opt(UPCAST, 1, 4), Opt(UPCAST, 0, 4))),  # q/o: 4096
    (None, (Opt(TC, 0, (-1, 2, 1)), Opt(UPCAST, 1, 7), Opt(UPCAST, 0, 4), Opt(LOCAL, 0, 8))),  # gate/up: 14336
)
#: the opts were found for 512-row chunks; products with fewer rows keep tinygrad's own choice
MIN_ROWS = 256


def _kernel(rows: int, outputs: int, inputs: int, opts: tuple[Opt, ...] | None):
    def fxn(out: UOp, x: UOp, w: UOp) -> UOp:
        # numbered as tinygrad's scheduler numbers a matmul's ranges (the reduce first): the opts' axes refer to them
        k, n, o = UOp.range(inputs, 0, AxisType.REDUCE), UOp.range(rows, 1), UOp.range(outputs, 2)
        total = (x[n, k] * w[o, k]).cast(dtypes.float32).reduce(k, arg=Ops.ADD)
        return out[n, o].store(total).end(n, o).sink(arg=KernelInfo(opts_to_apply=opts))

    return fxn


def opts_for(outputs: int) -> tuple[Opt, ...]:
    """The opts of :data:`TC_OPTS` for a product of ``outputs`` outputs."""
    return next(opts for bound, opts in TC_OPTS if bound is None or outputs < bound)


def applies(renderer: Renderer, rows: int, outputs: int, inputs: int, opts: tuple[Opt, ...]) -> bool:
    """Whether tinygrad can apply ``opts`` to the product of this shape with ``renderer`` (tensor cores there, sizes
    they divide): the kernel is taken through tinygrad's optimisation passes (no compiling), as its realize would;
    tinygrad raises KernelOptError on an opt that does not apply."""
    out, half = UOp.placeholder((rows, outputs), dtypes.float32, 0), dtypes.float16
    params = (out, UOp.placeholder((rows, inputs), half, 1), UOp.placeholder((outputs, inputs), half, 2))
    try:
        full_rewrite_to_sink(_kernel(rows, outputs, inputs, opts)(*params), renderer)
    except KernelOptError:
        return False
    return True


@functools.cache
def tuned_opts(renderer: Renderer, rows: int, outputs: int, inputs: int) -> tuple[Opt, ...] | None:
    """The opts of :data:`TC_OPTS` for a product of this shape, or None (tinygrad's own choice): a renderer without
    NVIDIA's sm_80+ float16 tensor cores (the opts were found on the H200 with them), fewer than MIN_ROWS rows, or
    opts tinygrad cannot apply to the shape."""
    if cuda_81616[0] not in renderer.tensor_cores or rows < MIN_ROWS:
        return None
    opts = opts_for(outputs)
    return opts if applies(renderer, rows, outputs, inputs, opts) else None


def half_product(x: Tensor, w: Tensor, opts: tuple[Opt, ...] | None = None) -> Tensor:
    """float32 [rows, outputs] = x [rows, inputs] @ w.T, x and w float16 (contiguous), as one kernel with ``opts``
    applied (None: tinygrad's own matmul, the same kernel with its heuristic's)."""
    if opts is None:
        return x.matmul(w.T, dtype=dtypes.float32).contiguous()
    (rows, inputs), outputs = x.shape, w.shape[0]
    out = Tensor.empty(rows, outputs, dtype=dtypes.float32, device=x.device)
    return out.custom_kernel(x, w, fxn=_kernel(rows, outputs, inputs, opts))[0]


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A thread group's share of a staged product: a ``rows`` x ``outputs`` tile of the result, summed over ``depth``
    inputs at a time through shared memory by ``warp_rows`` x ``warp_outputs`` warps, each a (rows / warp_rows) x
    (outputs / warp_outputs) tile of 16 x 8 tensor-core products."""

    rows: int = 64
    outputs: int = 128
    depth: int = 64
    warp_rows: int = 2
    warp_outputs: int = 4
    pad: int = 8  # entries a shared row is longer than depth: a fragment's 8 rows fall on different banks

    @property
    def threads(self) -> int:
        return 32 * self.warp_rows * self.warp_outputs

    def shared_bytes(self, kind: DType) -> int:
        return (self.rows + self.outputs) * (self.depth + self.pad) * kind.itemsize


#: per tensor-core shape (tinygrad's dims: N, M, K): the inputs a lane's t (lane % 4) steps by, then a's elements as
#: (block of 8 rows, input offset) and b's as input offsets, in the order mma.sync takes them (PTX ISA, "Matrix
#: Fragments for mma.m16n8k16" and "mma.m16n8k8" tf32); a lane's row (or output) within 8 is its g (lane // 4). The
#: results' four elements are (8 * (e // 2) + g, 2 * t + e % 2) for both.
FRAGMENTS: dict[tuple[int, int, int], tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]] = {
    (8, 16, 16): (2, ((0, 0), (0, 1), (1, 0), (1, 1), (0, 8), (0, 9), (1, 8), (1, 9)), (0, 1, 8, 9)),
    (8, 16, 8): (1, ((0, 0), (1, 0), (0, 4), (1, 4)), (0, 4)),
}
#: the tiles a product takes, by output size (the first whose bound its output size is under; None: any). Chosen on
#: the H100 at a 512-row chunk of the 8B file's products (docs/benchmarks.md)
TILES: tuple[tuple[int | None, Tiles], ...] = ((8192, Tiles(64, 128, 64, 2, 4)), (None, Tiles(128, 128, 64, 2, 4)))
MIN_STAGED_ROWS = 64  # fewer rows waste most of a tile: tinygrad's kernel (or the opts above) takes them
SHARED_LIMIT = 48 * 1024  # tinygrad declares shared memory statically: at most 48 KB a thread group


def tensor_core(renderer: Renderer, kind: DType):
    """The renderer's tensor core of :data:`FRAGMENTS`' shapes taking ``kind`` inputs and float32 sums, or None."""
    return next(
        (
            tc
            for tc in renderer.tensor_cores
            if tc.dims in FRAGMENTS and tc.dtype_in == kind and tc.dtype_out == dtypes.float32
        ),
        None,
    )


def tiles_for(renderer: Renderer, rows: int, outputs: int, inputs: int, kind: DType = dtypes.float16) -> Tiles | None:
    """The :data:`TILES` for a product of this shape, or None (the product is not staged): no NVIDIA tensor core for
    ``kind`` (tinygrad's AMD ones lay their fragments out otherwise), fewer than MIN_STAGED_ROWS rows, or a tile the
    outputs or inputs do not divide. Rows need not divide: the last tile's extra rows are computed and not stored."""
    if tensor_core(renderer, kind) is None or renderer.target.device not in ("CUDA", "NV") or rows < MIN_STAGED_ROWS:
        return None
    tiles = next(tiles for bound, tiles in TILES if bound is None or outputs < bound)
    return tiles if fits(tiles, outputs, inputs, kind) else None


def fits(tiles: Tiles, outputs: int, inputs: int, kind: DType) -> bool:
    """Whether a staged product of these outputs and inputs can take ``tiles``."""
    copy = 16 // kind.itemsize  # entries a 16-byte copy moves
    return (
        outputs % tiles.outputs == 0
        and inputs % tiles.depth == 0
        and tiles.depth % max(copy, 16) == 0
        and tiles.rows % (16 * tiles.warp_rows) == 0
        and tiles.outputs % (8 * tiles.warp_outputs) == 0
        and tiles.depth % (4 * copy) == 0  # a row's copies come in fours (a lane's t)
        and all(size % (8 * tiles.threads // 32) == 0 for size in (tiles.rows, tiles.outputs))  # rows in eights a warp
        and tiles.shared_bytes(kind) <= SHARED_LIMIT
    )


def _staged_kernel(
    rows: int, outputs: int, inputs: int, tiles: Tiles, kind: DType, dims: tuple[int, int, int], device: str
):
    step, a_elements, b_elements = FRAGMENTS[dims]
    tm, tn = tiles.rows // tiles.warp_rows // 16, tiles.outputs // tiles.warp_outputs // 8  # mma tiles a warp
    stride = tiles.depth + tiles.pad
    copy = 16 // kind.itemsize
    per_row = tiles.depth // copy  # copies a tile row takes
    zero = UOp.const((0.0,) * 4, dtypes.float32)

    def fxn(out: UOp, x: UOp, w: UOp) -> UOp:
        block_rows = UOp.range(-(-rows // tiles.rows), 0, AxisType.GLOBAL)
        block_outputs = UOp.range(outputs // tiles.outputs, 1, AxisType.GLOBAL)
        # a lane is t + 4 g (the fragments' layout). tinygrad gives its lowest-numbered local range threadIdx.x, and
        # past three local ranges merges the first two with the second the faster: numbered so that t is the fastest
        four = tiles.warp_rows > 1 and tiles.warp_outputs > 1
        t, g = UOp.range(4, 3 if four else 2, AxisType.LOCAL), UOp.range(8, 2 if four else 3, AxisType.LOCAL)
        wr = UOp.range(tiles.warp_rows, 4, AxisType.LOCAL) if tiles.warp_rows > 1 else UOp.const(0)
        wo = UOp.range(tiles.warp_outputs, 5, AxisType.LOCAL) if tiles.warp_outputs > 1 else UOp.const(0)
        depth = UOp.range(inputs // tiles.depth, 6, AxisType.REDUCE)
        warp, warps = wr * tiles.warp_outputs + wo, tiles.warp_rows * tiles.warp_outputs
        shared_x = UOp.placeholder((tiles.rows * stride,), kind, 900, AddrSpace.LOCAL)
        shared_w = UOp.placeholder((tiles.outputs * stride,), kind, 901, AddrSpace.LOCAL)
        entry = UOp.range(copy, 7, AxisType.UPCAST)
        copies = []
        # a copy's row is g + 8 warp (+ a pass's rows), its 16 bytes the t-th (+ 4 a pass) of the row: no division
        # of g or t, which tinygrad would split into ranges of their own (and its lanes out of the fragments' order)
        for shared, source, first, size, last in (
            (shared_x, x, block_rows * tiles.rows, tiles.rows, rows - 1 if rows % tiles.rows else None),
            (shared_w, w, block_outputs * tiles.outputs, tiles.outputs, None),
        ):
            for i, j in itertools.product(range(size // (8 * warps)), range(per_row // 4)):
                r, column = g + 8 * warp + 8 * warps * i, (t + 4 * j) * copy + entry
                row = first + r if last is None else (first + r).minimum(last)  # past the last row: its copy again
                copies.append(shared.index(r * stride + column).store(source[row, depth * tiles.depth + column]))
        copied = UOp.group(*copies).end(entry)
        staged_x, staged_w = shared_x.after(copied), shared_w.after(copied)
        inner = UOp.range(tiles.depth // dims[2], 8, AxisType.REDUCE)
        row0, output0 = wr * (tiles.rows // tiles.warp_rows), wo * (tiles.outputs // tiles.warp_outputs)
        k0 = inner * dims[2] + step * t
        a = [
            UOp.stack(*[staged_x.index((row0 + 16 * i + 8 * r8 + g) * stride + k0 + dk) for r8, dk in a_elements])
            for i in range(tm)
        ]
        b = [
            UOp.stack(*[staged_w.index((output0 + 8 * n + g) * stride + k0 + dk) for dk in b_elements])
            for n in range(tn)
        ]
        stores = []
        for i in range(tm):
            for n in range(tn):
                total = UOp.wmma(a[i], b[n], zero, dims, device, 32).reduce(depth, inner, arg=Ops.ADD)
                for e in range(4):
                    row = block_rows * tiles.rows + row0 + 16 * i + 8 * (e // 2) + g
                    column = block_outputs * tiles.outputs + output0 + 8 * n + 2 * t + e % 2
                    stores.append(out[row if rows % tiles.rows == 0 else row.valid(row < rows), column].store(total[e]))
        ranges = [r for r in (block_rows, block_outputs, t, g, wr, wo) if r.op is Ops.RANGE]
        name = f"staged_{rows}_{outputs}_{inputs}"
        return UOp.group(*stores).end(*ranges).sink(arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn


def staged_product(x: Tensor, w: Tensor, tiles: Tiles) -> Tensor:
    """float32 [rows, outputs] = x [rows, inputs] @ w.T, x and w float16 (or float32: tf32 products) and contiguous,
    as one staged kernel of ``tiles`` (:func:`tiles_for` says which a shape takes; :func:`fits` whether it can)."""
    (rows, inputs), outputs = x.shape, w.shape[0]
    renderer = Device[x.device].renderer
    core = tensor_core(renderer, x.dtype)
    if core is None or not fits(tiles, outputs, inputs, x.dtype):
        raise ValueError(f"no staged product of {x.dtype} {rows}x{inputs} @ {outputs}x{inputs} with {tiles} here")
    out = Tensor.empty(rows, outputs, dtype=dtypes.float32, device=x.device)
    fxn = _staged_kernel(rows, outputs, inputs, tiles, x.dtype, core.dims, renderer.target.device)
    return out.custom_kernel(x, w, fxn=fxn)[0]
