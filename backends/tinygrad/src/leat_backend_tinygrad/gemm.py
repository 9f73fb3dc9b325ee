"""Many-row float16 products (prefill chunks) as tinygrad kernels of our own: tiles staged through shared memory on
NVIDIA's tensor cores (:func:`staged_product`), else tinygrad's tensor-core kernel with optimisations chosen per shape.

**Staged** (:class:`Tiles`): a thread group computes a tile of the result (``Tiles.rows`` x ``Tiles.outputs``); for each
``Tiles.depth`` inputs its threads copy x's and w's slices into shared memory (16 bytes a copy), then each warp
multiplies its share from there with ``mma.sync`` (tinygrad's WMMA op, the m16n8k16 float16 shape, float32 sums).
A sum over k does not care which inputs a lane's fragment entries are, as long as a's and b's agree: each lane takes
its quarter of a slice's row, and x's rows g and g + 8 of an mma tile lie interleaved a word at a time, so a
fragment of a is one 16-byte read of shared memory, already in its registers' order, and b's of two mma.sync one
(``Tiles.runs``; :data:`A_WORDS`). Read 4 bytes at a time in PTX's order instead, the H100's profile of the gate/up
product showed 44% of a warp's time waiting on the queue of shared-memory instructions. With two stages a step
multiplies one slice while its loads of the next are in flight, and stores them into the other stage after its
products (one barrier a step); with three (``ring.py``) x and w go into a ring of shared stages by asynchronous
copies two steps ahead. tinygrad's own tensor-core kernels read every fragment from global memory; on the
H100, four products of a 512-row chunk a replay, the chosen tiles took gate/up 4096 -> 14336 283.1 us against 572.5
for the pinned opts below, down 14336 -> 4096 281.3 against 987.8, q/o 114.3 against 292.8 (issue #22;
docs/benchmarks.md). The same kernel with float32 x and w runs the tf32 m16n8k8 shape, which tinygrad's PYTHON
device emulates on any Python (float16 needs 3.12 there): the tests check the tiling there against float64.

**Pinned opts**: ``y[n, o] = sum_k x[n, k] * w[o, k]``, x and w float16, the sums float32: the kernel tinygrad builds for
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
from tinygrad.codegen.opt.tc import TensorCore, cuda_8168_tf32, cuda_81616
from tinygrad.dtype import AddrSpace, DType
from tinygrad.renderer import Renderer
from tinygrad.renderer.cstyle import CUDARenderer
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from leat_backend_tinygrad import ring

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
    #: entries a shared row is longer than its slice (None: :meth:`strides`' choice)
    pad: int | None = None
    #: slices in shared memory: 2 multiplies one while the next one's loads are in flight; 3 is ring.py's kernel (its
    #: copies asynchronous, two steps ahead)
    stages: int = 1
    #: the fragments read 16 bytes at a time in the registers' order (:data:`A_WORDS`); False: in PTX's order of the
    #: inputs, 4 bytes at a time (more shared-memory reads; kept for comparison)
    runs: bool = True
    #: parts the inputs are split into (ring.py's kernel only): a thread group sums one part, the parts' results are
    #: summed after (more thread groups where a product's tiles are fewer than the multiprocessors can hold)
    split: int = 1

    @classmethod
    def parse(cls, text: str) -> Tiles:
        """Tiles from "rows,outputs,depth,warp_rows,warp_outputs[,pad,stages,runs,split]" (LEAT_TINYGRAD_TILES; pad ""
        or "auto": :meth:`strides`' choice; runs 0 or 1)."""
        values = [v.strip() for v in text.split(",")]
        sizes = [int(v) for v in values[:5]]
        pad = None if len(values) < 6 or values[5] in ("", "auto") else int(values[5])
        stages = int(values[6]) if len(values) > 6 else 1
        runs = values[7] != "0" if len(values) > 7 else True
        return cls(*sizes, pad=pad, stages=stages, runs=runs, split=int(values[8]) if len(values) > 8 else 1)

    @property
    def threads(self) -> int:
        return 32 * self.warp_rows * self.warp_outputs

    def strides(self, kind: DType) -> tuple[int, int]:
        """Entries from one shared row to the next: x's (with ``runs`` a row holds two of x's rows, g and g + 8 of
        an mma tile, interleaved a word at a time) and w's. Unless ``pad`` says, each row is padded by the fewest
        16-byte units that put a quarter-warp's first 16-byte fragment reads (rows g and g + 1, lanes t) on the most
        distinct banks."""
        units = self.depth * kind.itemsize // 16  # 16-byte units of a row's slice
        if not self.runs:
            pad = 8 if self.pad is None else self.pad
            return self.depth + pad, self.depth + pad
        per_unit = 16 // kind.itemsize

        def padded(row: int, lane: int) -> int:  # a row of ``row`` units, a lane's reads ``lane`` units apart
            if self.pad is not None:
                return row * per_unit + self.pad
            return (row + min(range(8), key=lambda extra: _clashes(row + extra, lane))) * per_unit

        return padded(2 * units, units // 2), padded(units, units // 4)

    def shared_bytes(self, kind: DType) -> int:
        if self.stages == ring.STAGES:
            return ring.shared_bytes(self, kind)
        x_stride, w_stride = self.strides(kind)
        x_rows = self.rows // 2 if self.runs else self.rows
        return self.stages * (x_rows * x_stride + self.outputs * w_stride) * kind.itemsize


def _clashes(row: int, lane: int) -> int:
    """The most of a quarter-warp's 16-byte reads on one group of banks: lanes t = 0..3 of rows g and g + 1 reading
    unit ``t * lane`` of rows ``row`` units long."""
    at = [(g * row + t * lane) % 8 for g in (0, 1) for t in range(4)]
    return max(at.count(unit) for unit in at)


#: a lane's 32-bit words of one row that one mma.sync takes (float16, m16n8k16: four entries; tf32, m16n8k8: two)
WORDS = 2
#: a's registers in mma.sync's order as (row g or g + 8, word); b's are words 0 and 1 of its row. Which inputs (k) a
#: lane's words hold does not matter to a sum over k as long as a and b agree: with ``Tiles.runs`` lane t (lane % 4)
#: takes the t-th quarter of each slice's row, WORDS words a product, and x's rows g and g + 8 lie interleaved a word
#: at a time, so an mma's a is one 16-byte read and b half of one (PTX ISA's "Matrix Fragments" layouts, k renumbered;
#: the results' four elements are (8 * (e // 2) + g, 2 * t + e % 2), g = lane // 4)
A_WORDS = ((0, 0), (1, 0), (0, 1), (1, 1))
#: the tiles a product takes: the first whose bound its output size is under (None: any) and that fits it (gemm.fits:
#: the ring's take float16 only). Chosen on the H100 at a 512-row chunk of the 8B file's products
#: (`scripts/tinygrad_gemm_times.py --staged --tiles ...`; docs/benchmarks.md): ring.py's 128 x 128 tiles of four
#: warps (64 x 64 results each) for every shape, e.g. gate/up 221 us against the two-stage kernel's 304, qkv 113
#: against 133 (q/o 113 against 108 and k/v 110 against 106 alone, its interleave of x included: the 8B file's o is
#: the one such product a layer runs); the two-stage kernels for float32 (tf32)
TILES: tuple[tuple[int | None, Tiles], ...] = (
    (None, Tiles(128, 128, 32, 2, 2, pad=0, stages=3)),
    (7680, Tiles(128, 128, 32, 2, 4, stages=2)),
    (None, Tiles(128, 128, 32, 2, 2, stages=2)),
)
#: products of one x are staged as one (TinygradBackend.matmuls) while their outputs together are at most this: the 8B
#: file's q, k and v (6144 outputs, 512 rows: 130 us as one against 91.5 + 2 x 78 apart, H100), not its gate and up
#: (28672: 583 us as one against 2 x 274: each alone already fills the multiprocessors)
JOINED_OUTPUTS = 8192
#: a product of the ring's tiles (split 1) in fewer thread groups than this sums its inputs in parts (Tiles.split): the
#: fewest of SPLITS that reach it and the inputs divide (0: never split). An H100's or H200's 132 multiprocessors, each
#: holding two of the ring's 128-thread groups (212 registers a thread): the 8B file's o and down (128 groups at 512
#: rows) split in two, q, k and v (192) and gate and up (448) not. On the H100, in one call: down 206 us against 268,
#: o 107 against 109, pp512 +11% (q, k and v split too: 161 us against 112, and pp512 +7%; docs/benchmarks.md)
SPLIT_GROUPS = 132
SPLITS = (2, 4)
MIN_STAGED_ROWS = 64  # fewer rows waste most of a tile: tinygrad's kernel (or the opts above) takes them
SHARED_LIMIT = 48 * 1024  # tinygrad declares shared memory statically: at most 48 KB a thread group


def tensor_core(renderer: Renderer, kind: DType) -> TensorCore | None:
    """The renderer's NVIDIA tensor core (m16n8k16 float16, m16n8k8 tf32: the shapes :data:`A_WORDS` lays out)
    taking ``kind`` inputs and float32 sums, or None (other devices' tensor cores lay their fragments out otherwise)."""
    nvidia = (*cuda_81616, *cuda_8168_tf32)
    return next(
        (tc for tc in renderer.tensor_cores if tc in nvidia and tc.dtype_in == kind and tc.dtype_out == dtypes.float32),
        None,
    )


def tiles_for(
    renderer: Renderer,
    rows: int,
    outputs: int,
    inputs: int,
    kind: DType = dtypes.float16,
    chosen: Tiles | None = None,
    split_groups: int = SPLIT_GROUPS,
) -> Tiles | None:
    """The :data:`TILES` (or ``chosen``) for a product of this shape, or None (the product is not staged): no NVIDIA
    tensor core for ``kind`` (:func:`tensor_core`), fewer than MIN_STAGED_ROWS rows,
    or a tile the outputs or inputs do not divide. Rows need not divide: the last tile's extra rows repeat the last
    row and store its result over it again (the same values). :data:`TILES`' ring tiles are split while the product
    has fewer than ``split_groups`` thread groups (:data:`SPLIT_GROUPS`); ``chosen`` tiles are taken as they are."""
    if tensor_core(renderer, kind) is None or rows < MIN_STAGED_ROWS:
        return None
    if chosen is not None:
        return chosen if fits(chosen, outputs, inputs, kind) else None
    under = (tiles for bound, tiles in TILES if bound is None or outputs < bound)
    tiles = next((tiles for tiles in under if fits(tiles, outputs, inputs, kind)), None)
    if tiles is None or tiles.stages != ring.STAGES or tiles.split != 1:
        return tiles
    groups = -(-rows // tiles.rows) * (outputs // tiles.outputs)
    if groups >= split_groups:
        return tiles
    fitting = [part for n in SPLITS if fits(part := dataclasses.replace(tiles, split=n), outputs, inputs, kind)]
    return next((part for part in fitting if groups * part.split >= split_groups), fitting[-1] if fitting else tiles)


def fits(tiles: Tiles, outputs: int, inputs: int, kind: DType) -> bool:
    """Whether a staged product of these outputs and inputs can take ``tiles`` (any number of rows can)."""
    copy = 16 // kind.itemsize  # entries a 16-byte copy moves
    return (
        tiles.stages in (1, 2, ring.STAGES)
        and (tiles.stages < ring.STAGES or ring.fits(tiles, kind))
        and outputs % tiles.outputs == 0
        and inputs % (tiles.depth * tiles.split) == 0
        and (tiles.split == 1 or tiles.stages == ring.STAGES)
        and tiles.rows % (16 * tiles.warp_rows) == 0
        and tiles.outputs % (8 * tiles.warp_outputs) == 0
        and tiles.depth % (4 * copy) == 0  # a row's copies come in fours (a lane's t); so 16 (tf32: 8) divides it
        and all(stride * kind.itemsize % 16 == 0 for stride in tiles.strides(kind))  # rows start on 16 bytes
        and all(size % (8 * tiles.threads // 32) == 0 for size in (tiles.rows, tiles.outputs))  # rows in eights a warp
        and (not tiles.runs or tiles.rows % (16 * tiles.threads // 32) == 0)  # x's pairs of rows in eights a warp
        and tiles.shared_bytes(kind) <= SHARED_LIMIT
    )


def _staged_kernel(
    rows: int, outputs: int, inputs: int, tiles: Tiles, kind: DType, dims: tuple[int, int, int], device: str
):
    per_word, copy = 4 // kind.itemsize, 16 // kind.itemsize  # entries a 32-bit word holds, a 16-byte copy moves
    tm, tn = tiles.rows // tiles.warp_rows // 16, tiles.outputs // tiles.warp_outputs // 8  # mma tiles a warp
    (x_stride, w_stride), steps = tiles.strides(kind), inputs // tiles.depth
    per_row, run = tiles.depth // copy, tiles.depth // 4  # a row's copies; a lane's run (the row's t-th quarter)
    x_rows = tiles.rows // 2 if tiles.runs else tiles.rows  # shared rows of x (with runs: pairs of x's rows)
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
        warp, warps = wr * tiles.warp_outputs + wo, tiles.warp_rows * tiles.warp_outputs
        shared_x = UOp.placeholder((tiles.stages * x_rows * x_stride,), kind, 900, AddrSpace.LOCAL)
        shared_w = UOp.placeholder((tiles.stages * tiles.outputs * w_stride,), kind, 901, AddrSpace.LOCAL)
        first_row, last_row = block_rows * tiles.rows, rows - 1 if rows % tiles.rows else None

        def x_row(r: UOp) -> UOp:
            """x's row of the tile's row ``r``: past the last row, the last again (its result stored there again)."""
            return first_row + r if last_row is None else (first_row + r).minimum(last_row)

        def copies(at_step: UOp, stage: UOp | int, entry_axis: int, x_to: UOp, w_to: UOp) -> UOp:
            """Step ``at_step``'s slices of x and w into shared stage ``stage``: a copy's row is g + 8 warp (+ a
            pass's rows), its 16 bytes the t-th (+ 4 a pass) of the row; no division of g or t, which tinygrad
            would split into ranges of their own (and the lanes out of the fragments' order). With ``runs`` a
            thread copies its quarter of x's rows g and g + 8 of an mma tile, interleaved a word at a time."""
            entry, made = UOp.range(copy, entry_axis, AxisType.UPCAST), []
            inputs_at = at_step * tiles.depth
            parts = [(w_to, w, block_outputs * tiles.outputs, tiles.outputs, w_stride)]
            if not tiles.runs:
                parts.append((x_to, x, None, tiles.rows, x_stride))
            for shared, source, first, size, stride in parts:
                for i, j in itertools.product(range(size // (8 * warps)), range(per_row // 4)):
                    r, column = g + 8 * warp + 8 * warps * i, (t + 4 * j) * copy + entry
                    row = x_row(r) if first is None else first + r
                    at = (stage * size + r) * stride + column
                    made.append(shared.index(at).store(source[row, inputs_at + column]))
            if tiles.runs:
                for i in range(x_rows // (8 * warps)):
                    block = warp + warps * i  # the pair's mma tile of 16 rows
                    pair = stage * x_rows + 8 * block + g
                    for h in (0, 1):  # rows g and g + 8 of the tile
                        row = x_row(16 * block + 8 * h + g)
                        for word in range(run // per_word):
                            at = pair * x_stride + 2 * t * run + (word // 2 * 4 + word % 2 * 2 + h) * per_word
                            source_at = inputs_at + t * run + word * per_word
                            made += [x_to.index(at + e).store(x[row, source_at + e]) for e in range(per_word)]
            return UOp.group(*made).end(entry)

        row0, output0 = wr * (tiles.rows // tiles.warp_rows), wo * (tiles.outputs // tiles.warp_outputs)
        keys = list(itertools.product(range(tm), range(tn)))  # the warp's mma tiles

        def held(sums: UOp) -> dict:
            """Each mma tile's four sums as kept in ``sums`` (registers)."""
            return {(i, n): UOp.stack(*[sums.index((i * tn + n) * 4 + e) for e in range(4)]) for i, n in keys}

        def products(staged_x: UOp, staged_w: UOp, stage: UOp | int, inner: int, sums: dict) -> dict:
            """Each of the warp's mma tiles' sums after the ``inner``-th mma.sync of the staged slices: the lane's
            WORDS words from ``inner * WORDS`` of its run (t-th quarter) of each row."""
            aw = stage * tiles.outputs + output0 + g
            if tiles.runs:  # the lane's run: a row's t-th quarter, WORDS words a product (x's rows interleaved)
                start, size = t * run + inner * WORDS * per_word, WORDS * per_word
                pairs = [(stage * x_rows + row0 // 2 + 8 * i + g) * x_stride + 2 * start for i in range(tm)]
                a = [UOp.stack(*[staged_x.index(at + e) for e in range(2 * size)]) for at in pairs]
                b = [
                    UOp.stack(*[staged_w.index((aw + 8 * n) * w_stride + start + e) for e in range(size)])
                    for n in range(tn)
                ]
            else:  # PTX's order: the lane's words t and t + 4 of the product's inputs

                def word(shared: UOp, row: UOp, j: int) -> list[UOp]:
                    start = inner * dims[2] + t * per_word + j * dims[2] // 2
                    return [shared.index(row * x_stride + start + e) for e in range(per_word)]

                ax = stage * tiles.rows + row0 + g
                a = [
                    UOp.stack(*[e for r8, j in A_WORDS for e in word(staged_x, ax + 16 * i + 8 * r8, j)])
                    for i in range(tm)
                ]
                b = [UOp.stack(*[e for j in range(WORDS) for e in word(staged_w, aw + 8 * n, j)]) for n in range(tn)]
            return {(i, n): UOp.wmma(a[i], b[n], sums[i, n], dims, device, 32) for i, n in keys}

        mmas = tiles.depth // dims[2]  # mma.sync a depth step (each WORDS words of a lane's run)
        if tiles.stages == 1:
            # each step: copy, barrier, multiply, barrier (tinygrad adds both: the copies' AFTER, the loop's reuse)
            depth = UOp.range(steps, 6, AxisType.REDUCE)
            copied = copies(depth, 0, 7, shared_x, shared_w)
            now = dict.fromkeys(keys, zero)
            for inner in range(mmas):
                now = products(shared_x.after(copied), shared_w.after(copied), 0, inner, now)
            totals = {key: value.reduce(depth, arg=Ops.ADD) for key, value in now.items()}
        else:
            # two stages: step d multiplies stage d % 2 while its loads of step d + 1 are in flight, then stores them
            # into the other stage; one barrier a step. The sums live in registers of our own across the loop
            # (tinygrad's reduce could not hold the copies inside its loop)
            sums = UOp.placeholder((tm * tn * 4,), dtypes.float32, 902, AddrSpace.REG)
            zeroed = UOp.group(*[sums.after(t).index(i).store(0.0) for i in range(tm * tn * 4)])
            fence = UOp(Ops.BARRIER, src=(copies(UOp.const(0), 0, 7, shared_x, shared_w),))
            staged_x, staged_w = shared_x.after(fence), shared_w.after(fence)
            depth = UOp.range(steps, 6, AxisType.LOOP)
            summed = sums.after(zeroed, depth)
            now = held(summed)
            for inner in range(mmas):
                now = products(staged_x, staged_w, depth % 2, inner, now)
            kept = [summed.index((i * tn + n) * 4 + e).store(v[e]) for (i, n), v in now.items() for e in range(4)]
            done = tuple(now.values())  # the next step's stores wait for this step's products (no barrier between)
            ahead = copies(
                (depth + 1).minimum(steps - 1), 1 - depth % 2, 9, shared_x.after(*done), shared_w.after(*done)
            )
            looped = sums.after(UOp(Ops.BARRIER, src=(UOp.group(*kept, ahead),)).end(depth))
            totals = held(looped)
        stores = []
        for (i, n), total in totals.items():
            for e in range(4):
                row = block_rows * tiles.rows + row0 + 16 * i + 8 * (e // 2) + g
                column = block_outputs * tiles.outputs + output0 + 8 * n + 2 * t + e % 2
                # a row past the last stores the last row's result again (its x rows are the last row's copies):
                # tinygrad 0.14 drops a store's gate where it can solve it for a thread group's index (one warp of rows)
                stores.append(out[row if rows % tiles.rows == 0 else row.minimum(rows - 1), column].store(total[e]))
        ranges = [r for r in (block_rows, block_outputs, t, g, wr, wo) if r.op is Ops.RANGE]
        name = f"staged{tiles.stages}_{rows}_{outputs}_{inputs}"
        return UOp.group(*stores).end(*ranges).sink(arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn


def laid_out(x: Tensor, tiles: Tiles, kind: DType, up: Tensor | None = None) -> Tensor:
    """x as the staged kernel of ``tiles`` reads it, in ``kind`` (the weight's type): for ring.py's, interleaved and its
    rows padded to the tile, cast as it is laid out (a kernel of its own, which products of one x can share:
    :func:`staged_product`'s ``laid``); else cast to ``kind``, contiguous. With ``up``: silu(x) * up so laid out (in
    ring.py's kernel, or tinygrad's for the cast)."""
    if tiles.stages == ring.STAGES:
        return ring.interleaved(x, tiles.depth, -(-x.shape[0] // tiles.rows) * tiles.rows, kind, up)
    x = x if up is None else x.silu() * up
    return x.cast(kind).contiguous()  # (no kernel where x is already that, realized)


def staged_product(x: Tensor, w: Tensor, tiles: Tiles, laid: Tensor | None = None) -> Tensor:
    """float32 [rows, outputs] = x [rows, inputs] @ w.T, w float16 (or float32: tf32 products) and contiguous, x of
    any float type (taken as w's: :func:`laid_out`), as one staged kernel of ``tiles`` (:func:`tiles_for` says which a
    shape takes; :func:`fits` whether it can); ``laid``: x's :func:`laid_out` already made (None: made here)."""
    (rows, inputs), outputs, kind = x.shape, w.shape[0], w.dtype
    renderer = Device[x.device].renderer
    core = tensor_core(renderer, kind)
    if core is None or not fits(tiles, outputs, inputs, kind):
        raise ValueError(f"no staged product of {kind} {rows}x{inputs} @ {outputs}x{inputs} with {tiles} here")
    laid = laid_out(x, tiles, kind) if laid is None else laid
    if tiles.stages == ring.STAGES:  # x interleaved beforehand, its rows padded to the tile: the result's too
        padded = -(-rows // tiles.rows) * tiles.rows
        out = Tensor.empty(tiles.split * padded, outputs, dtype=dtypes.float32, device=x.device)
        asynchronous = isinstance(renderer, CUDARenderer)
        fxn = ring.kernel(padded, outputs, inputs, tiles, kind, core.dims, renderer.target.device, asynchronous)
        y = out.custom_kernel(laid, w, fxn=fxn)[0]
        if tiles.split > 1:  # the parts' sums, lazy: a consumer's kernel may take the sum in
            y = y.reshape(tiles.split, padded, outputs).sum(0)
        return y if padded == rows else y[:rows]
    out = Tensor.empty(rows, outputs, dtype=dtypes.float32, device=x.device)
    fxn = _staged_kernel(rows, outputs, inputs, tiles, kind, core.dims, renderer.target.device)
    return out.custom_kernel(laid, w, fxn=fxn)[0]
