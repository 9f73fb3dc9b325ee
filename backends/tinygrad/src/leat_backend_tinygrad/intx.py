"""Few-row Q4_K and Q6_K products with x as 16-bit integers: integer dot products in place of float ones.

``gemv.py``'s float products issue ~0.2 warp instructions a Q4_K weight (a float conversion and two FMA a weight,
the nibble's shifts and masks), about twice what the H200's issue rate allows at its bandwidth. Here x is quantized
once a step (``quantize``: each run of 32 values as int16 with a float32 scale, amax / 32767, and the sums of each
half run), and a lane's unit multiplies 4 nibbles at a time: the nibbles of a word masked into 4 bytes, multiplied
by two pairs of int16 x values and added into an int32 (CUDA's ``__dp2a_lo``/``__dp2a_hi``, one instruction each,
where the renderer is CUDA's; elsewhere the same sums as shifts, products and adds). A sub-block's 16 products of
the lane then take its scales in float32: ``x_scale * (d * sc * sum(q x) - dmin * m * sum(x))``, every integer sum
exact (at most 16 * 15 * 32767 < 2^24, so exact in float32 too). A Q6_K lane's 16 weights are four runs of 4, each
in its own sub-block: a run's six-bit quants are put together in the 4 bytes of a word and made signed there (q - 32
as ``(q + 0x60) ^ 0x80`` a byte: no carry between bytes), then two dp2a and the sub-block's and x's scales (no sums:
``PARAMS``). The activations keep 16 bits (the CUDA backend's ``gemv_q`` quantizes x the same way); the weights'
values are gguf's. Compiled for sm_90 (docs/benchmarks.md, twenty-eighth session) the q/o product's loop is 179
instructions for what the float loop does in 404.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.renderer.cstyle import CUDARenderer
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from leat_backend_tinygrad.gemv import _f16, _k_scale_min, q6_k_scale, q6_k_words

Q = gguf.GGMLQuantizationType
RUN = 32  # values of x sharing a scale (a Q4_K sub-block)
LIMIT = 32767  # a run's largest magnitude maps to this


@dataclass(frozen=True)
class Quantized:
    """x [rows, k] as ``quantize`` makes it: ``words`` int32 [rows, k / 2] (elements 2i, 2i + 1 as the low and high
    int16 of word i), ``scales`` float32 [rows, k / 32] (a run's value is its integer times its scale), ``sums`` int32
    [rows, k / 16] (each 16 integers' sum)."""

    words: Tensor
    scales: Tensor
    sums: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, half = self.words.shape
        return rows, 2 * half

    @property
    def device(self) -> str:
        return self.words.device

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.words, self.scales, self.sums


def quantize(x: Tensor) -> Quantized:
    """float32 x [rows, k] (k a multiple of 32) as 16-bit integers a run of 32 with their scales, one kernel: a thread a
    run (its 32 values loaded at once), round half away from zero."""
    rows, k = x.shape
    runs, local = k // RUN, Device[x.device].renderer.has_local

    def fxn(words: UOp, scales: UOp, sums: UOp, xv: UOp) -> UOp:
        row = UOp.range(rows, 0, AxisType.GLOBAL)
        run = UOp.range(runs, 1, AxisType.LOCAL if local else AxisType.GLOBAL)  # (a LOOP here broke the CPU linearizer)
        stores = run_stores((words, scales, sums), row, run, [xv[row, run * RUN + j] for j in range(RUN)])
        return UOp.sink(
            UOp.group(*stores).end(row, run), arg=KernelInfo(name=f"quantize_x_{rows}_{k}", opts_to_apply=())
        )

    words, scales, sums = empty(rows, k, x.device)
    made = words.custom_kernel(scales, sums, x.cast(dtypes.float32).contiguous(), fxn=fxn)[:3]
    return Quantized(*made)


def run_stores(out: tuple[UOp, UOp, UOp], row: UOp, run: UOp, values: list[UOp]) -> list[UOp]:
    """The stores of a run's 32 float32 ``values`` (run ``run`` of row ``row``) into ``quantize``'s three outputs
    (words, scales, sums): integers of the values over amax / 32767, rounded half away from zero (a run of zeros: 0)."""
    words, scales, sums = out
    magnitudes = [(v < 0).where(-v, v) for v in values]
    amax = magnitudes[0]
    for m in magnitudes[1:]:
        amax = amax.maximum(m)
    inverse = (amax > 0).where(LIMIT / amax, 0.0)
    q = [(t + (t < 0).where(-0.5, 0.5)).cast(dtypes.int32) for t in (v * inverse for v in values)]
    stores = [scales[row, run].store(amax * (1.0 / LIMIT))]
    for i in range(RUN // 2):
        stores.append(words[row, run * (RUN // 2) + i].store((q[2 * i] & 0xFFFF) | (q[2 * i + 1] << 16)))
    for h in range(2):
        total = q[16 * h]
        for v in q[16 * h + 1 : 16 * h + 16]:
            total = total + v
        stores.append(sums[row, run * 2 + h].store(total))
    return stores


def empty(rows: int, k: int, device: str) -> tuple[Tensor, Tensor, Tensor]:
    """``quantize``'s three outputs for x [rows, k], not yet written."""
    return (
        Tensor.empty(rows, k // 2, dtype=dtypes.int32, device=device),
        Tensor.empty(rows, k // RUN, dtype=dtypes.float32, device=device),
        Tensor.empty(rows, k // 16, dtype=dtypes.int32, device=device),
    )


def intrinsic(device: str) -> bool:
    """Whether the device's renderer is CUDA's, whose ``__dp2a_lo``/``__dp2a_hi`` the products call."""
    return isinstance(Device[device].renderer, CUDARenderer)


def dp2a(high: bool, pair: UOp, quads: UOp, acc: UOp, cuda: bool) -> UOp:
    """acc + the two int16 of ``pair`` times bytes 0, 1 (``high``: 2, 3) of ``quads`` as signed int8, int32."""
    if cuda:
        name = "__dp2a_hi" if high else "__dp2a_lo"
        return UOp(
            Ops.CUSTOM, dtypes.int32, (pair, quads, acc), arg=f"{name}((int)({{0}}), (int)({{1}}), (int)({{2}}))"
        )
    low, top = (pair << 16) >> 16, pair >> 16  # the pair's int16, sign-extended
    first = 16 if high else 0
    b0, b1 = ((quads << (24 - first - 8 * i)) >> 24 for i in (0, 1))
    return acc + low * b0 + top * b1


def _x_pair(words: UOp, n: int, pair: UOp, cuda: bool) -> UOp:
    """Word ``pair`` of row ``n`` of x's integers (elements 2 pair, 2 pair + 1), loaded as int32 (for dp2a)."""
    return words[n, pair].load(dtype=dtypes.int32) if cuda else words[n, pair]


def q4_k_dot(w, lanes: list[UOp], x: tuple[UOp, ...], n: int, block: UOp, cuda: bool) -> UOp:
    """A lane's Q4_K unit (lanes c, g: ``gemv.q4_k``'s 16 bytes of chunk c) times row ``n`` of quantized x (words,
    scales, sums), float32: its two sub-blocks' 16 integer products each, then their scales."""
    (c, g), (words, scales, sums) = lanes, x
    head, s0, s1, s2 = (w(t) for t in range(4))
    d, dmin = _f16(head & 0xFFFF), _f16(head >> 16)
    quants = [w(4 + c * 8 + g * 4 + t) for t in range(4)]
    total = None
    for half in (0, 1):  # the low nibbles (sub-block 2c), then the high ones (2c + 1)
        sc, mn = _k_scale_min((s0, s1, s2), c * 2 + half)
        start = block * 256 + c * 64 + half * 32 + g * 16  # the lane's 16 elements of the sub-block
        acc = None
        for t, word in enumerate(quants):
            nibbles = ((word >> (4 * half)) & 0x0F0F0F0F).bitcast(dtypes.int32)  # elements 4t .. 4t + 3 as bytes
            pair = (start + t * 4) // 2
            acc = dp2a(
                False, _x_pair(words, n, pair, cuda), nibbles, nibbles.const_like(0) if acc is None else acc, cuda
            )
            acc = dp2a(True, _x_pair(words, n, pair + 1, cuda), nibbles, acc, cuda)
        part = scales[n, start // RUN] * (
            d * sc * acc.cast(dtypes.float32) - dmin * mn * sums[n, start // 16].cast(dtypes.float32)
        )
        total = part if total is None else total + part
    return total


def q6_k_dot(w, lanes: list[UOp], x: tuple[UOp, ...], n: int, block: UOp, cuda: bool) -> UOp:
    """A lane's Q6_K unit (lanes h, g, p4: ``gemv.q6_k``'s) times row ``n`` of quantized x (words, scales), float32:
    for each r < 4 the 4 elements 128h + 32r + 4p .. + 3 (p = 4g + p4; sub-block 8h + 2r + g), their signed six-bit
    quants in one word's bytes, two dp2a, then d * scale * x's run scale."""
    (h, g, p4), (words, scales) = lanes, x
    p = g * 4 + p4
    d, (low_a, low_b, high), scale_words = q6_k_words(w, h, p)
    total = None
    for r in range(4):
        low = ((low_a if r % 2 == 0 else low_b) >> (4 * (r // 2))) & 0x0F0F0F0F
        unsigned = low | (((high >> (2 * r)) & 0x03030303) << 4)  # each byte 0..63
        quads = ((unsigned + 0x60606060) ^ 0x80808080).bitcast(dtypes.int32)  # each byte q - 32 as int8
        start = block * 256 + h * 128 + r * 32 + p * 4
        acc = dp2a(False, _x_pair(words, n, start // 2, cuda), quads, quads.const_like(0), cuda)
        acc = dp2a(True, _x_pair(words, n, start // 2 + 1, cuda), quads, acc, cuda)
        part = scales[n, start // RUN] * (d * q6_k_scale(scale_words, g, r) * acc.cast(dtypes.float32))
        total = part if total is None else total + part
    return total


#: each type's integer dot product of a lane's unit (``gemv.Threads.products``)
DOTS = {Q.Q4_K: q4_k_dot, Q.Q6_K: q6_k_dot}
#: how many of ``Quantized.tensors()`` each type's product reads (words, scales, sums: Q6_K needs no sums; a kernel's
#: parameter it never reads is dropped by tinygrad, shifting the others)
PARAMS = {Q.Q4_K: 3, Q.Q6_K: 2}
