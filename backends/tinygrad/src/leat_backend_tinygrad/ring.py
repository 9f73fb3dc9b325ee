"""The staged product with its copies in flight two steps ahead: x and w go from global memory straight into a ring of
three shared-memory stages (``cp.async`` on CUDA, no registers between), so a step's loads have two steps' products
to land in, where ``gemm.py``'s two stages give them one (the H100's profile of its gate/up product: a warp waited
4.4 cycles an instruction on loads not yet back, the most of any reason, with the tensor pipes 34% busy).

Step d multiplies stage d % 3 while the copies of step d + 2 fill stage (d + 2) % 3; at the end of the step each
thread waits for its copies of step d + 1 (``cp.async.wait_group 1``) and the thread group meets at one barrier.
The layouts are ``gemm.py``'s (``Tiles.runs``: a lane's quarter of each slice's row, x's rows g and g + 8 of an mma
tile interleaved a word at a time), but a 16-byte asynchronous copy cannot interleave: x is laid out so beforehand
(:func:`interleaved`, rows padded to the tile with zeros, a kernel of its own), and each shared row of pairs is
copied as it lies. Three stages of 128 x 128 x 32 float16 tiles take all of the 48 KB tinygrad declares statically:
no padding, so the rows of pairs (128 bytes: each on the same banks) are swizzled instead, a lane's two 16-byte units
exchanged on odd rows (in the interleaved x already), which puts a quarter-warp's fragment reads (rows g and g + 1)
on distinct banks. tinygrad places a step's copies after its products (its order puts statements that nothing
reads late); NVRTC's sm_90 SASS issues them about halfway through the step's mma.sync. Renderers other than CUDA's
(tinygrad's PYTHON device in the tests) copy with plain 16-byte loads and stores at the same places, which checks the
ring's indexing where no GPU is.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from tinygrad import Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace, DType
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

if TYPE_CHECKING:
    from leat_backend_tinygrad.gemm import Tiles

STAGES = 3
_COPY = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared({0})), "l"({1}));'
_COMMIT = 'asm volatile("cp.async.commit_group;");'
_WAIT = 'asm volatile("cp.async.wait_group {n};");'


def interleaved(x: Tensor, depth: int, rows: int, kind: DType | None = None, up: Tensor | None = None) -> Tensor:
    """x [n, k] as the ring reads it, [rows / 2, 2 k] of ``kind`` (None: x's; cast as the kernel stores it, so a float32
    x needs no copy of its own in float16); with ``up`` (x's shape), silu(x) * up so laid out, the activation taken
    into this kernel (the down product's x: no kernel of its own writes it first). Rows padded with zeros to ``rows``
    (a multiple of 16), then each
    16-row tile's rows g and g + 8 as one row of pairs: for each slice of ``depth`` inputs, lane t's quarter of it from
    both rows, a 32-bit word of row g, then of row g + 8 (gemm.A_WORDS' order), the lane's two 16-byte units swapped
    where g is odd (the swizzle). One kernel of our own (after the padding's copy), a thread a 16-byte unit of the
    result from two 8-byte reads, a warp's writes whole rows of pairs' slices: tinygrad's kernel for the same permute
    as Tensor ops moved ~60 GB/s on the H100 (the products with it: docs/benchmarks.md). With the index kept
    non-negative (the swap as (unit + g) % 2) NVRTC gets 8-byte loads and a 16-byte store; otherwise tinygrad wrapped
    each index modulo the buffer and read 2 bytes at a time."""
    (n, k), kind = x.shape, kind or x.dtype
    per_word, copy = 4 // kind.itemsize, 16 // kind.itemsize

    def fxn(out: UOp, source: UOp, *gated: UOp) -> UOp:  # source: x padded; gated: up padded, if given
        # a thread a unit: tile (16 rows), slice; lanes: the lane's unit (the fastest: neighbouring threads write
        # neighbouring units, read neighbouring inputs), t, g (rows g and g + 8); no divisions
        tile, part = UOp.range(rows // 16, 0, AxisType.GLOBAL), UOp.range(k // depth, 1, AxisType.GLOBAL)
        unit, t, g = (UOp.range(size, axis, AxisType.LOCAL) for size, axis in ((2, 2), (4, 3), (8, 4)))
        half = (unit + g) % 2  # the lane's unit it holds: swapped on odd g
        first = part * depth + t * (depth // 4) + half * (copy // 2)  # its first input
        pair, at = tile * 8 + g, (part * 8 + t * 2 + unit) * copy  # where it goes
        stores = []
        for j in range(copy):
            row = tile * 16 + g + 8 * ((j // per_word) % 2)  # row g or g + 8
            column = first + j // (2 * per_word) * per_word + j % per_word
            value = source[row, column]
            if gated:
                value = value.silu() * gated[0][row, column]
            stores.append(out[pair, at + j].store(value if value.dtype == kind else value.cast(kind)))
        name = f"interleave_{rows}_{k}" + ("_silu" if gated else "")
        return UOp.group(*stores).end(tile, part, g, t, unit).sink(arg=KernelInfo(name=name, opts_to_apply=()))

    out = Tensor.empty(rows // 2, 2 * k, dtype=kind, device=x.device)
    sources = [t.pad(((0, rows - n), (0, 0))).contiguous() for t in (x, up) if t is not None]  # padded with zeros
    return out.custom_kernel(*sources, fxn=fxn)[0]


def fits(tiles: Tiles, kind: DType) -> bool:
    """What the ring asks of tiles beyond gemm.fits: the runs' layout, a lane's run of a row of pairs two 16-byte units
    (the swizzle), and warps both ways (four local ranges: tinygrad merges t and g into one, so g % 2 leaves the
    lanes in order; with three it split g into ranges of their own)."""
    return tiles.runs and tiles.depth * kind.itemsize == 64 and tiles.warp_rows > 1 and tiles.warp_outputs > 1


def shared_bytes(tiles: Tiles, kind: DType) -> int:
    return STAGES * (tiles.rows + tiles.outputs) * tiles.depth * kind.itemsize


def kernel(
    rows: int, outputs: int, inputs: int, tiles: Tiles, kind: DType, dims: tuple, device: str, asynchronous: bool
):
    """The ring's kernel for ``Tensor.custom_kernel(interleaved x, w)``: out [split * rows, outputs] float32 (``rows``
    the padded count; with ``tiles.split`` parts, part p's sums over the p-th of the inputs in rows p * rows on)."""
    copy = 16 // kind.itemsize  # entries a 16-byte copy moves
    tm, tn = tiles.rows // tiles.warp_rows // 16, tiles.outputs // tiles.warp_outputs // 8  # mma tiles a warp
    depth, steps, pairs = tiles.depth, inputs // tiles.depth // tiles.split, tiles.rows // 2  # a part's steps
    run = depth // 4  # a lane's run: the t-th quarter of a slice's row
    x_stage, w_stage = pairs * 2 * depth, tiles.outputs * depth

    def fxn(out: UOp, x: UOp, w: UOp) -> UOp:
        block_rows = UOp.range(rows // tiles.rows, 0, AxisType.GLOBAL)
        block_outputs = UOp.range(outputs // tiles.outputs, 1, AxisType.GLOBAL)
        part = UOp.range(tiles.split, 10, AxisType.GLOBAL) if tiles.split > 1 else None
        # four local ranges (fits), numbered as gemm.py numbers them: tinygrad merges t and g, t the fastest
        t, g = UOp.range(4, 3, AxisType.LOCAL), UOp.range(8, 2, AxisType.LOCAL)
        wr, wo = UOp.range(tiles.warp_rows, 4, AxisType.LOCAL), UOp.range(tiles.warp_outputs, 5, AxisType.LOCAL)
        warp, warps = wr * tiles.warp_outputs + wo, tiles.warp_rows * tiles.warp_outputs
        shared_x = UOp.placeholder((STAGES * x_stage,), kind, 900, AddrSpace.LOCAL)
        shared_w = UOp.placeholder((STAGES * w_stage,), kind, 901, AddrSpace.LOCAL)

        def copies(step: UOp, stage: UOp, entry_axis: int, x_to: UOp, w_to: UOp, after: UOp | None = None) -> UOp:
            """Step ``step``'s slices into ``stage``: a copy's row is g + 8 warp (+ a pass's rows), its 16 bytes the
            t-th (+ 4 a pass) of the row's slice (x's rows of pairs as :func:`interleaved` lays them). Asynchronous
            copies come one after another (each the one before as an operand its statement ignores: a group holds no
            asm statements), the first after ``after``; the last is returned."""
            entry = None if asynchronous else UOp.range(copy, entry_axis, AxisType.UPCAST)
            sliced = step if part is None else part * steps + step  # the slice of the inputs: in the part's share
            parts = [
                (x_to, x, block_rows * pairs, pairs, 2 * depth, x_stage),
                (w_to, w, block_outputs * tiles.outputs, tiles.outputs, depth, w_stage),
            ]
            made: list[UOp] = [] if after is None else [after]
            for shared, source, first, size, length, stage_size in parts:
                for i, j in itertools.product(range(size // (8 * warps)), range(length // copy // 4)):
                    r, unit = g + 8 * warp + 8 * warps * i, t + 4 * j
                    at = stage * stage_size + r * length + unit * copy
                    column = sliced * length + unit * copy
                    if entry is None:
                        made.append(statement(_COPY, shared.index(at), source[first + r, column], *made[-1:]))
                    else:
                        made.append(shared.index(at + entry).store(source[first + r, column + entry]))
            return made[-1] if entry is None else UOp.group(*made).end(entry)

        def statement(code: str, *src: UOp) -> UOp:
            return UOp(Ops.CUSTOM, dtypes.void, src, code)

        def landed(copied: UOp, pending: int) -> UOp:
            """After ``copied``: their group committed and this thread's copies done but for the ``pending``
            latest groups."""
            return statement(_WAIT.format(n=pending), statement(_COMMIT, copied))

        row0, output0 = wr * (tiles.rows // tiles.warp_rows), wo * (tiles.outputs // tiles.warp_outputs)
        keys = list(itertools.product(range(tm), range(tn)))

        def held(sums: UOp) -> dict:
            return {(i, n): UOp.stack(*[sums.index((i * tn + n) * 4 + e) for e in range(4)]) for i, n in keys}

        def products(staged_x: UOp, staged_w: UOp, stage: UOp, inner: int, sums: dict) -> dict:
            """The warp's mma tiles' sums after the ``inner``-th mma.sync of the stage (gemm.py's runs)."""
            size = dims[2] // 4  # a lane's entries of a row that one mma.sync takes (its t-th quarter of k)
            start = t * run + inner * size
            unit = 2 * t + inner + (g % 2) * (1 - 2 * inner)  # the lane's a: 16 bytes, its two units swapped on odd g
            a = []
            for i in range(tm):
                at = stage * x_stage + (row0 // 2 + 8 * i + g) * 2 * depth + unit * copy
                a.append(UOp.stack(*[staged_x.index(at + e) for e in range(2 * size)]))
            aw = output0 + g
            b = [
                UOp.stack(*[staged_w.index(stage * w_stage + (aw + 8 * n) * depth + start + e) for e in range(size)])
                for n in range(tn)
            ]
            return {(i, n): UOp.wmma(a[i], b[n], sums[i, n], dims, device, 32) for i, n in keys}

        sums = UOp.placeholder((tm * tn * 4,), dtypes.float32, 902, AddrSpace.REG)
        zeroed = UOp.group(*[sums.after(t).index(i).store(0.0) for i in range(tm * tn * 4)])
        first = copies(UOp.const(0), UOp.const(0), 7, shared_x, shared_w)
        one = UOp.const(min(1, steps - 1)), UOp.const(1), 8
        if asynchronous:
            second = copies(*one, shared_x, shared_w, after=statement(_COMMIT, first))
            fence = UOp(Ops.BARRIER, src=(landed(second, 1),))
        else:
            fence = UOp(
                Ops.BARRIER, src=(UOp.group(first, copies(*one, shared_x.after(first), shared_w.after(first))),)
            )
        staged_x, staged_w = shared_x.after(fence), shared_w.after(fence)
        step = UOp.range(steps, 6, AxisType.LOOP)
        summed = sums.after(zeroed, step)
        now = held(summed)
        ahead = copies((step + 2).minimum(steps - 1), (step + 2) % STAGES, 9, staged_x, staged_w)
        for inner in range(depth // dims[2]):
            now = products(staged_x, staged_w, step % STAGES, inner, now)
        kept = [summed.index((i * tn + n) * 4 + e).store(v[e]) for (i, n), v in now.items() for e in range(4)]
        if asynchronous:  # then the last steps' copies (of the last slice again) done before the thread group ends
            ended = UOp(Ops.BARRIER, src=(UOp.group(*kept), landed(ahead, 1))).end(step)
            looped = sums.after(UOp(Ops.BARRIER, src=(statement(_WAIT.format(n=0), ended),)))
        else:
            looped = sums.after(UOp(Ops.BARRIER, src=(UOp.group(*kept, ahead),)).end(step))
        stores = []
        for (i, n), total in held(looped).items():
            for e in range(4):
                row = block_rows * tiles.rows + row0 + 16 * i + 8 * (e // 2) + g
                row = row if part is None else part * rows + row
                column = block_outputs * tiles.outputs + output0 + 8 * n + 2 * t + e % 2
                stores.append(out[row, column].store(total[e]))
        name = f"ring_{rows}_{outputs}_{inputs}" + (f"_split{tiles.split}" if part is not None else "")
        ranges = (block_rows, block_outputs) if part is None else (block_rows, block_outputs, part)
        ended = UOp.group(*stores).end(*ranges, t, g, wr, wo)
        return ended.sink(arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn
