"""How GGUF tensors are laid out on the device, and which kernels each type gets.

Types with kernels keep their GGUF bytes. Blocks whose size is a multiple of 16 bytes (Q4_K,
Q5_K, and rows of F32/F16/BF16) are stored as they are; the others are stored as *planes*: field
f of every block together, each plane 16-byte aligned, so that every load is aligned (a Q6_K
block is 210 bytes, a Q8_0 block 34). The fields are GGUF's, in GGUF's order; ``kernels/quants.cuh``
decodes each layout. Types without kernels are dequantized on the host to float32 at upload
(the dequantize-then-multiply fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Layout:
    struct: str  # decoder struct in kernels/quants.cuh
    block: int  # values per device block (8 for the float types)
    units: int  # pieces a block is decoded in (one thread each): the struct's UNITS
    planes: tuple[int, ...] | None = None  # GGUF field sizes in bytes; None = raw blocks
    dot: str = ""  # the struct gemv_q decodes with, where not ``struct`` (another unit of the same bytes)

    @property
    def dot_struct(self) -> str:
        return self.dot or self.struct

    @property
    def integer(self) -> bool:
        """Quantized (not a float type): has the integer dot product of gemv_q."""
        return self.struct not in ("TF32", "TF16", "TBF16")

    @property
    def small_block(self) -> bool:
        """Blocks of at most 32 values: the GEMM can step K by 32 for rows not a multiple of 256."""
        return self.block <= 32


LAYOUTS: dict[Q, Layout] = {
    Q.F32: Layout("TF32", 8, 1),
    Q.F16: Layout("TF16", 8, 1),
    Q.BF16: Layout("TBF16", 8, 1),
    Q.Q8_0: Layout("TQ8_0", 32, 2, (2, 32)),
    Q.Q4_0: Layout("TQ4_0", 32, 1, (2, 16)),
    Q.Q4_1: Layout("TQ4_1", 32, 1, (4, 16)),
    Q.Q5_0: Layout("TQ5_0", 32, 1, (2, 4, 16)),
    Q.Q5_1: Layout("TQ5_1", 32, 1, (4, 4, 16)),
    Q.MXFP4: Layout("TMXFP4", 32, 1, (1, 16)),
    Q.IQ4_NL: Layout("TIQ4_NL", 32, 1, (2, 16)),
    Q.IQ4_XS: Layout("TIQ4_XS", 256, 8, (8, 128)),
    Q.IQ2_XXS: Layout("TIQ2_XXS", 256, 8, (2, 64)),
    Q.IQ2_XS: Layout("TIQ2_XS", 256, 8, (2, 64, 8)),
    Q.IQ2_S: Layout("TIQ2_S", 256, 8, (2, 32, 32, 8, 8)),
    Q.IQ3_XXS: Layout("TIQ3_XXS", 256, 8, (2, 64, 32)),
    Q.IQ3_S: Layout("TIQ3_S", 256, 8, (2, 64, 8, 32, 4)),
    Q.IQ1_S: Layout("TIQ1_S", 256, 8, (2, 32, 16)),
    Q.IQ1_M: Layout("TIQ1_M", 256, 8, (32, 16, 8)),
    Q.Q2_K: Layout("TQ2_K", 256, 8, (16, 64, 4)),
    Q.Q3_K: Layout("TQ3_K", 256, 8, (32, 64, 12, 2)),
    Q.Q4_K: Layout("TQ4_K", 256, 8, dot="TQ4_KP"),
    Q.Q5_K: Layout("TQ5_K", 256, 8),
    Q.Q6_K: Layout("TQ6_K", 256, 8, (128, 64, 16, 2), dot="TQ6_KP"),
}

#: tokens per launch of the float matrix-vector kernel (float weights, or no tensor cores)
GEMV_MAX_TOKENS = 8
#: tokens per launch of the integer matrix-vector kernel (quantized weights); more go to the GEMM
GEMV_Q_MAX_TOKENS = 4
GEMV_Q_MAX_SMEM = 100 * 1024
#: (rows per warp, units in flight per lane) of the matrix-vector kernels, by token count
GEMV_SHAPES = {1: (2, 2), 2: (2, 2), 3: (2, 1), 4: (2, 1), 5: (1, 2), 6: (1, 2), 7: (1, 2), 8: (1, 2)}
#: fusion modes of gemv_q (kernels/matmul.cu): 1 normalizes x first, 2 multiplies by gate and up
GEMV_Q_NORM, GEMV_Q_GLU = 1, 2
#: gemv_q's mode bit for its pipelined loop (the next step's loads issued before the current step's products): a
#: variant of the kernel, not a fusion (scripts/decode_shapes.py times it; the gated unit and the long down rows take it)
GEMV_Q_PIPE = 4
#: gemv_q's fusion bit for RoPE and the cache write in its epilogue (one token; rows of q rotated into its output, of k
#: rotated into the K cache, of v into the V cache: rope_kv_write's work without its launch)
GEMV_Q_ROPE = 16
#: gemv_q's mode bit for its split over K inside a block (8 warps, two a group of rows, each taking every other step of
#: the units; their sums added in shared memory): a variant, not a fusion, for one token, not with the pipelined loop.
#: The rule takes it for the shapes it names (gemv_q_shape's ``split``; LEAT_CUDA_GEMV_SPLIT=0: none)
GEMV_Q_SPLIT = 32
#: tokens up to which gemv_q is instantiated with fusion modes
GEMV_Q_FUSED_TOKENS = 2
#: (tokens, rows per warp, units per lane, mode) of every gemv_q instantiation
GEMV_Q_VARIANTS = (
    [(1, r, u, m) for r, u in ((8, 1), (4, 1), (4, 2), (2, 2)) for m in (0, 1)]
    + [(1, 8, 2, 1), (1, 4, 1, GEMV_Q_PIPE), (1, 4, 1, GEMV_Q_PIPE | 1)]
    + [(1, 2, 2, m) for m in (2, 3)]
    + [(1, 1, 2, GEMV_Q_PIPE | m) for m in (2, 3)]
    + [(2, 2, 2, m) for m in (0, 1, 2, 3)]
    + [(3, 2, 1, 0), (4, 2, 1, 0)]
)
#: the ROPE twins: the one-token shapes the rule gives q, k and v (rows a warp even, no gated unit, not pipelined)
GEMV_Q_VARIANTS += [
    (1, r, u, m | GEMV_Q_ROPE) for t, r, u, m in GEMV_Q_VARIANTS if t == 1 and m in (0, 1) and r % 2 == 0
]
#: the split shapes the rule gives (the fifty-second session's sweep's three: v alone and other products of fewer than
#: 4,096 rows (2, 1), o (4, 1), down (2, 2); q, k and v stay whole) and their ROPE twins: compiled where the split is
#: on (kernel_names' ``split``; the backend's default, LEAT_CUDA_GEMV_SPLIT=0 leaves them out)
GEMV_Q_SPLIT_VARIANTS = [(1, r, u, m | GEMV_Q_SPLIT) for r, u, m in ((2, 1, 0), (2, 1, 1), (4, 1, 0), (2, 2, 0))]
GEMV_Q_SPLIT_VARIANTS += [(t, r, u, m | GEMV_Q_ROPE) for t, r, u, m in GEMV_Q_SPLIT_VARIANTS]
#: the longest rows the rule splits: x's shared memory and the reduction's under GEMV_Q_MAX_SMEM for every integer type
GEMV_Q_SPLIT_MAX_COLS = 32768
#: gemv_q's last arguments where it has no ROPE epilogue: roles, the token slots, positions, page table, RoPE
#: positions, frequencies, K and V caches; f16 or not, head_dim, dims, pages a slot, page size, the factor
GEMV_Q_NO_ROPE: tuple = (0, None, None, None, None, None, None, None, 0, 0, 0, 0, 0, 0.0)


def gemv_q_shape(tokens: int, mode: int, rows: int, cols: int, split: bool = False) -> tuple[int, int, int]:
    """Rows per warp and units in flight per lane for a product of this shape, as measured on an H200 for one token
    (``scripts/decode_shapes.py``: each kind of product of a decode step tried in every shape): the gated unit over
    many rows one row a warp (two with its up row), two units in flight, pipelined; products of 4,096 rows and more
    over rows of more than 8,192 values (down) four rows a warp, one unit, pipelined; other products of 4,096 rows
    and more four rows a warp (eight with the norm inside: q, k and v), two units in flight, but for the output
    matrix; fewer rows (v alone) two by two. The third number is the variant's mode bits (GEMV_Q_PIPE,
    GEMV_Q_SPLIT or 0), added to the fusions'. With ``split`` (the backend's default; LEAT_CUDA_GEMV_SPLIT=0 turns it
    off) the shapes that the split over K made faster in ``decode_shapes.py --split`` (H100, the 8B file; tg128 +1.9
    and +2.5% in ``leat bench``) take it, on rows of up to GEMV_Q_SPLIT_MAX_COLS
    values: the down products two rows by two units, o (attention's output product) four rows by one unit, and fewer
    rows (v alone) two rows by one unit; q, k and v, the gated unit and the vocabulary's output matrix stay whole."""
    if tokens > 2:
        return 2, 1, 0
    if tokens == 2:
        return 2, 2, 0
    if mode & GEMV_Q_GLU:
        return (1, 2, GEMV_Q_PIPE) if rows >= 8192 else (2, 2, 0)
    if rows >= 65536:
        return 4, 1, 0
    if rows >= 8192 and cols <= 8192:
        return 8, 1, 0
    split = split and cols <= GEMV_Q_SPLIT_MAX_COLS
    if rows >= 4096 and cols > 8192:
        return (2, 2, GEMV_Q_SPLIT) if split else (4, 1, GEMV_Q_PIPE)
    if rows >= 4096:
        if mode & GEMV_Q_NORM:
            return 8, 2, 0
        return (4, 1, GEMV_Q_SPLIT) if split else (4, 2, 0)
    return (2, 1, GEMV_Q_SPLIT) if split else (2, 2, 0)


#: (tiles NT, row tiles RT) of every gemm_few instantiation: products of up to 8 * NT tokens, 16 * RT rows a block
GEMM_FEW_VARIANTS = ((1, 1), (2, 1), (2, 2), (4, 2))
#: tokens up to which gemm_few may run (gemm_few_shape decides by rows)
GEMM_FEW_MAX_TOKENS = 32
GEMM_SMEM = {32: (128 + 64) * (32 + 8) * 2, 256: (128 + 64) * (256 + 8) * 2}
#: values per unit, runs per unit of each decoder struct (mirrors quants.cuh; (32, 2) where not listed)
UNIT_SHAPES = {
    "TQ8_0": (16, 1),
    "TQ4_K": (32, 2),
    "TQ4_KP": (64, 4),
    "TQ6_KP": (64, 4),
    "TQ5_K": (32, 2),
    "TQ6_K": (32, 4),
    "TQ2_K": (32, 4),
    "TQ3_K": (32, 4),
}


def gemv_name(qtype: Q, tokens: int, shape: tuple[int, int] | None = None) -> str:
    rows, units = shape or GEMV_SHAPES[tokens]
    return f"gemv<{LAYOUTS[qtype].struct}, {tokens}, {rows}, {units}>"


def gemv_q_name(qtype: Q, tokens: int, shape: tuple[int, int], mode: int = 0) -> str:
    rows, units = shape
    return f"gemv_q<{LAYOUTS[qtype].dot_struct}, {tokens}, {rows}, {units}, {mode}>"


def unit_shape(qtype: Q) -> tuple[int, int]:
    """(values, runs) of a unit of the struct gemv_q (and gemv_id_q) decodes ``qtype`` with."""
    return UNIT_SHAPES.get(LAYOUTS[qtype].dot_struct, (32, 2))


def gemv_q_smem(qtype: Q, tokens: int, cols: int, split_rows: int = 0) -> int:
    """Shared memory of gemv_q: per token and unit (padded to 32), int16 x plus a scale and a sum per run; a split
    variant (GEMV_Q_SPLIT) of ``split_rows`` sums a lane (its rows a warp; twice that with the gated unit's up rows)
    adds its reduction after them, a float per lane, sum and token for each of 4 warps."""
    values, runs = unit_shape(qtype)
    units = -(-(cols // values) // 32) * 32
    return tokens * units * (values * 2 + runs * 8) + 4 * 32 * split_rows * tokens * 4


def gemv_q_threads(mode: int) -> int:
    """Threads a block of gemv_q with these mode bits: 8 warps split over K (GEMV_Q_SPLIT), else 4."""
    return 256 if mode & GEMV_Q_SPLIT else 128


def gemm_name(qtype: Q, kt: int) -> str:
    return f"gemm<{LAYOUTS[qtype].struct}, {kt}>"


def gemm_few_name(qtype: Q, shape: tuple[int, int], glu: bool = False) -> str:
    """gemm_few's instantiation; ``glu``: the gated unit's, gate and up in one launch, silu(gate) * up out."""
    return f"gemm_few<{LAYOUTS[qtype].struct}, {shape[0]}, {shape[1]}, {str(glu).lower()}>"


def gemm_few_smem(shape: tuple[int, int], glu: bool = False) -> int:
    """Shared memory of gemm_few: its 8 warps' partial sums, 4 floats per lane and 16 x 8 tile (twice the tiles
    with ``glu``: gate and up)."""
    tiles, row_tiles = shape
    return 8 * row_tiles * tiles * 4 * 32 * 4 * (2 if glu else 1)


#: (tiles NT, row tiles RT) of every gemm_rows instantiation: 8 * NT tokens a block column, 64 * RT rows a block.
#: One: on the H200 (8, 1) and (4, 2) won only where the products are smallest (docs/benchmarks.md), and every
#: instantiation is compiled for every type
GEMM_ROWS_VARIANTS = ((8, 2),)
#: K values of x a gemm_rows block stages in shared memory at a time (ROWS_KC in matmul.cu): K must be a multiple
GEMM_ROWS_KC = 256


def gemm_rows_name(qtype: Q, shape: tuple[int, int]) -> str:
    return f"gemm_rows<{LAYOUTS[qtype].struct}, {shape[0]}, {shape[1]}>"


def gemm_few_shape(tokens: int, rows: int) -> tuple[int, int] | None:
    """The gemm_few instantiation for a product of ``tokens`` x ``rows``, or None where the GEMM is faster.

    Measured on an H200 over the 8B bench file's shapes (Q4_K and Q6_K; docs/benchmarks.md): up to 8 tokens,
    one tile; 9-16, two tiles, two row tiles a block for 4096 rows or more; 17-32 tokens, four tiles and two
    row tiles, for 4096 rows or more only; beyond that the GEMM, whose tiles share each decoded weight
    among 64 tokens.
    """
    if tokens <= 8:
        return (1, 1)
    if tokens <= 16:
        return (2, 2) if rows >= 4096 else (2, 1)
    if tokens <= 32 and rows >= 4096:
        return (4, 2)
    return None


def kernel_names(qtype: Q, extra_gemv: tuple[tuple[int, int, int], ...] = (), split: bool = False) -> list[str]:
    """Every kernel the backend instantiates for ``qtype`` (``extra_gemv``: more (tokens, rows, units); ``split``:
    with GEMV_Q_SPLIT_VARIANTS, for LEAT_CUDA_GEMV_SPLIT=1)."""
    layout = LAYOUTS[qtype]
    names = [f"dequantize<{layout.struct}>", f"dequantize_f16<{layout.struct}>", f"embed<{layout.struct}>"]
    names += [gemv_name(qtype, n) for n in range(1, GEMV_MAX_TOKENS + 1)]
    names += [gemv_name(qtype, n, (r, u)) for n, r, u in extra_gemv]
    if layout.integer:
        variants = [*GEMV_Q_VARIANTS, *(GEMV_Q_SPLIT_VARIANTS if split else ())]
        names += [gemv_q_name(qtype, n, (r, u), m) for n, r, u, m in variants]
    names += [gemm_name(qtype, kt) for kt in ((32, 256) if layout.small_block else (256,))]
    names += [gemm_few_name(qtype, shape, glu) for shape in GEMM_FEW_VARIANTS for glu in (False, True)]
    names += [gemm_rows_name(qtype, shape) for shape in GEMM_ROWS_VARIANTS]
    return list(dict.fromkeys(names))


def device_bytes(qtype: Q, data: np.ndarray) -> np.ndarray:
    """The bytes to upload for a tensor's raw GGUF data (uint8, 1-D)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    planes = LAYOUTS[qtype].planes
    if planes is None:
        return raw
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    assert sum(planes) == block_bytes, qtype
    blocks = raw.reshape(-1, block_bytes)
    parts, start = [], 0
    for size in planes:
        field = blocks[:, start : start + size].reshape(-1)
        start += size
        parts.append(field)
        if field.size % 16:
            parts.append(np.zeros(16 - field.size % 16, np.uint8))
    return np.concatenate(parts)


def blocks_of(qtype: Q, rows: int, cols: int) -> int:
    """Device blocks in a [rows, cols] tensor (the ``nb`` kernel argument)."""
    return rows * cols // LAYOUTS[qtype].block
