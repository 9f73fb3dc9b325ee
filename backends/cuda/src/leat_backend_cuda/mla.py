"""Multi-head latent attention on the CUDA backend (``kernels/mla.cu``): DeepSeek 2/3's absorbed MLA.

The layer's K pages hold one key ``[latent, k_rope]`` per token (``KVLayout(1, rank + rope, rank,
latent=True)``; no V storage), and attention runs as MQA whose values are each key's first ``rank``
entries, split over the sequence and merged by ops.cu's ``attention_combine`` like the GQA kernels.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
from leat.batch import Batch
from leat.errors import LeatError

from leat_backend_cuda import cublas, quants
from leat_backend_cuda.driver import DeviceArray, Module
from leat_backend_cuda.moe import _ready

MLA_HEADS = 4  # query heads per block (the GB template argument)
MLA_SPLIT_KEYS = 64  # a decode split's positions are a multiple of this; the kernel cuts each token's range by it
MLA_LANES = (1, 2, 4, 8, 12, 18)  # dims per lane instantiated (DL): up to 576 = DeepSeek's 512 + 64
KV_TYPES = {"f32": "float", "f16": "u16", "q8_0": "i8"}  # q8_0: quants and scale planes as backend.KV_DTYPES
MLA_TC_KINDS = ("u16", "i8")  # the caches mla_attention_tc reads: f16, q8_0
MLA_KERNELS = (
    [f"mla_kv_write<{kv}>" for kv in KV_TYPES.values()]
    + [f"mla_attention<{kv}, {dl}, {MLA_HEADS}>" for kv in KV_TYPES.values() for dl in MLA_LANES]
    + [f"mla_attention_tc<{kv}, 512, 64>" for kv in MLA_TC_KINDS]
    + [f"mla_keys_f16<{kv}>" for kv in KV_TYPES.values()]
    + ["mla_q_f16", "mla_softmax_f16"]
)
#: decode on tensor cores (mla_attention_tc, DeepSeek's 512 + 64 over an f16 or q8_0 cache; 16 heads a block; steps of
#: at most GEMV_MAX_TOKENS tokens, LEAT_CUDA_MLA_TC=0: never): a split's keys a multiple of this. H100, the
#: DeepSeek-V2-Lite-shaped file's tg128, two rounds (fifty-first session): 32 keys 363.6 and 362.5 tok/s, at depth 4096
#: 318.1 and 318.0; 64 keys 346.6 and 352.6, 324.8 and 312.1; mla_attention 331.4 and 341.2, 286.1 and 295.1
MLA_TC_KEYS = 32
#: rows of at least this many tokens take the cuBLAS prefill (where cuBLAS is; LEAT_CUDA_MLA_GEMM=0: never)
MLA_GEMM_MIN_TOKENS = 16
#: scores (query rows x keys) one cuBLAS product of the prefill writes at most: more queries go in pieces
MLA_GEMM_SCORES = 1 << 25


def programs() -> list[tuple[str, list[str]]]:
    return [("mla.cu", MLA_KERNELS)]


def layer_table(kv: Any, layer: int) -> tuple[Any, int]:
    """The device page table ``layer`` reads and writes through (its page group's), and its pages per slot."""
    group = kv.group_of[layer]
    return kv.device_tables[group], kv.tables[group].shape[1]


class LatentAttentionOps:
    """``mla_attention`` for :class:`~leat_backend_cuda.backend.CUDABackend` (a mixin)."""

    def _mla_module(self) -> Module:
        return self._module("mla", "mla.cu", MLA_KERNELS, {})

    def mla_attention(
        self, q_latent: Any, q_rope: Any, latent: Any, k_rope: Any, kv: Any, layer: int, batch: Batch, scale: float
    ) -> DeviceArray:
        q_latent, q_rope, latent, k_rope = (_ready(a) for a in (q_latent, q_rope, latent, k_rope))
        n, heads, rank = q_latent.shape
        rope = q_rope.shape[-1]
        layout = kv.layouts[layer]
        if not layout.latent or layout.head_dim != rank + rope or layout.kv_heads != 1:
            raise LeatError(f"layer {layer}'s KV layout {layout} is not the latent layout of rank {rank} + rope {rope}")
        dl = next((d for d in MLA_LANES if 32 * d >= rank + rope), None)
        if dl is None:
            raise LeatError(f"latent keys of {rank + rope} dimensions exceed the MLA kernel's {32 * MLA_LANES[-1]}")
        ops = self._mla_module()
        kind = KV_TYPES.get(kv.dtype)
        if kind is None:
            raise LeatError(f"the cuda backend stores a latent KV cache as f32, f16 or q8_0, not {kv.dtype!r}")
        scales = kv.k_scale[layer] if kv.dtype == "q8_0" else None
        slots, positions, span = self._token_rows(batch)
        self._sync_pages(kv)
        table, per_slot = layer_table(kv, layer)
        ops[f"mla_kv_write<{kind}>"](
            (n,), 128, latent, k_rope, kv.k[layer], scales, table, slots, positions, rank, rope, per_slot, kv.page_size
        )
        gemm = os.environ.get("LEAT_CUDA_MLA_GEMM", "1") != "0" and self.cublas is not None and not self._capturing
        long = [gemm and len(r.tokens) >= MLA_GEMM_MIN_TOKENS and not r.bidirectional for r in batch.rows]
        if all(long):
            return self._mla_gemm(q_latent, q_rope, kv, layer, batch, long, scale, kind, scales, positions)
        if any(long):  # the kernel below skips the long rows' tokens (slot -1), cuBLAS writes them after it
            lengths = [len(r.tokens) for r in batch.rows]
            slots = self._ints(np.repeat([-1 if g else r.slot for r, g in zip(batch.rows, long)], lengths))
        # steps of at most GEMV_MAX_TOKENS tokens, as attention_tc's (a graph makes every token of a prefill chunk a
        # row of its own): one-token decode is what was timed; prompt chunks and batched decode on it are not
        tc = kind in MLA_TC_KINDS and (rank, rope) == (512, 64) and n <= quants.GEMV_MAX_TOKENS
        tc = tc and os.environ.get("LEAT_CUDA_MLA_TC") != "0"
        name, per_block, keys = (f"mla_attention<{kind}, {dl}, {MLA_HEADS}>", MLA_HEADS, MLA_SPLIT_KEYS)
        if tc:
            name, per_block, keys = f"mla_attention_tc<{kind}, 512, 64>", 16, MLA_TC_KEYS
        chunks = -(-heads // per_block)
        splits, _ = self._decode_splits(n * chunks, span, keys)
        out = self._empty((n, heads, rank))
        parts = self._split_parts(n * heads, splits, rank)
        ops[name](
            (n, chunks, splits),
            128,
            q_latent,
            q_rope,
            kv.k[layer],
            scales,
            table,
            slots,
            positions,
            out if splits == 1 else None,
            *parts,
            *((heads,) if tc else (heads, rank, rope)),
            per_slot,
            kv.page_size,
            layout.window or 0,
            keys,
            float(scale),
        )
        if splits > 1:
            self._merge_splits(*parts, out, n * heads, splits, rank, None, heads)
        if any(long):
            self._mla_gemm(q_latent, q_rope, kv, layer, batch, long, scale, kind, scales, positions, out)
        return out

    def _mla_gemm(
        self,
        q_latent: Any,
        q_rope: Any,
        kv: Any,
        layer: int,
        batch: Batch,
        rows: list[bool],
        scale: float,
        kind: str,
        scales: Any,
        pos: Any,
        out: DeviceArray | None = None,
    ) -> DeviceArray:
        """Latent attention of the batch's ``rows`` (flags) on tensor cores through cuBLAS, into ``out`` (the other
        rows' outputs there are kept; None: a new array): per row (sequence), its keys (the cache's
        positions up to its last token) as f16 rows, scores = queries x keys (f16, float32 sums), their causal
        (windowed) softmax in f16, out = probabilities x values (the keys' first ``rank`` entries). The queries
        are f16 rows scaled per row (mla_q_f16); a row's queries go in pieces of at most MLA_GEMM_SCORES scores."""
        n, heads, rank = q_latent.shape
        dk = rank + q_rope.shape[-1]
        ops = self._mla_module()
        table, per_slot = layer_table(kv, layer)
        window = kv.layouts[layer].window or 0
        qh, qscale = self._empty((n * heads, dk), np.dtype(np.uint16)), self._empty((n * heads,))
        ops["mla_q_f16"]((n * heads,), 128, q_latent, q_rope, qh, qscale, rank, q_rope.shape[-1])
        out = self._empty((n, heads, rank)) if out is None else out
        first = 0
        for row, chosen in zip(batch.rows, rows):
            count, span = len(row.tokens), row.start + len(row.tokens)
            if not chosen:
                first += count
                continue
            keys = self._empty((span, dk), np.dtype(np.uint16))
            ops[f"mla_keys_f16<{kind}>"](
                (span,), 128, kv.k[layer], scales, table, row.slot, dk, per_slot, kv.page_size, keys
            )
            step = max(1, min(count, MLA_GEMM_SCORES // (heads * span)))
            for a in range(first, first + count, step):
                rows = min(step, first + count - a) * heads
                scores, probs = self._empty((rows, span)), self._empty((rows, span), np.dtype(np.uint16))
                self.cublas.gemm_f16(keys.ptr, qh.ptr + 2 * a * heads * dk, scores.ptr, span, rows, dk, span)
                part = (qscale.view((rows,), a * heads), pos.view((rows // heads,), a))
                ops["mla_softmax_f16"]((rows,), 256, scores, probs, *part, heads, span, window, float(scale))
                self._gemm_f16_nn(keys.ptr, dk, probs.ptr, span, out.ptr + 4 * a * heads * rank, rank, rows, span)
            first += count
        return out

    def _gemm_f16_nn(self, a: int, lda: int, b: int, ldb: int, c: int, m: int, n: int, k: int) -> None:
        """``c[j, i] = sum_l a[l, i] * b[j, l]`` for i < m, j < n: ``a`` f16 rows ``lda`` apart ([k, >= m]), ``b``
        f16 rows ``ldb`` apart ([n, k]), ``c`` float32 rows m long: cuBLAS's column-major ``c = a b`` of both
        untransposed (the probabilities times the values)."""
        cb = self.cublas
        one, zero = ctypes.byref(cb._one), ctypes.byref(cb._zero)
        status = cb.lib.cublasGemmEx(
            cb.handle, cublas._OP_N, cublas._OP_N, m, n, k, one, a, cublas._R_16F, lda, b, cublas._R_16F, ldb,
            zero, c, cublas._R_32F, m, cublas._COMPUTE_32F, cublas._GEMM_DEFAULT,
        )  # fmt: skip
        cublas._check(status, "cublasGemmEx")
