"""llama.cpp's activation rounding: what ggml's CPU matmul does to x before a product with a quantized weight.

ggml never multiplies float activations by quantized weights. Each weight type names a ``vec_dot_type``
(``type_traits_cpu`` in ggml-cpu.c) and the activation rows are first converted to it: Q8_1 for Q4_1 and Q5_1, Q8_K
(blocks of 256) for the K-quants, IQ2/IQ3/IQ1, IQ4_XS and TQ types, Q8_0 for the other 32-blocks (Q4_0, Q5_0, Q8_0,
IQ4_NL, MXFP4), F16 for F16 and BF16 for BF16. The integer dot products then compute, up to float summation order,
the product of the dequantized weight and the dequantized activations, with one exception: Q8_1 carries
``s = fp16(d * sum(q))`` per block, and the Q4_1/Q5_1 dot uses it for the weight's block minimum ``m``
(``d_w*d_x*sum(q_w*q_x) + m*s``), so the product is ``W @ x_rounded + m @ (s - fp16(d) * sum(q))``.

The functions follow ggml-quants.c's reference code (``quantize_row_q8_0_ref``, ``quantize_row_q8_1_ref``,
``quantize_row_q8_K_ref``). ggml's x86 build scales Q8_0/Q8_1 blocks by ``127/amax`` instead of ``1/(amax/127)``
and rounds half to even instead of away from zero: the two differ only on exact ties.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
Q8_0_BLOCK = gguf.GGML_QUANT_SIZES[Q.Q8_0][0]
Q8_K_BLOCK = gguf.GGML_QUANT_SIZES[Q.Q8_K][0]


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    return np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, size)


def _round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (half away from zero) of float32 values; numpy's round is half to even."""
    return np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)


def q8_0(x: np.ndarray) -> np.ndarray:
    """x rounded as ``quantize_row_q8_0_ref`` then dequantized: per block of 32, d = amax / 127 (float32),
    q = roundf(x / d), and the value fp16(d) * q (the block stores d as fp16, the quantization used the float)."""
    blocks = _blocks(x, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0))
    q = _round_away(blocks * inverse)
    return (q * d.astype(np.float16).astype(np.float32)).astype(np.float32).reshape(x.shape)


def q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded as ``quantize_row_q8_1_ref`` (q and d as Q8_0) then dequantized, and per block the error of its
    stored sum: ``fp16(d * sum(q)) - fp16(d) * sum(q)`` [..., blocks], which the Q4_1/Q5_1 dot multiplies by ``m``."""
    blocks = _blocks(x, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d > 0, np.float32(1) / d, np.float32(0))
    q = _round_away(blocks * inverse)
    d16 = d.astype(np.float16).astype(np.float32)
    total = q.sum(axis=-1, keepdims=True)
    s16 = (total * d).astype(np.float32).astype(np.float16).astype(np.float32)
    sum_error = (s16 - (total * d16).astype(np.float32))[..., 0]
    return (q * d16).astype(np.float32).reshape(x.shape), sum_error


def q8_k(x: np.ndarray) -> np.ndarray:
    """x rounded as ``quantize_row_q8_K_ref`` then dequantized: per block of 256, the value of largest magnitude
    (the first, on ties) maps to -127: iscale = -127 / max, q = min(127, nearest_int(iscale * x)) (half to even),
    and the value (1 / iscale) * q, the scale kept in float32."""
    blocks = _blocks(x, Q8_K_BLOCK)
    first_largest = np.abs(blocks).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(blocks, first_largest, axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(peak != 0, np.float32(-127) / peak, np.float32(0))
        d = np.where(peak != 0, np.float32(1) / iscale, np.float32(0))
    q = np.minimum(127, np.rint(blocks * iscale))
    return (q * d).astype(np.float32).reshape(x.shape)


def f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the top 16 bits, as ggml_compute_fp32_to_bf16 (NaNs stay NaN)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return np.where(np.isnan(x), x, rounded.astype(np.uint32).view(np.float32)).astype(np.float32)


def rounding_for(qtype: Q) -> Callable[[np.ndarray], np.ndarray] | None:
    """The activation rounding ggml applies before a product with a ``qtype`` weight (None: float32, unrounded).
    Q4_1 and Q5_1 take :func:`q8_1`, which also returns the stored sums' error."""
    if qtype == Q.F32:
        return None
    if qtype == Q.F16:
        return f16
    if qtype == Q.BF16:
        return bf16
    if qtype in (Q.Q4_1, Q.Q5_1):
        return q8_1
    return q8_k if gguf.GGML_QUANT_SIZES[qtype][0] == Q8_K_BLOCK else q8_0


def block_minimums(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """The per-block minimum ``m`` [rows, blocks] of a Q4_1 or Q5_1 tensor: each block starts with fp16 d, fp16 m."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, shape[-1] // block, size)
    return np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
