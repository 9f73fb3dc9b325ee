"""The numpy CPU backend: float32 compute, and the float64 oracle every other backend is checked against.

At float32 (the default ``weights="quantized"``), 2-D and 3-D weights (a MoE layer's stacked experts) of the types
:data:`leat_backend_cpu.native.KERNEL_TYPES` names stay as the file's blocks (no copy), and products (the experts'
too), attention over float32 or f16 KV, and the small ops run in
the C kernels of :mod:`leat_backend_cpu.native` over ``threads`` threads (default: the cores this process may use,
or ``$LEAT_THREADS``). The reference paths, ``precision="f64"`` (the float64 oracle) and ``weights="dequantized"``
(float32), and every weight of another type, dequantize once at upload with ``gguf.quants.dequantize`` and keep
the compute dtype; their ops are numpy.

With the option ``activations="ggml"`` each product with a quantized weight first rounds the activations as
llama.cpp's CPU backend does (to 8 bits per block, or to f16/bf16; see :mod:`leat_backend_cpu.ggml_activations`);
``matmul`` only, the products inside ``moe`` and ``head_matmul`` stay unrounded. It reproduces ggml's products to
float summation order, not llama.cpp's logits (see the notes in core/tests/test_perplexity.py).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from leat.backend import Allocations, Backend, KVPages, RopeSpec
from leat.batch import Batch
from leat.deltanet import DeltaNet, run
from leat.errors import LeatError, UnsupportedQuantType
from leat.modelfile import Tensor
from leat.moe import MoESpec, MoEWeights, activate, route

from leat_backend_cpu import ggml_activations, native
from leat_backend_cpu.native import QuantizedStack, QuantizedWeight

Q = gguf.GGMLQuantizationType
SINGLE_THREAD_ROWS = 8


@functools.cache
def _blas() -> Any:
    """numpy's BLAS thread pools (threadpoolctl, imported on the reference paths' first product only)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


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
    dtype: str = "f32"
    k_scale: list[np.ndarray] = field(default_factory=list)  # q8_0: one f16 scale per 32 values
    v_scale: list[np.ndarray] = field(default_factory=list)
    # per recurrent layer: each slot's convolution inputs, delta-net state and positions taken in (Backend.gated_delta_net)
    recurrent: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    # per (recurrent layer, slot): its last verified draft's row (start, the state before it, its inputs), to rewind to
    drafts: dict[tuple[int, int], tuple[int, np.ndarray, np.ndarray, tuple[np.ndarray, ...]]] = field(
        default_factory=dict
    )


def _q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize the last axis in blocks of 32 as GGUF's Q8_0: d = max|x| / 127, q = round(x / d)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, blocks / d, 0)
    # ggml rounds half away from zero (roundf), numpy's round is half to even
    q = (np.sign(q) * np.floor(np.abs(q) + 0.5)).astype(np.int8)
    return q.reshape(x.shape), d[..., 0].astype(np.float16)


def _from_q8_0(q: np.ndarray, d: np.ndarray, dtype) -> np.ndarray:
    blocks = q.reshape(*q.shape[:-1], -1, 32).astype(dtype) * d[..., None].astype(dtype)
    return blocks.reshape(q.shape)


class CPUBackend(Backend):
    name = "cpu"
    quant_types = DEQUANTIZABLE
    bidirectional = True
    recurrent_state = True
    rewinds_drafts = True

    def __init__(self, precision: str = "f32", **options: Any):
        if precision not in ("f32", "f64"):
            raise ValueError(f"cpu backend precision must be f32 or f64, not {precision!r}")
        super().__init__(precision, **options)
        self.dtype = np.float64 if precision == "f64" else np.float32
        self.allocations = Allocations()
        self.activations = options.get("activations", "f32")
        if self.activations not in ("f32", "ggml") or (self.activations == "ggml" and precision != "f32"):
            raise ValueError(f"cpu backend activations must be f32, or ggml at precision f32, not {self.activations!r}")
        # activations="ggml": id(uploaded weight) -> (the weight, its activation rounding, Q4_1/Q5_1 block minimums)
        self._ggml_products: dict[int, tuple[np.ndarray, Any, np.ndarray | None]] = {}
        self._rotation_kept: tuple[RopeSpec, bytes, np.ndarray, np.ndarray] | None = None  # see _rotation
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.threads = int(options.get("threads") or os.environ.get("LEAT_THREADS") or cores)
        if self.threads < 1:
            raise ValueError(f"cpu backend threads must be at least 1, not {self.threads}")
        default = "quantized" if precision == "f32" and self.activations == "f32" else "dequantized"
        self.weights = options.get("weights", default)
        if self.weights not in ("quantized", "dequantized") or (self.weights == "quantized" and default != "quantized"):
            raise ValueError(
                f"cpu backend weights must be dequantized, or quantized at precision f32 with f32 activations, "
                f"not {self.weights!r}"
            )
        if self.weights == "quantized" and native.unavailable():
            self.weights = "dequantized"  # no C compiler here: today's path, which describe() reports
        self.native = self.weights == "quantized"  # the C kernels run the ops, not numpy
        if self.native:
            native.keep_freed_memory(False)  # until allocate_kv

    def describe(self) -> dict[str, Any]:
        described = {"backend": self.name, "precision": self.precision, "threads": self.threads}
        if self.precision == "f32":
            described["weights"] = self.weights
        return described | ({"activations": "ggml"} if self.activations == "ggml" else {})

    # -- memory -------------------------------------------------------------------------------------
    @classmethod
    def weight_bytes(cls, tensors) -> int:
        """As :meth:`upload` keeps them at the defaults (precision f32, weights quantized): 2-D and 3-D weights of the
        kernels' types as the file's blocks (mapped, not copied), every other tensor as float32."""
        kept = native.KERNEL_TYPES if native.unavailable() is None else frozenset()
        return sum(t.nbytes if t.qtype in kept and len(t.shape) in (2, 3) else 4 * math.prod(t.shape) for t in tensors)

    def upload(self, tensor: Tensor) -> np.ndarray | QuantizedWeight | QuantizedStack:
        if tensor.qtype not in self.quant_types:
            raise UnsupportedQuantType(
                f"tensor {tensor.name} is {tensor.qtype.name}, which the cpu backend cannot dequantize"
            )
        if self.native and tensor.qtype in native.KERNEL_TYPES and len(tensor.shape) in (2, 3):
            kept = QuantizedWeight if len(tensor.shape) == 2 else QuantizedStack
            weight = kept(tensor.qtype, tensor.shape, tensor.data)
            self._count(tensor.qtype, weight.nbytes)
            return weight
        values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.qtype).reshape(tensor.shape)
        values = np.ascontiguousarray(values, dtype=self.dtype)
        rounding = ggml_activations.rounding_for(tensor.qtype)
        if self.activations == "ggml" and rounding is not None and len(tensor.shape) == 2:
            minimums = None
            if rounding is ggml_activations.q8_1:
                minimums = ggml_activations.block_minimums(tensor.data, tensor.qtype, tensor.shape)
            self._ggml_products[id(values)] = (values, rounding, minimums)
        self._count(tensor.qtype, values.nbytes)
        return values

    def _count(self, qtype: gguf.GGMLQuantizationType, nbytes: int) -> None:
        self.allocations.weights += nbytes
        self.allocations.by_type[qtype.name] = self.allocations.by_type.get(qtype.name, 0) + nbytes

    def allocate_kv(self, layouts, slots, context, pages=None, page_size=16, dtype="f32", groups=None) -> KVCache:
        if dtype not in ("f32", "f16", "q8_0"):
            raise ValueError(f"KV dtype must be f32, f16 or q8_0, not {dtype!r}")
        kv = KVCache.create(layouts, slots, context, pages, page_size, groups, dtype=dtype)
        if self.native:
            native.keep_freed_memory(True)  # the model is loaded: keep the steps' freed activations
        storage = {"f32": self.dtype, "f16": np.float16, "q8_0": np.int8}[dtype]
        for layer, layout in enumerate(layouts):
            count = kv.layer_pages(layer)
            shapes = [(count, page_size, layout.kv_heads, dim) for dim in (layout.head_dim, layout.stored_value_dim)]
            if dtype == "q8_0" and any(shape[-1] % 32 for shape in shapes):
                raise ValueError(f"q8_0 KV needs head dimensions that are multiples of 32, not {shapes[0][-1]}")
            kv.k.append(np.zeros(shapes[0], storage))
            kv.v.append(np.zeros(shapes[1], storage))
            if dtype == "q8_0":
                kv.k_scale.append(np.zeros((*shapes[0][:-1], shapes[0][-1] // 32), np.float16))
                kv.v_scale.append(np.zeros((*shapes[1][:-1], shapes[1][-1] // 32), np.float16))
        self.allocations.kv += sum(a.nbytes for a in kv.k + kv.v + kv.k_scale + kv.v_scale)
        return kv

    def _storages(self, kv: KVCache, group: int) -> list[np.ndarray]:
        layers = kv.layers_of(group)
        return [kind[layer] for kind in (kv.k, kv.v, kv.k_scale, kv.v_scale) if kind for layer in layers]

    def read_pages(self, kv: KVCache, pages: list[int], group: int = 0) -> list[np.ndarray]:
        return [storage[pages] for storage in self._storages(kv, group)]

    def write_pages(self, kv: KVCache, pages: list[int], contents: list[np.ndarray], group: int = 0) -> None:
        for storage, values in zip(self._storages(kv, group), contents, strict=True):
            storage[pages] = values

    def kv_budget_bytes(self) -> int:
        try:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            return info["MemAvailable"] // 4
        except (OSError, KeyError, ValueError):
            return 2 << 30

    def copy_page(self, kv: KVCache, source: int, target: int, group: int = 0) -> None:
        for storage in self._storages(kv, group):
            storage[target] = storage[source]

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    # -- ops -----------------------------------------------------------------------------------------
    def from_host(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=self.dtype)

    def embed(self, weight: np.ndarray | QuantizedWeight, tokens: np.ndarray) -> np.ndarray:
        if isinstance(weight, QuantizedWeight):
            return native.rows(weight, tokens, self.threads)
        return weight[tokens]

    def matmul(self, x: np.ndarray, weight: np.ndarray | QuantizedWeight, bias: np.ndarray | None = None) -> np.ndarray:
        if isinstance(weight, QuantizedWeight):
            y = native.matmul(x, weight, self.threads)
            return y + bias if bias is not None else y
        ggml = self._ggml_products.get(id(weight))
        if ggml is not None and ggml[0] is weight:
            # as ggml's CPU matmul: x rounded to the weight's vec_dot_type, then the product in float
            _, rounding, minimums = ggml
            if minimums is None:
                x = rounding(x)
            else:  # Q4_1/Q5_1: the dot takes each block's minimum times Q8_1's fp16-stored sum
                x, sum_error = rounding(x)
                bias = sum_error @ minimums.T + (bias if bias is not None else 0)
        if x.shape[0] <= SINGLE_THREAD_ROWS:
            # A few rows are a memory-bound matrix-vector product: a second BLAS thread adds little, and
            # when the cores are busy its spin-waits slowed decode 3x here (measured on 2 cores).
            with _blas().limit(limits=1, user_api="blas"):
                y = x @ weight.T
        else:
            y = x @ weight.T
        return y + bias if bias is not None else y

    def rms_norm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        if self.native:
            return native.rms_norm(x, weight, eps)
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        return y * weight if weight is not None else y

    def layer_norm(self, x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, eps: float) -> np.ndarray:
        centred = x - x.mean(axis=-1, keepdims=True)
        y = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps)
        y = y * weight if weight is not None else y
        return y + bias if bias is not None else y

    def _rotation(self, positions: np.ndarray, spec: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [n, 1, dims / 2] of each position's angles; the last ones are kept, since every layer's q and
        k of a step rotate by the same positions."""
        kept, key = self._rotation_kept, positions.tobytes()
        if kept is not None and kept[0] is spec and kept[1] == key:
            return kept[2], kept[3]
        half = spec.dims // 2
        inv_freq = spec.base ** (-np.arange(half, dtype=np.float64) * 2 / spec.dims)
        if spec.freq_factors is not None:
            inv_freq = inv_freq / spec.freq_factors[:half]
        angles = (positions.astype(np.float64) * spec.scale)[:, None] * inv_freq[None, :]
        cos = np.ascontiguousarray((np.cos(angles) * spec.attn_factor).astype(self.dtype)[:, None, :])
        sin = np.ascontiguousarray((np.sin(angles) * spec.attn_factor).astype(self.dtype)[:, None, :])
        self._rotation_kept = (spec, key, cos, sin)
        return cos, sin

    def rope(self, x: np.ndarray, positions: np.ndarray, spec: RopeSpec) -> np.ndarray:
        half = spec.dims // 2
        cos, sin = self._rotation(positions, spec)
        if self.native:
            return native.rope(x, cos, sin, spec.dims, spec.neox)
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

    def attention(
        self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float, softcap: float | None = None, sinks=None
    ) -> np.ndarray:
        return self._attend(q, k, v, kv, layer, batch, scale, softcap, sinks)

    def gated_delta_net(
        self,
        mixed: np.ndarray,
        alpha: np.ndarray,
        beta: np.ndarray,
        net: DeltaNet,
        kv: KVCache,
        layer: int,
        batch: Batch,
    ) -> np.ndarray:
        if layer not in kv.recurrent:
            tail, state = net.state_shapes
            kv.recurrent[layer] = (
                np.zeros((kv.slots, *tail), self.dtype),
                np.zeros((kv.slots, *state), self.dtype),
                np.zeros(kv.slots, np.int64),
            )
            self.allocations.kv += sum(a.nbytes for a in kv.recurrent[layer])
        tails, states, taken = kv.recurrent[layer]
        out = np.empty((len(batch), net.v_heads, net.head_dim), self.dtype)
        for row, start, stop in zip(batch.rows, batch.offsets, batch.offsets[1:]):
            slot, inputs = row.slot, (mixed[start:stop], alpha[start:stop], beta[start:stop])
            if row.start == 0:
                tails[slot], states[slot] = 0, 0
            elif row.start != taken[slot]:
                self._rewind(kv, net, layer, slot, row.start)
            kv.drafts.pop((layer, slot), None)
            if row.all_logits and len(row.tokens) > 1:
                copies = tuple(x.copy() for x in inputs)
                kv.drafts[layer, slot] = (row.start, tails[slot].copy(), states[slot].copy(), copies)
            out[start:stop] = run(net, *inputs, tails[slot], states[slot])
            taken[slot] = row.start + len(row.tokens)
        return out

    def _rewind(self, kv: KVCache, net: DeltaNet, layer: int, slot: int, position: int) -> None:
        """The slot's state after ``position``, inside its last verified draft: the state before that row, then the
        row's inputs up to there (the same arithmetic as the row's own pass)."""
        tails, states, taken = kv.recurrent[layer]
        begin, tail, state, inputs = kv.drafts.get((layer, slot), (taken[slot], None, None, ()))
        if not begin < position < taken[slot]:
            raise LeatError(
                f"slot {slot} of recurrent layer {layer} holds the state after {taken[slot]} positions, "
                f"and a recurrent state cannot continue at position {position}"
            )
        tails[slot], states[slot] = tail, state
        run(net, *(x[: position - begin] for x in inputs), tails[slot], states[slot])

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.native:
            return native.gated(gate, up, gelu=False)
        with np.errstate(over="ignore"):  # exp overflow for very negative gates gives the right limit, 0
            return gate / (1.0 + np.exp(-gate)) * up

    def sigmoid_mul(self, gate: np.ndarray, x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # as silu_mul: exp overflow gives the right limit, 0
            return x / (1.0 + np.exp(-gate))

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def reshape(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return x.reshape(shape)

    def take_rows(self, x: np.ndarray, index: np.ndarray) -> np.ndarray:
        return x[index]

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        return x * self.dtype(factor)

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
        if self.native and up is not None:
            return native.gated(gate, up, gelu=True)
        inner = self.dtype(math.sqrt(2 / math.pi)) * (gate + self.dtype(0.044715) * gate * gate * gate)
        gelu = self.dtype(0.5) * gate * (1 + np.tanh(inner))
        return gelu * up if up is not None else gelu

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return self.dtype(cap) * np.tanh(x / self.dtype(cap))

    def _attend(
        self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float, softcap: float | None = None, sinks=None
    ):
        """Paged, causal, windowed GQA attention; scores soft-capped when ``softcap`` is given, and each
        head's ``sinks`` logit added to its softmax denominator when given."""
        seen = any(row.bidirectional for row in batch.rows)
        if self.native and not seen and native.can_attend(kv.k[layer], kv.v[layer]):
            return self._attend_native(q, k, v, kv, layer, batch, scale, softcap, sinks)
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
            table = kv.table(layer)[row.slot]
            positions = np.arange(start, start + length)
            where = (table[positions // size], positions % size)
            used = table[: -(-(start + length) // size)]
            if kv.dtype == "q8_0":
                keys_all[where], kv.k_scale[layer][where] = _q8_0(k[span])
                values_all[where], kv.v_scale[layer][where] = _q8_0(v[span])
                keys = _from_q8_0(keys_all[used], kv.k_scale[layer][used], self.dtype)
                values = _from_q8_0(values_all[used], kv.v_scale[layer][used], self.dtype)
            else:
                keys_all[where], values_all[where] = k[span], v[span]
                keys, values = keys_all[used].astype(self.dtype), values_all[used].astype(self.dtype)
            keys = keys.reshape(-1, kv_heads, dim)[: start + length]
            values = values.reshape(-1, kv_heads, value_dim)[: start + length]
            # [kv_heads, group, queries, dim] @ [kv_heads, 1, dim, keys]: one BLAS product per head
            qs = q[span].reshape(length, kv_heads, group, dim).transpose(1, 2, 0, 3)
            scores = (qs @ keys.transpose(1, 2, 0)[:, None]) * scale
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            weights = self._softmax(scores, start, length, window, sinks, row.bidirectional)
            mixed = weights @ values.transpose(1, 0, 2)[:, None]  # [kv_heads, group, queries, value_dim]
            out[span] = mixed.transpose(2, 0, 1, 3).reshape(length, heads * value_dim)
        return out

    def _attend_native(self, q, k, v, kv: KVCache, layer: int, batch: Batch, scale: float, softcap, sinks):
        """:meth:`_attend` in C, for float32 or f16 pages."""
        keys_all, values_all, window = kv.k[layer], kv.v[layer], kv.layouts[layer].window
        out = np.empty((q.shape[0], q.shape[1] * v.shape[2]), np.float32)
        for row, offset in zip(batch.rows, batch.offsets):
            span = slice(offset, offset + len(row.tokens))
            table = kv.table(layer)[row.slot]
            native.attend(
                q[span],
                k[span],
                v[span],
                keys_all,
                values_all,
                table,
                row.start,
                window,
                scale,
                softcap,
                sinks,
                out[span],
                self.threads,
            )
        return out

    @staticmethod
    def _softmax(
        scores: np.ndarray,
        start: int,
        length: int,
        window: int | None,
        sinks: np.ndarray | None = None,
        bidirectional: bool = False,
    ) -> np.ndarray:
        """Softmax over the last axis (key positions 0..start+length-1) of the causal (or, ``bidirectional``, open to
        the whole span), windowed scores [kv_heads, group, queries, keys]; ``sinks`` [kv_heads * group] join the
        denominators."""
        query_pos = start + np.arange(length)[:, None]
        key_pos = np.arange(start + length)[None, :]
        masked = key_pos > (np.full_like(query_pos, start + length - 1) if bidirectional else query_pos)
        if window is not None:
            masked |= key_pos <= query_pos - window
        scores[..., masked] = -np.inf
        peak = scores.max(axis=-1, keepdims=True)
        if sinks is not None:
            sinks = sinks.reshape(*scores.shape[:2], 1, 1)
            peak = np.maximum(peak, sinks)
        weights = np.exp(scores - peak)
        total = weights.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total = total + np.exp(sinks - peak)
        return weights / total

    def moe(self, x: np.ndarray, weights: MoEWeights, spec: MoESpec) -> np.ndarray:
        logits = self.matmul(x, weights.router, weights.router_bias)
        ids, gains = route(logits, spec, weights.selection_bias)
        out = np.zeros_like(x)
        for expert in np.unique(ids):
            rows, slot = np.nonzero(ids == expert)
            h = x[rows]
            gate = self._product(h, weights.gate[expert])
            up = self._product(h, weights.up[expert])
            if weights.gate_bias is not None:
                gate = gate + weights.gate_bias[expert]
            if weights.up_bias is not None:
                up = up + weights.up_bias[expert]
            y = self._product(activate(gate, up, spec), weights.down[expert])
            if weights.down_bias is not None:
                y = y + weights.down_bias[expert]
            out[rows] += y * gains[rows, slot][:, None]  # a token selects an expert at most once
        return out

    def _product(self, x: np.ndarray, weight: np.ndarray | QuantizedWeight) -> np.ndarray:
        """x times the transpose of one matrix of a 3-D weight (an expert's, a head's): no bias, no activation
        rounding, whatever ``activations`` says."""
        return native.matmul(x, weight, self.threads) if isinstance(weight, QuantizedWeight) else x @ weight.T

    def head_matmul(self, x: np.ndarray, weight: np.ndarray | QuantizedStack) -> np.ndarray:
        if isinstance(weight, QuantizedStack):
            return np.stack([self._product(x[:, head], weight[head]) for head in range(x.shape[1])], axis=1)
        return np.matmul(x.transpose(1, 0, 2), weight.transpose(0, 2, 1)).transpose(1, 0, 2)

    def mla_attention(self, q_latent, q_rope, latent, k_rope, kv: KVCache, layer: int, batch: Batch, scale: float):
        keys_all = kv.k[layer]
        window = kv.layouts[layer].window
        n, heads, rank = q_latent.shape
        q = np.concatenate([q_latent, q_rope], axis=-1)
        k = np.concatenate([latent, k_rope], axis=-1)[:, None, :]
        out = np.empty((n, heads, rank), self.dtype)
        size = kv.page_size
        for row, offset in zip(batch.rows, batch.offsets):
            length, start = len(row.tokens), row.start
            span = slice(offset, offset + length)
            table = kv.table(layer)[row.slot]
            positions = np.arange(start, start + length)
            where = (table[positions // size], positions % size)
            used = table[: -(-(start + length) // size)]
            if kv.dtype == "q8_0":
                keys_all[where], kv.k_scale[layer][where] = _q8_0(k[span])
                keys = _from_q8_0(keys_all[used], kv.k_scale[layer][used], self.dtype)
            else:
                keys_all[where] = k[span]
                keys = keys_all[used].astype(self.dtype)
            keys = keys.reshape(-1, k.shape[-1])[: start + length]
            scores = np.matmul(q[span].transpose(1, 0, 2), keys.T) * scale  # [heads, queries, keys]
            weights = self._softmax(scores, start, length, window, bidirectional=row.bidirectional)
            out[span] = np.matmul(weights, keys[:, :rank]).transpose(1, 0, 2)
        return out
