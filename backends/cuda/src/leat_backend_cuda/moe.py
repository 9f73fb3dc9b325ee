"""Mixture-of-experts and per-head products on the CUDA backend (``kernels/moe.cu``, ``kernels/experts.cu``).

A MoE layer is, as llama.cpp's ``mul_mat_id``: the router product, a routing kernel that writes the
selected expert ids and weights [n, k] on the device, the gate and up products of only the selected
experts with the gated activation in one launch (``gemv_id``: pair (token, j) multiplies expert
``ids[token, j]``), the down product of the same experts, and the weighted sum: five launches. Nothing
is read back to the host, so the layer is captured in decode graphs like any other op.

Up to GROUPED_TOKENS tokens, ``gemv_id`` runs one (token, expert) pair per block row, decoding and
multiplying in float32. More tokens are first grouped by expert on the device (``moe_group``); then, for
the types in TENSOR_TYPES (those of the MoE bench files' experts and MLA's per-head matrices),
``gemm_grouped`` multiplies each chunk of 8 NT pairs of one expert on tensor cores (f16 products of
x_to_f16's rows, float32 sums; each weight decoded once per chunk straight into mma fragments), and for
the other types (or with LEAT_CUDA_MOE_GEMM=0) ``gemv_grouped`` decodes each weight once per
GROUPED_PAIRS pairs in float32.
"""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
from leat.errors import LeatError
from leat.moe import MoESpec, MoEWeights

from leat_backend_cuda import quants
from leat_backend_cuda.driver import DeviceArray, Module

Q = gguf.GGMLQuantizationType
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)
MOE_KERNELS = ["moe_route", "moe_group", "head_group", "moe_glu", "moe_combine", "gemv_id_f32"]
GROUPED_PAIRS = 8  # pairs per block of gemv_grouped (its NC)
GROUPED_TOKENS = 8  # more tokens than this: expert products grouped by expert
#: expert (and per-head) types with gemm_grouped, the tensor-core product of many tokens
TENSOR_TYPES = (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0, Q.MXFP4)
#: gemm_grouped's (tiles of 8 pairs a chunk NT, stages of x in shared memory) instantiated: the first by default;
#: LEAT_CUDA_MOE_TILES and LEAT_CUDA_MOE_STAGES pick another
GEMM_VARIANTS = ((8, 2), (8, 1), (4, 2))
GEMM_TILES = tuple(sorted({nt for nt, _ in GEMM_VARIANTS}, reverse=True))
#: gemm_grouped's 16-row tiles per warp (RT), by whether it applies the gated activation (gate and up both held)
GEMM_ROW_TILES = {False: 2, True: 1}
GATING = {"softmax": 0, "softmax_selected": 1, "sigmoid": 2}
ACTIVATION = {"silu": 0, "swiglu_oai": 1}


def expert_kernels(qtype: Q) -> list[str]:
    """gemv_id, gemv_id_q (quantized types) and gemv_grouped for ``qtype`` (experts.cu), plain and with the gated
    activation."""
    struct = quants.LAYOUTS[qtype].struct
    names = [f"gemv_id<{struct}, {glu}>" for glu in ("false", "true")]
    names += [f"gemv_grouped<{struct}, {GROUPED_PAIRS}, {glu}>" for glu in ("false", "true")]
    if qtype in TENSOR_TYPES:
        names += [gemm_grouped_name(qtype, glu, v) for v in GEMM_VARIANTS for glu in (False, True)]
    if quants.LAYOUTS[qtype].integer:
        names += [gemv_id_q_name(qtype, units, glu) for units in (1, 2) for glu in (False, True)]
    return names


def gemv_id_q_name(qtype: Q, units: int, glu: bool) -> str:
    """gemv_id_q for ``qtype`` (2 rows a warp; ``units`` in flight a lane)."""
    return f"gemv_id_q<{quants.LAYOUTS[qtype].dot_struct}, 2, {units}, {str(glu).lower()}>"


def gemm_grouped_name(qtype: Q, glu: bool, variant: tuple[int, int]) -> str:
    tiles, stages = variant
    return f"gemm_grouped<{quants.LAYOUTS[qtype].struct}, {tiles}, {GEMM_ROW_TILES[glu]}, {str(glu).lower()}, {stages}>"


def gemm_smem(variant: tuple[int, int]) -> int:
    """gemm_grouped's dynamic shared memory: its stages of x, 8 NT rows of GROUPED_KC + 8 f16 values each."""
    tiles, stages = variant
    return stages * 8 * tiles * (256 + 8) * 2


def gemm_variant(tiles: int | None = None) -> tuple[int, int]:
    """The gemm_grouped instantiation (NT, stages) to run: GEMM_VARIANTS[0], or the one LEAT_CUDA_MOE_TILES and
    LEAT_CUDA_MOE_STAGES name (``tiles``: NT already chosen), where it is instantiated."""
    default = GEMM_VARIANTS[0]
    tiles = tiles or int(os.environ.get("LEAT_CUDA_MOE_TILES", str(default[0])))
    wanted = (tiles, int(os.environ.get("LEAT_CUDA_MOE_STAGES", "2")))
    return wanted if wanted in GEMM_VARIANTS else next((v for v in GEMM_VARIANTS if v[0] == tiles), default)


def group_warps(pairs: int, experts: int) -> int:
    """Warps of moe_group's block: one per 32 pairs, at most 32, and their shared [warps][experts] counts within
    the 48 KiB a block may take without opting in."""
    return max(1, min(32, -(-pairs // 32), 12288 // experts))


def programs() -> list[tuple[str, list[str]]]:
    """The kernel programs of this module (for build.py: every one compiles ahead of time)."""
    return [("moe.cu", MOE_KERNELS)] + [("experts.cu", expert_kernels(q)) for q in quants.LAYOUTS]


def _ready(x: Any) -> Any:
    """A pending array (backend.Pending) launched; anything else as it is."""
    return x.materialize() if hasattr(x, "materialize") else x


class ExpertOps:
    """``moe`` and ``head_matmul`` for :class:`~leat_backend_cuda.backend.CUDABackend` (a mixin: it uses
    the backend's device, pool and module cache)."""

    #: a decode step's products with quantized experts (and per-head matrices) by gemv_id_q's integer dot products
    #: (x rounded to int16 runs, as the dense gemv_q); False: gemv_id's float32 decode-and-FMA
    integer_experts = True

    def _moe_module(self) -> Module:
        return self._module("moe", "moe.cu", MOE_KERNELS, {})

    def _product_id(
        self,
        x: DeviceArray,
        weight: Any,
        pairs: int,
        ids: DeviceArray | None,
        x_div: int,
        bias: Any = None,
        groups: tuple[DeviceArray, DeviceArray, DeviceArray, int] | None = None,
        up: Any = None,
        up_bias: Any = None,
        spec: MoESpec | None = None,
    ) -> DeviceArray:
        """y [pairs, M]: pair p times matrix ``ids[p]`` (or ``p % E`` without ids) of the stacked
        ``weight`` [E, M, K] by row ``p // x_div`` of x, plus ``bias[e]`` ([E, M] or [M] when E is 1).
        ``groups`` (moe_group's start, chunk_start, order of ``ids`` in chunks, and their size): each weight
        decoded once per chunk, by gemv_grouped (chunks of GROUPED_PAIRS) or gemm_grouped (8 NT pairs). With ``up`` (of weight's type and shape), ``spec``'s gated activation of
        the two products (plus ``up_bias``)."""
        shape = weight.shape
        experts, m, k = (shape[0], shape[1], shape[2]) if len(shape) == 3 else (1, shape[0], shape[1])
        if x.shape[-1] != k:
            raise ValueError(f"{weight.name}: rows of {k} values, but x has {x.shape[-1]} columns")
        out = self._empty((pairs, m))
        bias = self._dense(bias)
        grid_y = -(-m // 4) if weight.kernels is None else -(-m // 8)
        if weight.kernels is None:  # float32 rows not a multiple of 8 long
            kernel = self._moe_module()["gemv_id_f32"]
            kernel((pairs, grid_y), 128, weight.ptr, ids, experts, x, x_div, out, bias, m, k)
        else:
            names = expert_kernels(weight.qtype)
            smem = {gemm_grouped_name(weight.qtype, g, v): gemm_smem(v) for v in GEMM_VARIANTS for g in (False, True)}
            smem |= {name: quants.GEMV_Q_MAX_SMEM for name in names if name.startswith("gemv_id_q")}
            module = self._module(f"experts-{weight.qtype.name}", "experts.cu", names, smem)
            fused = int(up is not None)
            glu = (None, None, 0, 0.0, 0.0)
            if fused:
                glu = (up, self._dense(up_bias), ACTIVATION[spec.activation], float(spec.alpha), float(spec.limit))
            layout = quants.LAYOUTS[weight.qtype]
            x_smem = quants.gemv_q_smem(weight.qtype, 1, k) if layout.integer else 0
            if groups is None and layout.integer and self.integer_experts and x_smem <= quants.GEMV_Q_MAX_SMEM:
                # integer dot products (gemv_id_q): the blocks of a pair share out its row groups, about as many
                # blocks in all as the card holds at once, so each quantizes x once for several groups
                values, _ = quants.unit_shape(weight.qtype)
                units = 2 if k // values >= 64 else 1
                kernel = module[gemv_id_q_name(weight.qtype, units, bool(fused))]
                row_groups = -(-m // 8)
                per_pair = -(-self.device.sm_count * kernel.occupancy(128, x_smem) // pairs)
                kernel(
                    (pairs, max(1, min(row_groups, per_pair))),
                    128,
                    weight.ptr,
                    weight.blocks,
                    ids,
                    experts,
                    _ready(x),
                    x_div,
                    out,
                    bias,
                    m,
                    k,
                    *glu,
                    smem=x_smem,
                )
            elif groups is None:
                module[names[fused]](
                    (pairs, grid_y), 128, weight.ptr, weight.blocks, ids, experts, x, x_div, out, bias, m, k, *glu
                )
            elif groups[3] != GROUPED_PAIRS:
                xh, xscale = self._f16_rows(x, x.size // k, k)
                variant = gemm_variant(groups[3] // 8)
                module[gemm_grouped_name(weight.qtype, bool(fused), variant)](
                    (-(-pairs // groups[3]) + experts, -(-m // (64 * GEMM_ROW_TILES[bool(fused)]))),
                    128,
                    weight.ptr,
                    weight.blocks,
                    *groups[:3],
                    experts,
                    xh,
                    xscale,
                    x_div,
                    out,
                    bias,
                    m,
                    k,
                    *glu,
                    smem=gemm_smem(variant),
                )
            else:
                blocks = -(-pairs // GROUPED_PAIRS) + experts
                module[names[2 + fused]](
                    (blocks, grid_y),
                    128,
                    weight.ptr,
                    weight.blocks,
                    *groups[:3],
                    experts,
                    x,
                    x_div,
                    out,
                    bias,
                    m,
                    k,
                    *glu,
                )
        return out

    def _chunk_pairs(self, *matrices: Any) -> int:
        """Pairs per chunk of a grouping that ``matrices`` are all multiplied with: 8 NT where gemm_grouped
        takes every one (tensor cores, a type of TENSOR_TYPES, LEAT_CUDA_MOE_GEMM not 0), else GROUPED_PAIRS."""
        gemm = self.tensor_cores and os.environ.get("LEAT_CUDA_MOE_GEMM", "1") != "0"
        if gemm and all(w.kernels is not None and w.qtype in TENSOR_TYPES for w in matrices):
            return 8 * gemm_variant()[0]
        return GROUPED_PAIRS

    def _dense(self, bias: Any) -> DeviceArray | None:
        """A bias as float32 on the device: vectors are uploaded so; 2-D biases must be F32 (as GGUF
        converters store them)."""
        if bias is None or isinstance(bias, DeviceArray):
            return bias
        if bias.qtype != Q.F32:
            raise LeatError(f"{bias.name} is {bias.qtype.name}; the cuda backend takes expert biases in F32 only")
        return DeviceArray(bias.ptr, bias.shape, F32, bias.memory)

    def moe(self, x: Any, weights: MoEWeights, spec: MoESpec) -> DeviceArray:
        x = _ready(x)
        n = x.size // x.shape[-1]
        k, experts = spec.experts_used, spec.experts
        ops = self._moe_module()
        # router logits in float32 (gemv_id, or gemv_grouped with one matrix), not on tensor cores: routing follows
        # logit order
        grouped = n > GROUPED_TOKENS and weights.router.kernels is not None
        groups = self._head_groups(n, 1, GROUPED_PAIRS) if grouped else None
        logits = self._product_id(x, weights.router, n, None, 1, weights.router_bias, groups)
        ids, gains = self._empty((n, k), I32), self._empty((n, k))
        limited = spec.groups if spec.groups > 1 else 0
        smem = 4 * (2 * experts + limited) + experts + limited + 4
        ops["moe_route"](
            (n,),
            32,
            logits,
            self._dense(weights.selection_bias),
            ids,
            gains,
            experts,
            k,
            GATING[spec.gating],
            int(spec.normalize),
            float(spec.scale),
            limited,
            spec.groups_used if limited else 0,
            smem=smem,
        )
        groups = None
        gate, up = weights.gate, weights.up
        if n > GROUPED_TOKENS:
            chunk = self._chunk_pairs(gate, up, weights.down)
            tables = (self._empty((experts + 1,), I32), self._empty((experts + 1,), I32), self._empty((n * k,), I32))
            warps = group_warps(n * k, experts)
            ops["moe_group"]((1,), 32 * warps, ids, n * k, experts, chunk, *tables, smem=4 * warps * experts)
            groups = (*tables, chunk)
        if gate.kernels is not None and (gate.qtype, gate.shape) == (up.qtype, up.shape):  # one launch for both
            h = self._product_id(x, gate, n * k, ids, k, weights.gate_bias, groups, up, weights.up_bias, spec)
        else:
            g = self._product_id(x, gate, n * k, ids, k, weights.gate_bias, groups)
            u = self._product_id(x, up, n * k, ids, k, weights.up_bias, groups)
            h = self._empty(g.shape)
            total = g.size
            grid = max(1, min(-(-total // 256), 8 * self.device.sm_count))
            ops["moe_glu"](
                (grid,), 256, g, u, h, total, ACTIVATION[spec.activation], float(spec.alpha), float(spec.limit)
            )
        y = self._product_id(h, weights.down, n * k, ids, 1, weights.down_bias, groups)
        if self.fuse:  # the weighted sum waits: the layer's residual add takes it in (CUDABackend.add)
            return self._pending(x.shape, lambda: self._combine(y, gains, x.shape), ("combine", y, gains, x.shape))
        return self._combine(y, gains, x.shape)

    def _combine(self, y: DeviceArray, gains: DeviceArray, shape: tuple, residual: Any = None) -> DeviceArray:
        """The weighted sum of each token's k expert outputs (y [n * k, d], gains [n, k]) as an array of ``shape``,
        plus ``residual`` (of that shape)."""
        (n, k), d = gains.shape, y.shape[-1]
        out = self._empty(shape)
        threads = max(32, min(256, -(-d // 32) * 32))
        self._moe_module()["moe_combine"]((n, -(-d // threads)), threads, y, gains, residual, out, k, d)
        return out

    def head_matmul(self, x: Any, weight: Any) -> DeviceArray:
        x = _ready(x)
        n, heads, _ = x.shape
        if len(weight.shape) != 3 or weight.shape[0] != heads:
            raise ValueError(f"head_matmul: x has {heads} heads but {weight.name} is {weight.shape}")
        # each head's matrix decoded once per chunk of tokens
        groups = self._head_groups(n, heads, self._chunk_pairs(weight)) if n > GROUPED_TOKENS else None
        out = self._product_id(x, weight, n * heads, None, 1, groups=groups)
        return out.view((n, heads, weight.shape[1]))

    def _head_groups(self, n: int, heads: int, chunk: int) -> tuple[DeviceArray, DeviceArray, DeviceArray, int]:
        """The grouping of pairs t * heads + h by matrix h (head_group), in chunks of ``chunk`` pairs."""
        tables = (self._empty((heads + 1,), I32), self._empty((heads + 1,), I32), self._empty((n * heads,), I32))
        self._moe_module()["head_group"]((1,), 256, n, heads, chunk, *tables)
        return (*tables, chunk)
