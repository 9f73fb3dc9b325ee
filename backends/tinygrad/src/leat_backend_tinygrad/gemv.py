"""Few-row products with a quantized weight as tinygrad kernels of our own (UOp programs, ``Tensor.custom_kernel``).

``y[n, o] = sum_k x[n, k] * w[o, k]`` with ``w`` in its GGUF blocks. A set of ``Shape.lanes`` threads shares an
output ``o``: the lanes read the row's blocks in storage order, each one unit of a block's quants (Q4_K: 16 bytes,
one 128-bit load; Q6_K: 4 bytes of each of its three quant fields, a 32-bit load each, its blocks stored padded
to 212 bytes so that every block is 4-byte aligned; Q8_0, Q4_0: one uint16 word; MXFP4: one byte; the widest
aligned loads the block sizes allow), neighbouring lanes neighbouring units (coalesced); the set covers whole
blocks per step (at least one: a block's units are the fewest lanes). Each lane decodes its unit with the
block's scales (the same float32 operations as gguf-py's dequantizers, so each weight value is gguf's bit for
bit), multiplies them by every row of ``x`` (the weight is read once for all rows) and keeps one float32 sum per
row; the set's partial sums are added as ``lanesum.py`` adds lanes (warp shuffles on CUDA). A thread computes
``Shape.per_thread`` neighbouring outputs from the same loads of x, and ``Shape.groups`` sets share a thread
group. Devices without local memory (tinygrad's CPU device) run the lanes as a loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from leat_backend_tinygrad import lanesum

Q = gguf.GGMLQuantizationType
MAX_ROWS = 8  # products with up to this many rows of x use the kernel; each row is one more sum per thread

Decoded = list[tuple[UOp, UOp]]  # (element offset in the block, float32 value)
Word = Callable[[int | UOp], UOp]  # the block's little-endian word i (of the layout's word size)
Byte = Callable[[int | UOp], UOp]  # the block's byte i, as int32


def _f16(word: UOp) -> UOp:
    """float32 of a float16's bits held in a uint16 (or the low 16 bits of a wider word)."""
    return word.cast(dtypes.uint16).bitcast(dtypes.float16).cast(dtypes.float32)


def _part(word: UOp, k: int) -> UOp:
    """Byte k of a word, as int32."""
    return ((word >> (k * 8)) & 0xFF).cast(dtypes.int32)


def _i8(byte: UOp) -> UOp:
    return byte.cast(dtypes.uint8).bitcast(dtypes.int8).cast(dtypes.float32)


# Each decoder gets the block's words and bytes and the lane's unit (one range per axis of the layout's units; the
# units are separate ranges so tinygrad never splits a lane range with // and %, which loses its group reduce).


def q8_0(w: Word, b: Byte, u: UOp) -> Decoded:
    # 17 uint16: f16 d, then 16 words of two int8 quants; unit u = word 1 + u, elements 2u, 2u + 1
    d, word = _f16(w(0)), w(1 + u)
    return [(u * 2 + k, d * _i8(_part(word, k))) for k in (0, 1)]


def q4_0(w: Word, b: Byte, u: UOp) -> Decoded:
    # 9 uint16: f16 d, then 8 words of nibbles; byte j holds element j (low) and j + 16 (high), offset 8
    d, word = _f16(w(0)), w(1 + u)
    out = []
    for k in (0, 1):
        byte, j = _part(word, k), u * 2 + k
        out += [(j, d * ((byte & 15) - 8).cast(dtypes.float32)), (j + 16, d * ((byte >> 4) - 8).cast(dtypes.float32))]
    return out


def _k_scale_min(scales: tuple[UOp, UOp, UOp], j: UOp) -> tuple[UOp, UOp]:
    """Q4_K's six-bit scale and min of sub-block ``j`` (0..7) from its 12 bytes of scales, the three uint32 words
    (gguf's get_scale_min): j < 4: the low six bits of bytes j and j + 4; else the low/high nibble of byte j + 4
    with the top two bits of bytes j - 4 and j. Byte jj + 4t is byte jj of word t."""
    low = j < 4
    shift = (low.where(j, j - 4) * 8).cast(dtypes.uint32)
    s = [((word >> shift) & 0xFF).cast(dtypes.int32) for word in scales]  # bytes jj, jj + 4, jj + 8
    sc = low.where(s[0] & 63, (s[2] & 15) | ((s[0] >> 6) << 4))
    mn = low.where(s[1] & 63, (s[2] >> 4) | ((s[1] >> 6) << 4))
    return sc.cast(dtypes.float32), mn.cast(dtypes.float32)


def q4_k(w: Word, b: Byte, c: UOp, g: UOp) -> Decoded:
    # 36 uint32: f16 d | f16 dmin, 12 bytes of scales/mins, 32 words of nibbles in 4 chunks c of 32 bytes: byte i of
    # chunk c holds element 64c + i (low nibble, sub-block 2c) and 64c + 32 + i (high, 2c + 1). Unit (c, g): the
    # 16 bytes 16g .. 16g + 15 of chunk c, words 4 + 8c + 4g .. + 3 (16-byte aligned: one 128-bit load), one
    # decode of the two sub-blocks' scales for its 32 elements. The head (words 0..3: d, dmin and the scales) is
    # read at fixed word indices, one 128-bit load too, and the unit's scale bytes picked from it in registers.
    head, s0, s1, s2 = (w(t) for t in range(4))
    d, dmin = _f16(head & 0xFFFF), _f16(head >> 16)
    words = [w(4 + c * 8 + g * 4 + t) for t in range(4)]
    out = []
    for half in (0, 1):
        sc, mn = _k_scale_min((s0, s1, s2), c * 2 + half)
        scale, offset = d * sc, dmin * mn
        for t, word in enumerate(words):
            for k in range(4):
                q = (_part(word, k) >> (4 * half)) & 15
                out.append((c * 64 + half * 32 + g * 16 + t * 4 + k, scale * q.cast(dtypes.float32) - offset))
    return out


def q6_k(w: Word, b: Byte, h: UOp, g: UOp, p4: UOp) -> Decoded:
    # stored padded to 212 bytes (53 uint32 words; Layout.stored): 128 bytes of low nibbles (words 0..31), 64 bytes
    # of 2-bit highs (32..47), 16 int8 scales (bytes 192..207, words 48..51), f16 d (word 52's low half). Half h
    # (128 elements) uses ql[64h:64h+64], qh[32h:32h+32]; for l < 32 the four elements 128h + l + 32r are (ql[l] low,
    # ql[l+32] low, ql[l] high, ql[l+32] high) | ((qh[l] >> 2r) & 3) << 4, minus 32, each times d * scale[element //
    # 16]. Unit (h, g, p4): p = 4g + p4, l = 4p + k for the word's bytes k; scale[8h + 2r + g] is byte 2r + g of
    # the words 48 + 2h, 49 + 2h (r < 2, r >= 2).
    p = g * 4 + p4
    d, (low_a, low_b, high), scale_words = q6_k_words(w, h, p)
    out = []
    for r in range(4):
        scale = d * q6_k_scale(scale_words, g, r)
        for k in range(4):
            low = (_part(low_a if r % 2 == 0 else low_b, k) >> (4 * (r // 2))) & 15
            q = (low | (((_part(high, k) >> (2 * r)) & 3) << 4)) - 32
            out.append((h * 128 + r * 32 + p * 4 + k, scale * q.cast(dtypes.float32)))
    return out


def q6_k_words(w: Word, h: UOp, p: UOp) -> tuple[UOp, tuple[UOp, UOp, UOp], tuple[UOp, UOp]]:
    """What a Q6_K lane (half ``h``, word ``p`` of 8) reads of its block: d (float32), its three quant words (low
    nibbles of ql[l], of ql[l + 32], the 2-bit highs) and the half's two words of scales."""
    quants = (w(h * 16 + p), w(h * 16 + 8 + p), w(32 + h * 8 + p))
    return _f16(w(52)), quants, (w(48 + h * 2), w(49 + h * 2))


def q6_k_scale(scale_words: tuple[UOp, UOp], g: UOp, r: int) -> UOp:
    """The int8 scale of sub-block 8h + 2r + g (byte 2r + g of the half's scale words), as float32."""
    shift = (g * 8 + (r % 2) * 16).cast(dtypes.uint32)
    return _i8(((scale_words[r // 2] >> shift) & 0xFF).cast(dtypes.int32))


def _e2m1(n: UOp) -> UOp:
    """gguf's doubled E2M1 values (0, 1, 2, 3, 4, 6, 8, 12, then negated) of a nibble, as float32."""
    m = n & 7
    magnitude = (m < 4).where(m, (m < 6).where(m * 2 - 4, m * 4 - 16))
    return ((n & 8) != 0).where(-magnitude, magnitude).cast(dtypes.float32)


def mxfp4(w: Word, b: Byte, u: UOp) -> Decoded:
    # 17 bytes: E8M0 exponent e, 16 bytes of nibbles (byte j: element j low, j + 16 high); d = 2^(e - 128) as
    # ggml_e8m0_to_fp32_half makes it (e < 2: the subnormal 0x00200000 << e)
    e = b(0)
    bits = (e < 2).where(e.const_like(0x00200000) << e, (e - 1) << 23)
    d, byte = bits.bitcast(dtypes.float32), b(1 + u)
    return [(u, d * _e2m1(byte & 15)), (u + 16, d * _e2m1(byte >> 4))]


@dataclass(frozen=True)
class Layout:
    word: Any  # the tinygrad dtype a block's words are read as
    units: tuple[int, ...]  # a block's lanes, one range per axis (each lane decodes one unit of its quants)
    decode: Callable[..., Decoded]
    stored: int = 0  # bytes a block is stored in, where padded to a multiple of the word (else gguf's block size)

    def block_bytes(self, qtype: Q) -> int:
        return self.stored or gguf.GGML_QUANT_SIZES[qtype][1]


LAYOUTS: dict[Q, Layout] = {
    Q.Q8_0: Layout(dtypes.uint16, (16,), q8_0),
    Q.Q4_0: Layout(dtypes.uint16, (8,), q4_0),
    Q.Q4_K: Layout(dtypes.uint32, (4, 2), q4_k),
    Q.Q6_K: Layout(dtypes.uint32, (2, 2, 4), q6_k, stored=212),  # 210 bytes + 2 of padding: 32-bit loads
    Q.MXFP4: Layout(dtypes.uint8, (16,), mxfp4),
}


@dataclass(frozen=True)
class Shape:
    """How a product's outputs map to threads: ``lanes`` threads share an output's row (its group reduce; a
    block's units at least), ``groups`` such sets share a thread group (a CUDA block), each thread computes
    ``per_thread`` outputs with the same loads of x. The default, 16 lanes, 4 groups, 2 outputs a thread,
    decoded the 8B bench file at 72.6 tok/s on the H200 against 61.5 for one 64-lane set an output
    (docs/benchmarks.md; ``scripts/tinygrad_gemv_shapes.py`` times shapes product by product)."""

    lanes: int = 16
    groups: int = 4
    per_thread: int = 2

    def fitting(self, outputs: int, local: bool) -> Shape:
        """This shape with its groups (then its outputs per thread) halved until a thread group's outputs
        divide ``outputs``; one group where the device has no local memory."""
        groups, per_thread = self.groups if local else 1, self.per_thread
        while outputs % (groups * per_thread):
            groups, per_thread = (groups // 2, per_thread) if groups > 1 else (1, per_thread // 2)
        return Shape(self.lanes, groups, per_thread)

    @staticmethod
    def for_product(outputs: int, gated: bool = False, threads: int | None = None, qtype: Q | None = None) -> Shape:
        """The shape a product gets unless one is asked for: the gated unit GATED_SHAPE; any other the default with
        its lanes doubled (up to 64, MAX_LANES for some types) until the product has ``threads`` threads
        (MIN_THREADS): a product of few outputs and long rows (the 8B file's down, 4096 x 14336) otherwise leaves
        most of the GPU idle (on the H200 its 512 thread groups of 64 threads made a quarter of a wave, 12% of the
        threads the SMs hold)."""
        if gated:
            return GATED_SHAPE
        shape = Shape()
        threads = MIN_THREADS if threads is None else threads
        while outputs // shape.per_thread * shape.lanes < threads and shape.lanes < MAX_LANES.get(qtype, 64):
            shape = Shape(shape.lanes * 2, shape.groups, shape.per_thread)
        return shape


#: threads a product's shape reaches, where 64 lanes an output allow (Shape.for_product; LEAT_TINYGRAD_GEMV_THREADS,
#: 0: the default shape for every product but the gated unit)
MIN_THREADS = int(os.environ.get("LEAT_TINYGRAD_GEMV_THREADS", "65536"))
#: the gated unit's shape (its gate and up products in one kernel): on the H200, the 8B file, tg128 188.4 tok/s
#: against 181.8 with the default's 16 lanes (docs/benchmarks.md, twenty-first session)
GATED_SHAPE = Shape(64, 1, 2)
#: lanes an output at most, by type, where fewer timed faster: a Q6_K product of 1024 x 4096 (the 8B file's v) took
#: 9.2-9.6 us at 64 lanes and 5.3 at 16 or 32 (H200, ``scripts/tinygrad_gemv_shapes.py``, twenty-first session)
MAX_LANES = {Q.Q6_K: 32}


@dataclass(frozen=True)
class Threads:
    """A product kernel's thread ranges: the lanes (``lanes``: an index per axis of a block's units, the whole blocks
    a step first; their ranges and sum in ``lane_set``), the reduce's step over the row's blocks, the block a lane
    reads, a thread's first output and the ranges its stores end: ``ends`` a result's (the lanes' too where each
    holds the sum), ``apart`` a store's that reads no sum (each lane stores the same)."""

    lanes: list[UOp]
    lane_set: lanesum.Lanes
    step: UOp
    block: UOp
    first: UOp
    ends: tuple[UOp, ...]
    apart: tuple[UOp, ...]

    @staticmethod
    def make(layout: Layout, outputs: int, blocks: int, local: bool, shape: Shape, lane_sum: str = "group") -> Threads:
        """``lane_sum``: how the lanes' parts are added (``lanesum.MODES``)."""
        per_step = math.gcd(max(shape.lanes // math.prod(layout.units), 1), blocks)  # whole blocks a row's lanes read
        tile = shape.groups * shape.per_thread  # outputs of one thread group
        # the last unit axis gets the lowest id: tinygrad makes it threadIdx.x, so neighbouring threads read
        # neighbouring words; the row groups get the highest (the outermost thread index)
        sizes = (per_step, *layout.units)
        lane_set = lanesum.Lanes.make(sizes, 3, lane_sum, local)
        lanes = [lane_set.at(i) for i in range(len(sizes))]
        tiles = UOp.range(outputs // tile, 0, AxisType.GLOBAL)
        group = UOp.range(shape.groups, 4 + len(sizes), AxisType.LOCAL) if shape.groups > 1 else None
        lane_set.outer = [group] if group is not None else []
        step = UOp.range(blocks // per_step, 1, AxisType.REDUCE)
        first = tiles * tile if group is None else tiles * tile + group * shape.per_thread
        apart = (tiles,) if group is None else (tiles, group)
        return Threads(lanes, lane_set, step, step * per_step + lanes[0], first, apart + lane_set.ends(), apart)

    def gate(self, index: UOp, condition: UOp | None = None) -> UOp:
        """A result's store index, gated to ``condition`` (where given) and to one lane of the result's."""
        return self.lane_set.gate(index, condition)

    def total(self, values: Decoded, x: UOp, n: int, block_size: int) -> UOp:
        """Row ``n`` of x times a lane's decoded weight ``values``, summed over the row (the step and the lanes)."""
        terms = [value * x[n, self.block * block_size + at] for at, value in values]
        return self.add_up(sum(terms[1:], terms[0]))

    def add_up(self, lane: UOp) -> UOp:
        """A lane's part summed over the row (the step and the lanes)."""
        return self.lane_set.sum(lane, self.step)

    def products(self, qtype: Q, reader: tuple[Word, Byte], x: tuple[UOp, ...], integer: str) -> Callable[[int], UOp]:
        """Row n's product with the weight row ``reader`` reads, for each n: x float (one parameter; the decoded
        values made once, shared by the rows) or, ``integer``, ``intx.quantize``'s tensors that the type's integer
        product reads (``intx.DOTS``, ``intx.PARAMS``)."""
        if integer:
            from leat_backend_tinygrad import intx

            dot, cuda = intx.DOTS[qtype], integer == "cuda"
            return lambda n: self.add_up(dot(reader[0], self.lanes[1:], x, n, self.block, cuda))
        values = LAYOUTS[qtype].decode(*reader, *self.lanes[1:])
        block_size = gguf.GGML_QUANT_SIZES[qtype][0]
        return lambda n: self.total(values, x[0], n, block_size)


def _kernel(
    qtype: Q,
    rows: int,
    outputs: int,
    blocks: int,
    local: bool,
    shape: Shape,
    epilogue: str = "",
    segments: tuple[int, ...] = (),
    integer: str = "",
    lane_sum: str = "group",
):
    """The kernel's UOp program. ``epilogue`` "glu": a second weight (up, of the same type and shape) is multiplied
    by the same loads of x and each output is silu(x w^T) * (x up^T); "residual": an input of the output's shape
    is added to each output (a residual connection); "": the product alone. ``segments``: several weights of one
    type and row length, their outputs in turn (``outputs`` their sum; flat buffers in and out), each output row read
    from its own weight by gated loads and stored by a gated store. ``integer`` (Q4_K, Q6_K): x comes as
    ``intx.quantize`` makes it (``x_params``: the tensors of it the type reads) and the products are integer ones
    (``intx.DOTS``; "cuda": with CUDA's dp2a, "portable": the same sums as plain integer operations)."""
    layout = LAYOUTS[qtype]
    inputs = x_params(qtype, integer)

    def fxn(*params: UOp) -> UOp:
        count = len(segments) or 1  # outputs
        outs, x_in, rest = params[:count], params[count : count + inputs], params[count + inputs :]
        out = outs[0]
        weights, extra = (rest[:count], rest[count:]) if segments else (rest[:1], rest[1:])
        weight = weights[0]
        threads = Threads.make(layout, outputs, blocks, local, shape, lane_sum)
        matrices = (weight, extra[0]) if epilogue == "glu" else (weight,)
        stores = []
        for r in range(shape.per_thread):
            o = threads.first + r
            # x's loads are the same UOps for every output of the thread (and both matrices of a glu): read once
            if segments:
                words_a_block = layout.block_bytes(qtype) // layout.word.itemsize
                readers = [segment_reader(weights, segments, o, threads.block, blocks, layout, words_a_block)]
            else:
                readers = [_reader(matrix, o, threads.block, layout) for matrix in matrices]
            products = [threads.products(qtype, reader, x_in, integer) for reader in readers]
            for n in range(rows):
                sums = [product(n) for product in products]
                y = sums[0]
                if epilogue == "glu":  # silu(gate) * up, as the backend's silu_mul
                    y = y / (1.0 + (y * -1.0).exp()) * sums[1]
                elif epilogue == "residual":
                    y = y + row_entry(extra[0], n, o, outputs)
                if segments:  # the output of the product whose rows hold o: one gated store each
                    at = 0
                    for target, size in zip(outs, segments):
                        stores.append(
                            target[threads.gate(o - at + n * size, within_rows(o, at, size))]
                            .store(y)
                            .end(*threads.ends)
                        )
                        at += size
                else:
                    stores.append(out[n, threads.gate(o)].store(y).end(*threads.ends))
        name = f"gemv_{qtype.name.lower()}_{rows}_{outputs}_{blocks}" + ("_i16" if integer else "")
        name += f"_{epilogue}" if epilogue else ""  # _i16: x as 16-bit integers (intx.py)
        return UOp.sink(*stores, arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn


def within_rows(o: UOp, first: int, count: int) -> UOp:
    """Whether output row ``o`` is one of the ``count`` rows from ``first`` (a segment's)."""
    return (o >= first) & (o < first + count) if first else o < count


def segment_reader(
    weights: tuple[UOp, ...], segments: tuple[int, ...], o: UOp, block: UOp, blocks: int, layout: Layout, per_block: int
) -> tuple[Word, Byte]:
    """The word and byte readers of output row ``o`` of several weights (flat buffers of words, ``per_block`` words a
    block) whose outputs follow one another: each weight's load gated to its own rows (one of them runs), their sum
    the row's word."""

    def word(i: int | UOp) -> UOp:
        total, at = None, 0
        for matrix, rows in zip(weights, segments):
            value = matrix[(((o - at) * blocks + block) * per_block + i).valid(within_rows(o, at, rows))]
            total, at = value if total is None else total + value, at + rows
        return total

    return word, _byte_reader(word, layout)


def _reader(matrix: UOp, o: UOp, block: UOp, layout: Layout) -> tuple[Word, Byte]:
    """The word and byte readers of row ``o``'s block ``block`` of ``matrix`` (stored as its blocks' words)."""

    def word(i: int | UOp) -> UOp:
        return matrix[o, block, i]

    return word, _byte_reader(word, layout)


def _byte_reader(word: Word, layout: Layout) -> Byte:
    """Byte i of a block, as int32, from its little-endian words."""
    size = layout.word.itemsize

    def byte(i: int | UOp) -> UOp:
        shift = (i % size) * 8
        shift = shift if isinstance(shift, int) else shift.cast(layout.word)
        return ((word(i // size) >> shift) & 0xFF).cast(dtypes.int32)

    return byte


def gemv_segments(x: Any, words: list[Tensor], qtype: Q, shape: Shape | None = None) -> list[Tensor]:
    """x @ w.T for each weight of ``words`` (one type, one row length: a layer's q, k and v), float32 [rows, outputs
    of each], as one kernel (the shape fitted to every weight's outputs, so a thread group's lie in one weight). x: a
    float Tensor or, for Q4_K, ``intx.Quantized``."""
    local = Device[x.device].renderer.has_local
    sizes = tuple(w.shape[0] for w in words)
    shape = (shape or Shape.for_product(sum(sizes), qtype=qtype)).fitting(math.gcd(*sizes), local)
    rows, blocks = x.shape[0], words[0].shape[1]
    outs = [Tensor.empty(rows * size, dtype=dtypes.float32, device=x.device) for size in sizes]
    inputs, integer = x_inputs(x, qtype)
    lane_sum = lanesum.mode(x.device)
    fxn = _kernel(qtype, rows, sum(sizes), blocks, local, shape, segments=sizes, integer=integer, lane_sum=lane_sum)
    flat = [flat_buffer(w) for w in words]
    made = outs[0].custom_kernel(*outs[1:], *inputs, *flat, fxn=fxn)[: len(sizes)]
    return [m.reshape(rows, size) for m, size in zip(made, sizes)]


def flat_buffer(t: Tensor) -> Tensor:
    """``t`` as a flat buffer for a custom kernel: the realized buffer it views, else a contiguous copy."""
    u = unreshaped(t)
    if u.op is Ops.BUFFER and math.prod(u.shape) == t.numel():
        return Tensor(u, device=t.device)
    return t.reshape(-1).contiguous()


def unreshaped(t: Tensor) -> UOp:
    """What ``t`` is a reshape of (through any reshapes), or its own UOp."""
    u = t.uop
    while u.op is Ops.RESHAPE:
        u = u.src[0]
    return u


def row_entry(buffer: UOp, row: int | UOp, i: int | UOp, width: int) -> UOp:
    """Entry ``i`` of row ``row`` of a ``plain_rows`` input (``width`` entries a row), 2-D or a flat buffer."""
    return buffer[row * width + i] if len(buffer.shape) == 1 else buffer[row, i]


def plain_rows(t: Tensor) -> Tensor:
    """float32 ``t`` [rows, ...] as a plain buffer for a custom kernel's input, indexed [row, rest] or, where it is
    flat, [row * rest + i] (``row_entry``): the tensor that ``t`` is a reshape of, where that is a buffer or a
    kernel's output of ``t``'s rows or of its size, flat (contiguous() of the reshape can be a copy); else a
    contiguous copy."""
    shape, u = (t.shape[0], math.prod(t.shape[1:])), unreshaped(t)
    flat = u.op in (Ops.BUFFER, Ops.AFTER) and u.shape == (t.numel(),)
    if t.dtype == dtypes.float32 and u is not t.uop and (u.shape == shape or flat):
        return Tensor(u, device=t.device)
    return t.reshape(shape).cast(dtypes.float32).contiguous()


def as_words(stored: np.ndarray, qtype: Q) -> np.ndarray:
    """Blocks [..., blocks, block_bytes] (uint8) viewed as the little-endian words the kernel reads (a type of
    LAYOUTS; others unchanged), each block padded with zero bytes to its layout's ``stored`` size first (a copy).
    The backend stores such weights as words: a custom kernel's input must be a plain buffer, and a bitcast view of
    one is copied."""
    if qtype not in LAYOUTS or LAYOUTS[qtype].word == dtypes.uint8:
        return stored
    layout = LAYOUTS[qtype]
    if (pad := layout.block_bytes(qtype) - stored.shape[-1]) > 0:
        stored = np.concatenate([stored, np.zeros((*stored.shape[:-1], pad), np.uint8)], axis=-1)
    return stored.view(np.dtype(f"<u{layout.word.itemsize}"))


def gemv(
    x: Any,
    words: Tensor,
    qtype: Q,
    shape: Shape | None = None,
    *,
    up: Tensor | None = None,
    residual: Tensor | None = None,
) -> Tensor:
    """float32 [rows, outputs] = x [rows, k] @ w.T for a weight of ``qtype`` (one of LAYOUTS) stored as its blocks'
    words [outputs, blocks, block_words] (``as_words``), as one kernel. With ``up`` (the words of a second weight of
    the same type and shape): silu(x @ w.T) * (x @ up.T), the gated unit, in the same kernel; with ``residual``
    (float32 [rows, outputs]): x @ w.T + residual. x: a float Tensor or, for Q4_K, ``intx.Quantized`` (integer
    products)."""
    outputs, blocks, _ = words.shape
    local = Device[x.device].renderer.has_local
    shape = (shape or Shape.for_product(outputs, gated=up is not None, qtype=qtype)).fitting(outputs, local)
    out = Tensor.empty(x.shape[0], outputs, dtype=dtypes.float32, device=x.device)
    epilogue, extra = "", []
    if up is not None:
        epilogue, extra = "glu", [up]
    elif residual is not None:
        epilogue, extra = "residual", [plain_rows(residual)]
    inputs, integer = x_inputs(x, qtype)
    lane_sum = lanesum.mode(x.device)
    fxn = _kernel(qtype, x.shape[0], outputs, blocks, local, shape, epilogue, integer=integer, lane_sum=lane_sum)
    return out.custom_kernel(*inputs, words, *extra, fxn=fxn)[0]


def x_inputs(x: Any, qtype: Q) -> tuple[list[Tensor], str]:
    """A ``qtype`` product kernel's x parameters and its ``integer`` mode: x float32 as it is (""), or those of an
    ``intx.Quantized``'s tensors that the type's product reads ("cuda" where the device's renderer is CUDA's, else
    "portable")."""
    from leat_backend_tinygrad import intx

    if isinstance(x, intx.Quantized):
        assert qtype in intx.DOTS, f"no integer product for {qtype.name}"
        return list(x.tensors()[: intx.PARAMS[qtype]]), "cuda" if intx.intrinsic(x.device) else "portable"
    return [x.cast(dtypes.float32).contiguous()], ""


def x_params(qtype: Q, integer: str) -> int:
    """How many parameters x takes in a ``qtype`` product kernel (``x_inputs``)."""
    from leat_backend_tinygrad import intx

    return intx.PARAMS[qtype] if integer else 1
