"""GGUF block formats dequantized with tinygrad Tensor ops, from the raw bytes kept on the device.

Each function takes the stored bytes as a uint8 Tensor [..., blocks, block_bytes] and returns float32
[..., blocks * block_size]. They are lazy: inside a matmul tinygrad fuses them into the kernel that
reads the blocks, so no dequantized copy of a weight is ever stored. The arithmetic follows
gguf-py's numpy dequantizers operation by operation (same products in the same order), so the
float32 results are bit for bit those of ``gguf.quants.dequantize``.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
from tinygrad import Tensor, dtypes

Q = gguf.GGMLQuantizationType
QK_K = 256


def _f16(raw: Tensor) -> Tensor:
    """Little-endian float16 values from byte pairs along the last axis, as float32."""
    u = raw.cast(dtypes.uint16)
    return (u[..., 0::2] + u[..., 1::2] * 256).bitcast(dtypes.float16).cast(dtypes.float32)


def _u32(raw: Tensor) -> Tensor:
    """Little-endian uint32 values from groups of 4 bytes along the last axis (as int64, to shift freely)."""
    u = raw.cast(dtypes.int64)
    return u[..., 0::4] + u[..., 1::4] * 256 + u[..., 2::4] * 65536 + u[..., 3::4] * 16777216


def _nibbles(qs: Tensor) -> Tensor:
    """Low nibbles of all bytes, then high nibbles: [..., b] -> [..., 2b] (the Q4/Q5 element order)."""
    q = qs.cast(dtypes.int32)
    return (q % 16).cat(q // 16, dim=-1)


def _powers(base: int, count: int, like: Tensor, trailing: int = 0) -> Tensor:
    """base ** [0, count) shaped to broadcast against ``like``'s axes, with ``trailing`` axes of 1 after it."""
    shape = (*([1] * (like.ndim - 1 - trailing)), count, *([1] * trailing))
    return Tensor([base**i for i in range(count)], dtype=dtypes.int64, device=like.device).reshape(shape)


def _flat(x: Tensor) -> Tensor:
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def q8_0(b: Tensor) -> Tensor:
    # 34 bytes: f16 scale d, 32 x int8
    d, qs = _f16(b[..., :2]), b[..., 2:].bitcast(dtypes.int8).cast(dtypes.float32)
    return _flat(d * qs)


def q4_0(b: Tensor) -> Tensor:
    # 18 bytes: f16 d, 16 bytes of nibbles (element j low nibble, element j + 16 high nibble), offset 8
    d = _f16(b[..., :2])
    return _flat(d * (_nibbles(b[..., 2:]) - 8).cast(dtypes.float32))


def q4_1(b: Tensor) -> Tensor:
    # 20 bytes: f16 d, f16 m, 16 bytes of nibbles: x = d * q + m
    d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
    return _flat(d * _nibbles(b[..., 4:]).cast(dtypes.float32) + m)


def _q5_high(qh: Tensor) -> Tensor:
    """The fifth bits of 32 elements, from a little-endian uint32 (bit j belongs to element j), as 0 or 16."""
    return (qh // _powers(2, 32, qh) % 2 * 16).reshape(*qh.shape[:-1], 32)


def q5_0(b: Tensor) -> Tensor:
    # 22 bytes: f16 d, uint32 of fifth bits, 16 bytes of nibbles; offset 16
    d, qh = _f16(b[..., :2]), _u32(b[..., 2:6])
    q = _nibbles(b[..., 6:]) + _q5_high(qh).cast(dtypes.int32)
    return _flat(d * (q - 16).cast(dtypes.float32))


def q5_1(b: Tensor) -> Tensor:
    # 24 bytes: f16 d, f16 m, uint32 of fifth bits, 16 bytes of nibbles
    d, m, qh = _f16(b[..., :2]), _f16(b[..., 2:4]), _u32(b[..., 4:8])
    q = _nibbles(b[..., 8:]) + _q5_high(qh).cast(dtypes.int32)
    return _flat(d * q.cast(dtypes.float32) + m)


def _k_scale_min(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 8 six-bit scales and mins packed in 12 bytes (gguf-py's Q4_K.get_scale_min)."""
    s = scales.cast(dtypes.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = (d % 64).cat((md % 16) + (d // 4) // 16 * 16, dim=-1)
    mn = (m % 64).cat((md // 16) + (m // 4) // 16 * 16, dim=-1)
    return sc.cast(dtypes.float32), mn.cast(dtypes.float32)


def q4_k(b: Tensor) -> Tensor:
    # 144 bytes: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes: 4 chunks of 32 bytes, each low
    # nibbles (32 elements) then high nibbles (32 elements); x = d * sc * q - dmin * m per 32 elements
    lead = b.shape[:-1]
    d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
    sc, mn = _k_scale_min(b[..., 4:16])
    qs = b[..., 16:].reshape(*lead, 4, 1, 32).cast(dtypes.int32)
    q = (qs % 16).cat(qs // 16, dim=-2).reshape(*lead, 8, 32).cast(dtypes.float32)
    return _flat(((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(*lead, QK_K))


def q5_k(b: Tensor) -> Tensor:
    # 176 bytes: f16 d, f16 dmin, 12 bytes scales/mins, 32 bytes of fifth bits, 128 bytes of nibbles
    lead = b.shape[:-1]
    d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
    sc, mn = _k_scale_min(b[..., 4:16])
    qh = b[..., 16:48].reshape(*lead, 1, 32).cast(dtypes.int32)
    high = (
        (qh // _powers(2, 8, qh, trailing=1).cast(dtypes.int32)) % 2 * 16
    )  # bit i of byte j belongs to element 32 i + j
    qs = b[..., 48:].reshape(*lead, 4, 1, 32).cast(dtypes.int32)
    low = (qs % 16).cat(qs // 16, dim=-2).reshape(*lead, 8, 32)
    q = (low + high).cast(dtypes.float32)
    return _flat(((d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)).reshape(*lead, QK_K))


def q6_k(b: Tensor) -> Tensor:
    # 210 bytes: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 elements),
    # f16 d. Elements come in two halves of 128: low nibbles of 64 bytes (low then high nibble), highs
    # of 32 bytes at shifts 0, 2, 4, 6.
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(*lead, 2, 1, 64).cast(dtypes.int32)
    ql = (ql % 16).cat(ql // 16, dim=-2).reshape(*lead, 2, 4, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32).cast(dtypes.int32)
    qh = (qh // _powers(4, 4, qh, trailing=1).cast(dtypes.int32)) % 4
    q = (ql + qh * 16 - 32).reshape(*lead, 16, 16).cast(dtypes.float32)
    scales = b[..., 192:208].bitcast(dtypes.int8).cast(dtypes.float32)
    d = _f16(b[..., 208:210])
    return _flat(((d * scales).unsqueeze(-1) * q).reshape(*lead, QK_K))


def _e2m1(n: Tensor) -> Tensor:
    """gguf's doubled E2M1 values of nibbles: 0, 1, 2, 3, 4, 6, 8, 12 for 0..7, negated for 8..15."""
    m = n % 8
    magnitude = (m < 4).where(m, (m < 6).where(m * 2 - 4, m * 4 - 16))
    return (n >= 8).where(-magnitude, magnitude).cast(dtypes.float32)


def mxfp4(b: Tensor) -> Tensor:
    # 17 bytes: E8M0 exponent e, 16 bytes of nibbles (byte j: element j low, j + 16 high); d = 2^(e - 128), made as
    # ggml_e8m0_to_fp32_half makes it (e < 2: the subnormal 0x00200000 << e)
    e = b[..., :1].cast(dtypes.int32)
    d = (e < 2).where((e == 1).where(0x00400000, 0x00200000), (e - 1) * (1 << 23)).bitcast(dtypes.float32)
    return _flat(d * _e2m1(_nibbles(b[..., 1:])))


#: block dequantizers by GGUF type; the other types are dequantized at load (see TinygradBackend.upload)
DEQUANTIZERS: dict[Q, Callable[[Tensor], Tensor]] = {
    Q.Q8_0: q8_0,
    Q.Q4_0: q4_0,
    Q.Q4_1: q4_1,
    Q.Q5_0: q5_0,
    Q.Q5_1: q5_1,
    Q.Q4_K: q4_k,
    Q.Q5_K: q5_k,
    Q.Q6_K: q6_k,
    Q.MXFP4: mxfp4,
}
