"""Products of 9-64 tokens on Hopper's warpgroup tensor cores (``kernels/wgmma.cu``, sm_90a only).

A batched decode step of 9-64 sequences multiplies every weight by a few dozen tokens. Elsewhere these products go
to cuBLAS over the weights' f16 copies (three to four times the quantized bytes) or to gemm_few/gemm_rows, whose
weight decoding and mma.sync products queue in the same warps. ``gemm_wg`` decodes each quantized weight once
into the registers wgmma takes its A operand from, and reads x (the B operand) from shared memory, where a block
copies it a chunk at a time in the order the decoded fragments take K in (``wg_order_x``, once per product's
input and weight type). One ``wgmma.m64nNk16`` multiplies a warpgroup's 64 weight rows by 16, 32 or 64 tokens;
K is split over blocks where the rows alone leave multiprocessors idle.

``CUDABackend.matmul`` sends products of ``wg_tokens`` tokens there on sm_90, ahead of cuBLAS and gemm_few. It is
off by default: on the H200 it measured slower than the paths it replaces (WGMMA_LAST; docs/benchmarks.md, where an
H100 measured an earlier build faster at 9-16 rows). ``LEAT_CUDA_WGMMA=N`` lets it take 9-N tokens (N up to 64),
``LEAT_CUDA_WGMMA=0`` none.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import gguf
import numpy as np
from leat.errors import LeatError

from leat_backend_cuda import quants
from leat_backend_cuda.driver import DeviceArray, Module

Q = gguf.GGMLQuantizationType
U16 = np.dtype(np.uint16)
#: the target wgmma.cu is compiled for (wgmma exists on sm_90a only, not in sm_90's forward-compatible set)
WGMMA_ARCH = "sm_90a"
#: K values a block stages at a time (WG_KC in wgmma.cu): K must be a multiple
WG_KC = 256
#: token tiles (NT: 8 NT tokens a block column) instantiated; a product takes the smallest that holds its tokens
WG_TILES = (2, 4, 8)
#: the fewest tokens gemm_wg takes when LEAT_CUDA_WGMMA turns it on (fewer go to gemv_q and gemm_few)
WGMMA_FIRST = 9
#: the most tokens it takes by default: none. On the H200 it measured 0.6-1.0% slower than the paths it replaces at
#: 9-16 rows, 11-22% at 32-64 (the engine's batched decode, forty-fifth session, docs/benchmarks.md)
WGMMA_LAST = 0
#: blocks per multiprocessor the split over K aims at (gemm_wg's launch bounds: two blocks of 256 threads)
WG_BLOCKS_PER_SM = 2


def wg_tokens(arch: str) -> tuple[int, int]:
    """The tokens (first, last) gemm_wg takes on ``arch``, (1, 0) for none: none off Hopper; on it WGMMA_LAST, or
    LEAT_CUDA_WGMMA's (0: none, N: WGMMA_FIRST to N)."""
    if arch != "sm_90":
        return (1, 0)
    setting = os.environ.get("LEAT_CUDA_WGMMA", "").strip() or str(WGMMA_LAST)
    if not setting.isdigit() or int(setting) > 8 * WG_TILES[-1]:
        raise LeatError(f"LEAT_CUDA_WGMMA={setting}: 0 (off) or the most tokens gemm_wg takes, up to 64")
    last = int(setting)
    return (WGMMA_FIRST, last) if last >= WGMMA_FIRST else (1, 0)


def wg_tile(tokens: int) -> int:
    """The token tile (NT) of a product of ``tokens``: the smallest that holds them (a block column each)."""
    return next((nt for nt in WG_TILES if 8 * nt >= tokens), WG_TILES[-1])


def wg_name(kernel: str, qtype: Q, nt: int) -> str:
    """``kernel`` (gemm_wg or wg_order_x) instantiated for ``qtype`` and the token tile ``nt``."""
    return f"{kernel}<{quants.LAYOUTS[qtype].struct}, {nt}>"


def wg_names(qtype: Q) -> list[str]:
    return [wg_name(kernel, qtype, nt) for nt in WG_TILES for kernel in ("wg_order_x", "gemm_wg")]


def wg_smem(nt: int) -> int:
    """Dynamic shared memory of gemm_wg<T, nt>: two chunks of x, WG_KC values by 8 nt tokens in f16."""
    return 2 * WG_KC * 8 * nt * 2


def programs() -> list[tuple[str, list[str]]]:
    """wgmma.cu's programs (one per weight type), compiled for WGMMA_ARCH."""
    return [("wgmma.cu", wg_names(q)) for q in quants.LAYOUTS]


class WarpgroupProducts:
    """gemm_wg for CUDABackend (a mixin: the backend's ``_module``, ``_f16_rows``, ``_empty`` and ``_split_sum``)."""

    device: Any
    tensor_cores: bool
    wg_tokens: tuple[int, int]
    wg_blocks: int
    _wg_orders: OrderedDict
    _modules: dict

    def _wg_takes(self, weight: Any, n: int, k: int) -> bool:
        """Whether gemm_wg multiplies ``n`` tokens by ``weight`` (``k`` columns)."""
        return (
            self.wg_tokens[0] <= n <= self.wg_tokens[1]
            and self.tensor_cores
            and weight.kernels is not None
            and k % WG_KC == 0
        )

    def _wg_module(self, qtype: Q) -> Module:
        key = f"wg-{qtype.name}"
        module = self._modules.get(key)  # loaded: no names to make (a step's every product asks)
        if module is not None:
            return module
        smem = {wg_name("gemm_wg", qtype, nt): wg_smem(nt) for nt in WG_TILES}
        return self._module(key, "wgmma.cu", wg_names(qtype), smem, arch=WGMMA_ARCH)

    def _wg_order(self, xh: DeviceArray, kernels: Module, qtype: Q, nt: int, n: int, k: int) -> DeviceArray:
        """``xh`` in gemm_wg<qtype, nt>'s order (wg_order_x), made once for the products that share it."""
        key = (id(xh), qtype, nt)
        hit = self._wg_orders.get(key)
        if hit is not None and hit[0] is xh:  # q, k and v (gate and up) read the same activations
            return hit[1]
        rows = -(-n // (8 * nt)) * 8 * nt
        xo = self._empty((rows, k), U16)
        pairs = rows * k // 2
        grid = max(1, min(-(-pairs // 256), 4 * self.device.sm_count))
        kernels[wg_name("wg_order_x", qtype, nt)]((grid,), 256, xh, xo, n, k)
        self._remember(self._wg_orders, key, (xh, xo), size=4)
        return xo

    def _gemm_wg(self, x, weight: Any, bias, out: DeviceArray, n: int) -> DeviceArray:
        """gemm_wg: 128 rows and 8 NT tokens a block, split over K so that the grid has about two blocks a
        multiprocessor (partial sums added by splitk_sum)."""
        m, k = weight.rows, weight.cols
        xh, xscale = self._f16_rows(x, n, k)
        kernels = self._wg_module(weight.qtype)
        nt = wg_tile(n)
        xo = self._wg_order(xh, kernels, weight.qtype, nt, n, k)
        grid = (-(-m // 128), 1, -(-n // (8 * nt)))
        chunks = k // WG_KC
        splits = max(1, min(chunks, int(self.wg_blocks / (grid[0] * grid[2]) + 0.5)))
        chunk = -(-chunks // splits) * WG_KC
        splits = -(-k // chunk)
        target = out if splits == 1 else self._empty((splits, n, m))
        kernels[wg_name("gemm_wg", weight.qtype, nt)](
            (grid[0], splits, grid[2]),
            256,
            weight.ptr,
            weight.blocks,
            xo,
            xscale,
            target,
            bias,
            m,
            n,
            k,
            chunk,
            smem=wg_smem(nt),
        )
        if splits > 1:
            self._split_sum(target, out, n * m, splits)
        return out
