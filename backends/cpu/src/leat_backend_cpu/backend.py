"""The numpy CPU backend: float32 compute, and the float64 oracle every other backend is checked against.

Weights are dequantized once at upload with ``gguf.quants.dequantize`` (numpy has no quantized
matmul, so a dequantized copy is the fast path here) and kept in the compute dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np

from leat.backend import Allocations, Backend, KVLayout, KVPages, RopeSpec
from leat.batch import Batch
from leat.errors import UnsupportedQuantType
from leat.modelfile import Tensor

Q = gguf.GGMLQuantizationType
# The types gguf-py can dequantize (it raises NotImplementedError for the others).
DEQUANTIZABLE = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    | {Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M}
    | {Q.IQ4_NL, Q.IQ4_XS}
    | ({Q.NVFP4} if hasattr(Q, "NVFP4") else set())
)


@dataclass
class KVCache(KVPages):
    k: list[np.ndarray] = field(default_factory=list)  # per layer: [pages, page_size, kv_heads, head_dim]
    v: list[np.ndarray] = field(default_factory=list)


class CPUBackend(Backend):
    name = "cpu"
    quant_types = DEQUANTIZABLE

    def __init__(self, precision: str = "f32", **options: Any):
        if precision not in ("f32", "f64"):
            raise ValueError(f"cpu backend precision must be f32 or f64, not {precision!r}")
        super().__init__(precision, **options)
        self.dtype = np.float64 if precision == "f64" else np.float32
        self.allocations = Allocations()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "precision": self.precision, "threads": os.cpu_count()}

    # -- memory -------------------------------------------------------------------------------------
    def upload(self, tensor: Tensor) -> np.ndarray:
        if tensor.qtype not in self.quant_types:
            raise UnsupportedQuantType(
                f"tensor {tensor.name} is {tensor.qtype.name}, which the cpu backend cannot dequantize"
            )
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.qtype).reshape(tensor.shape)
        values = np.ascontiguousarray(values, dtype=self.dtype)
        self.allocations.weights += values.nbytes
        kind = tensor.qtype.name
        self.allocations.by_type[kind] = self.allocations.by_type.get(kind, 0) + values.nbytes
        return values

    def allocate_kv(self, layouts, slots, context, pages=None, page_size=16) -> KVCache:
        pages, table = KVPages.plan(slots, context, pages, page_size)
        kv = KVCache(layouts, slots, pages, page_size, table)
        for layout in layouts:
            kv.k.append(np.zeros((pages, page_size, layout.kv_heads, layout.head_dim), self.dtype))
            kv.v.append(np.zeros((pages, page_size, layout.kv_heads, layout.value_dim or layout.head_dim), self.dtype))
        self.allocations.kv += sum(a.nbytes for a in kv.k + kv.v)
        return kv

    def copy_page(self, kv: KVCache, source: int, target: int) -> None:
        for storage in kv.k + kv.v:
            storage[target] = storage[source]

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, weight: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return weight[tokens]

    def matmul(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        y = x @ weight.T
        return y + bias if bias is not None else y

    def rms_norm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y * weight if weight is not None else y

    def rope(self, x: np.ndarray, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
        half = spec.dims // 2
        inv_freq = spec.base ** (-np.arange(half, dtype=np.float64) * 2 / spec.dims)
        if spec.freq_factors is not None:
            inv_freq = inv_freq / spec.freq_factors[:half]
        angles = (positions.astype(np.float64) * spec.scale)[:, None] * inv_freq[None, :]
        cos = np.cos(angles).astype(self.dtype)[:, None, :]
        sin = np.sin(angles).astype(self.dtype)[:, None, :]
        out = x.copy()
        if spec.neox:
            a, b = x[..., :half], x[..., half : spec.dims]
            out[..., :half] = a * cos - b * sin
            out[..., half : spec.dims] = a * sin + b * cos
        else:
            a, b = x[..., 0 : spec.dims : 2], x[..., 1 : spec.dims : 2]
            out[..., 0 : spec.dims : 2] = a * cos - b * sin
            out[..., 1 : spec.dims : 2] = a * sin + b * cos
        return out

    def attention(self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float) -> np.ndarray:
        keys_all, values_all = kv.k[layer], kv.v[layer]
        window = kv.layouts[layer].window
        n, heads, dim = q.shape
        kv_heads, value_dim = v.shape[1], v.shape[2]
        group = heads // kv_heads
        out = np.empty((n, heads * value_dim), self.dtype)
        size = kv.page_size
        for row, offset in zip(batch.rows, batch.offsets):
            length, start = len(row.tokens), row.start
            span = slice(offset, offset + length)
            table = kv.page_table[row.slot]
            positions = np.arange(start, start + length)
            keys_all[table[positions // size], positions % size] = k[span]
            values_all[table[positions // size], positions % size] = v[span]
            used = table[: -(-(start + length) // size)]
            keys = keys_all[used].reshape(-1, kv_heads, dim)[: start + length]
            values = values_all[used].reshape(-1, kv_heads, value_dim)[: start + length]
            qs = q[span].reshape(length, kv_heads, group, dim)
            scores = np.einsum("lkgd,tkd->kglt", qs, keys) * scale
            query_pos = start + np.arange(length)[:, None]
            key_pos = np.arange(start + length)[None, :]
            masked = key_pos > query_pos
            if window is not None:
                masked |= key_pos <= query_pos - window
            scores[..., masked] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            out[span] = np.einsum("kglt,tkd->lkgd", weights, values).reshape(length, heads * value_dim)
        return out

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # exp overflow for very negative gates gives the right limit, 0
            return gate / (1.0 + np.exp(-gate)) * up

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def reshape(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return x.reshape(shape)

    def take_rows(self, x: np.ndarray, index: np.ndarray) -> np.ndarray:
        return x[index]
