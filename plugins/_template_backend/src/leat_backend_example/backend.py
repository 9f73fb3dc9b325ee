"""The example backend: every op the llama architecture calls, in plain numpy float32, over a paged KV cache.

A template to copy: keep each method's contract (the docstrings of :class:`leat.backend.Backend`) and replace its
body with your device's code. Activations here are numpy arrays; on a device they are whatever your ops take, and
only ``to_host`` turns one into numpy. Weights are dequantized once at upload with gguf-py, the simplest correct
start; a fast backend keeps them quantized and dequantizes inside its matmul. The ops other families need
(``gelu_mul``, ``softcap``, ``moe``, ``mla_attention``, ...) are left to the base class, whose
error names the missing op and what to run instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gguf
import numpy as np
from leat.backend import Backend, KVLayout, KVPages, RopeSpec
from leat.batch import Batch
from leat.errors import UnsupportedQuantType
from leat.modelfile import Tensor

Q = gguf.GGMLQuantizationType


@dataclass
class ExampleKV(KVPages):
    """The page tables (from :class:`KVPages`, one per layer group) and, per layer, keys
    [pages, page_size, kv_heads, head_dim] and values [pages, page_size, kv_heads, value_dim], ``pages`` being
    the count of the layer's group."""

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)


class ExampleBackend(Backend):
    name = "example"
    # The kit uploads each of these and checks it against gguf.quants.dequantize: list only what upload handles.
    quant_types = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0})
    quant_types |= {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
    kv_storage: ClassVar[dict[str, type]] = {"f32": np.float32, "f16": np.float16}

    @classmethod
    def probe(cls) -> str | None:
        return None  # numpy runs anywhere; a device backend looks for its driver here, quickly

    def __init__(self, precision: str = "f32", **options: Any):
        if precision != "f32":
            raise ValueError(f"the example backend computes in f32 only, not {precision!r}: pass --precision f32")
        super().__init__(precision, **options)

    # -- memory -------------------------------------------------------------------------------------
    def upload(self, tensor: Tensor) -> np.ndarray:
        if tensor.qtype not in self.quant_types:
            raise UnsupportedQuantType(
                f"tensor {tensor.name} is {tensor.qtype.name}, which the example backend cannot use: try --backend cpu"
            )
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.qtype).reshape(tensor.shape)
        values = np.ascontiguousarray(values, dtype=np.float32)
        self.allocations.weights += values.nbytes
        kind = tensor.qtype.name
        self.allocations.by_type[kind] = self.allocations.by_type.get(kind, 0) + values.nbytes
        return values

    def allocate_kv(
        self,
        layouts: list[KVLayout],
        slots: int,
        context: int,
        pages: int | Sequence[int] | None = None,
        page_size: int = 16,
        dtype: str = "f32",
        groups: Sequence[int] | None = None,
    ) -> ExampleKV:
        if dtype not in self.kv_storage:
            raise ValueError(f"the example backend stores KV as f32 or f16, not {dtype!r}: pass --kv f32 or --kv f16")
        kv = ExampleKV.create(layouts, slots, context, pages, page_size, groups)
        for layer, layout in enumerate(layouts):
            shape = (kv.layer_pages(layer), page_size, layout.kv_heads)
            kv.k.append(np.zeros((*shape, layout.head_dim), self.kv_storage[dtype]))
            kv.v.append(np.zeros((*shape, layout.stored_value_dim), self.kv_storage[dtype]))
        self.allocations.kv += sum(a.nbytes for a in kv.k + kv.v)
        return kv

    # set_pages is the base class's: it edits the host page tables, which attention reads on every call. A device
    # backend that keeps a copy of the tables on the device updates that copy there too.

    def _storages(self, kv: ExampleKV, group: int) -> list[np.ndarray]:
        layers = kv.layers_of(group)
        return [kv.k[layer] for layer in layers] + [kv.v[layer] for layer in layers]

    def copy_page(self, kv: ExampleKV, source: int, target: int, group: int = 0) -> None:
        for storage in self._storages(kv, group):
            storage[target] = storage[source]

    def read_pages(self, kv: ExampleKV, pages: list[int], group: int = 0) -> list[np.ndarray]:
        return [storage[pages] for storage in self._storages(kv, group)]  # indexing with a list copies

    def write_pages(self, kv: ExampleKV, pages: list[int], contents: list[np.ndarray], group: int = 0) -> None:
        for storage, values in zip(self._storages(kv, group), contents, strict=True):
            storage[pages] = values

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, weight: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return weight[tokens]

    def matmul(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        y = x @ weight.T
        return y if bias is None else y + bias

    def rms_norm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y if weight is None else y * weight

    def rope(self, x: np.ndarray, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
        half = spec.dims // 2
        inv_freq = spec.base ** (-2 * np.arange(half) / spec.dims)
        if spec.freq_factors is not None:
            inv_freq = inv_freq / spec.freq_factors[:half]
        # angles in float64: position * frequency loses digits in float32 at long contexts
        angles = positions[:, None] * spec.scale * inv_freq[None, :]
        cos = (np.cos(angles) * spec.attn_factor).astype(np.float32)[:, None, :]
        sin = (np.sin(angles) * spec.attn_factor).astype(np.float32)[:, None, :]
        # the rotated pairs: (i, i + dims/2) for neox, (2i, 2i + 1) otherwise; entries past spec.dims pass through
        if spec.neox:
            first, second = slice(0, half), slice(half, spec.dims)
        else:
            first, second = slice(0, spec.dims, 2), slice(1, spec.dims, 2)
        a, b = x[..., first], x[..., second]
        out = x.copy()
        out[..., first] = a * cos - b * sin
        out[..., second] = a * sin + b * cos
        return out

    def attention(
        self, q, k, v, kv: ExampleKV, layer: int, batch: Batch, scale: float, softcap=None, sinks=None
    ) -> np.ndarray:
        """Each row writes its k, v at its positions in its slot's pages, then its queries attend to every cached
        position of the slot up to their own (and within the layer's sliding window, if it has one). Scores are
        soft-capped when ``softcap`` is given; each head's ``sinks`` logit joins its softmax's denominator."""
        window = kv.layouts[layer].window
        n, heads, _ = q.shape
        group = heads // k.shape[1]  # query heads per KV head (grouped-query attention)
        out = np.empty((n, heads, v.shape[2]), np.float32)
        for row, offset in zip(batch.rows, batch.offsets):
            span = slice(offset, offset + len(row.tokens))
            table = kv.table(layer)[row.slot]
            positions = np.arange(row.start, row.start + len(row.tokens))
            kv.k[layer][table[positions // kv.page_size], positions % kv.page_size] = k[span]
            kv.v[layer][table[positions // kv.page_size], positions % kv.page_size] = v[span]
            # a windowed layer's pages behind the first query's window may be gone (-1): never read there
            first = max(0, row.start - window + 1) if window is not None else 0
            cached = np.arange(first, positions[-1] + 1)
            where = table[cached // kv.page_size], cached % kv.page_size
            keys = np.repeat(kv.k[layer][where].astype(np.float32), group, axis=1)  # [cached, heads, dim]
            values = np.repeat(kv.v[layer][where].astype(np.float32), group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q[span], keys) * np.float32(scale)
            if softcap is not None:
                scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
            visible = cached[None, :] <= positions[:, None]
            if window is not None:
                visible &= cached[None, :] > positions[:, None] - window
            scores = np.where(visible, scores, -np.inf)
            # a sink is one more logit per head in the softmax, whose value is zero
            sink = np.full((heads, 1, 1), -np.inf, np.float32) if sinks is None else sinks.reshape(heads, 1, 1)
            peak = np.maximum(scores.max(axis=-1, keepdims=True), sink)
            weights = np.exp(scores - peak)
            weights /= weights.sum(axis=-1, keepdims=True) + np.exp(sink - peak)
            out[span] = np.einsum("hqk,khd->qhd", weights, values)
        return out.reshape(n, -1)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # exp overflows for very negative gates, and silu's limit there is 0
            return gate / (1 + np.exp(-gate)) * up

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def reshape(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return x.reshape(shape)

    def take_rows(self, x: np.ndarray, index: np.ndarray) -> np.ndarray:
        return x[index]

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        return x * np.float32(factor)
