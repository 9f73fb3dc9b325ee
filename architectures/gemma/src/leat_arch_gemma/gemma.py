"""Gemma, Gemma 2 and Gemma 3: pre-norm blocks with a GeGLU MLP and NEOX RoPE, embeddings scaled by sqrt(d).

Particular to this family, as llama.cpp's src/models/gemma*.cpp compute it:

* RMSNorm weights are used as stored: llama.cpp's converter already added the 1 that Hugging Face's
  ``GemmaRMSNorm`` adds at run time.
* Gemma 2 and 3 also norm each sublayer's output (``post_attention_norm``, ``post_ffw_norm``) before the
  residual add. Gemma 2 soft-caps attention scores (``attn_logit_softcapping``, default 50) and the final
  logits (``final_logit_softcapping``, default 30); Gemma 3 caps only the logits, and only when the file says.
* Interleaved sliding-window layers: a layer slides when ``il % n < n - 1`` for the period n in
  ``attention.sliding_window_pattern`` (default 2 for Gemma 2, 6 for Gemma 3), or as that key's per-layer
  flags. Gemma 2 always slides (window 4096 unless the file says); Gemma 3 only with a ``sliding_window``.
  Sliding layers rotate with ``rope.freq_base_swa`` (Gemma 2: else the global base; Gemma 3: else 10000,
  and never with the global linear scaling).
* Queries are scaled by 1/sqrt(head_dim), except in the 27B models (46 layers in Gemma 2, 62 in Gemma 3),
  by 1/sqrt(width / heads): llama.cpp's stand-in for ``query_pre_attn_scalar``, which GGUF does not carry.
* Gemma 3 norms q and k per head before RoPE, and may carry an untied ``output.weight``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import gguf
from leat import blocks
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.modelfile import ModelFile

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclass(frozen=True)
class GemmaParams:
    """Hyperparameters as the file states them; ``None`` = key absent, the family's default applies."""

    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_base_local: float | None = None
    rope_scaling: float | None = None  # linear: global layers' positions are divided by it
    window: int | None = None
    pattern: int | tuple[bool, ...] | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    context: int = 8192
    tied: bool = True


@dataclass
class Layer:
    attn_norm: Any
    attn: blocks.AttentionWeights
    post_attn_norm: Any
    ffn_norm: Any
    gate: Any
    up: Any
    down: Any
    post_ffn_norm: Any


class Gemma(Architecture):
    names = ("gemma",)
    post_norms = False
    qk_norm = False
    untied_output = False  # may the file carry output.weight
    default_pattern: int | None = None  # None: no layer slides
    large_layers = 0  # layer count of the 27B model, whose queries are scaled by 1/sqrt(width / heads)

    # -- per-family rules ----------------------------------------------------------------------------
    @classmethod
    def sliding(cls, p: GemmaParams) -> list[bool]:
        if cls.default_pattern is None or cls.window(p) is None:
            return [False] * p.layers
        if isinstance(p.pattern, tuple):
            return list(p.pattern)
        n = cls.default_pattern if p.pattern is None else p.pattern
        return [n == 0 or i % n < n - 1 for i in range(p.layers)]

    @classmethod
    def window(cls, p: GemmaParams) -> int | None:
        return None

    @classmethod
    def caps(cls, p: GemmaParams) -> tuple[float | None, float | None]:
        """Soft-caps of the attention scores and of the final logits (None: not capped)."""
        return None, None

    @classmethod
    def local_rope(cls, p: GemmaParams) -> tuple[float, float | None]:
        """RoPE base and linear scaling factor of sliding-window layers."""
        return p.rope_base, p.rope_scaling

    @classmethod
    def query_scale(cls, p: GemmaParams) -> float:
        return (p.width / p.heads if p.layers == cls.large_layers else p.head_dim) ** -0.5

    # -- description ---------------------------------------------------------------------------------
    @classmethod
    def read_params(cls, file: ModelFile) -> GemmaParams:
        def optional(key: str, kind: type) -> Any:
            value = file.get(key, None)
            return None if value is None else kind(value)

        width = int(file.get(K.LLM.EMBEDDING_LENGTH))
        heads = int(file.get(K.Attention.HEAD_COUNT))
        layers = int(file.get(K.LLM.BLOCK_COUNT))
        pattern = file.get(K.Attention.SLIDING_WINDOW_PATTERN, None)
        if isinstance(pattern, list) and len(pattern) != layers:
            raise ModelFileError(f"{file.path}: sliding_window_pattern has {len(pattern)} flags for {layers} layers")
        scaling = optional(K.Rope.SCALING_FACTOR, float)
        return GemmaParams(
            layers=layers,
            width=width,
            ffn=int(file.get(K.LLM.FEED_FORWARD_LENGTH)),
            heads=heads,
            kv_heads=int(file.get(K.Attention.HEAD_COUNT_KV, heads)),
            head_dim=int(file.get(K.Attention.KEY_LENGTH, width // heads)),
            vocab=file.tensor(name(T.TOKEN_EMBD)).shape[0],
            norm_eps=float(file.get(K.Attention.LAYERNORM_RMS_EPS)),
            rope_base=float(file.get(K.Rope.FREQ_BASE, 10000.0)),
            rope_base_local=optional(K.Rope.FREQ_BASE_SWA, float),
            # llama.cpp takes the factor as linear unless the file names another kind
            rope_scaling=scaling if scaling and file.get(K.Rope.SCALING_TYPE, "linear") == "linear" else None,
            window=optional(K.Attention.SLIDING_WINDOW, int),
            pattern=tuple(bool(b) for b in pattern) if isinstance(pattern, list) else pattern,
            attn_softcap=optional(K.LLM.ATTN_LOGIT_SOFTCAPPING, float),
            final_softcap=optional(K.LLM.FINAL_LOGIT_SOFTCAPPING, float),
            context=int(file.get(K.LLM.CONTEXT_LENGTH, 8192)),
            tied=name(T.OUTPUT) not in file.tensors,
        )

    @property
    def vocab_size(self) -> int:
        return self.params.vocab

    @classmethod
    def kv_layouts(cls, p: GemmaParams) -> list[KVLayout]:
        window = cls.window(p)
        return [KVLayout(p.kv_heads, p.head_dim, window=window if s else None) for s in cls.sliding(p)]

    # -- compute -------------------------------------------------------------------------------------
    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD))
        self.output_norm = w(name(T.OUTPUT_NORM))
        self.output = self.embedding if p.tied or not self.untied_output else w(name(T.OUTPUT))
        self.attn_cap, self.final_cap = self.caps(p)
        local_base, local_scaling = self.local_rope(p)
        ropes = {
            False: RopeSpec(p.head_dim, p.rope_base, True, 1 / (p.rope_scaling or 1.0)),
            True: RopeSpec(p.head_dim, local_base, True, 1 / (local_scaling or 1.0)),
        }
        self.ropes = [ropes[s] for s in self.sliding(p)]
        post = self.post_norms
        self.layers = [
            Layer(
                attn_norm=w(name(T.ATTN_NORM, i)),
                attn=blocks.AttentionWeights(
                    q=w(name(T.ATTN_Q, i)),
                    k=w(name(T.ATTN_K, i)),
                    v=w(name(T.ATTN_V, i)),
                    o=w(name(T.ATTN_OUT, i)),
                    q_norm=w(name(T.ATTN_Q_NORM, i)) if self.qk_norm else None,
                    k_norm=w(name(T.ATTN_K_NORM, i)) if self.qk_norm else None,
                ),
                post_attn_norm=w(name(T.ATTN_POST_NORM, i)) if post else None,
                ffn_norm=w(name(T.FFN_NORM, i)),
                gate=w(name(T.FFN_GATE, i)),
                up=w(name(T.FFN_UP, i)),
                down=w(name(T.FFN_DOWN, i)),
                post_ffn_norm=w(name(T.FFN_POST_NORM, i)) if post else None,
            )
            for i in range(p.layers)
        ]

    def attention(self, x: Any, w: blocks.AttentionWeights, batch: Batch, kv: Any, layer: int) -> Any:
        B, p, n = self.backend, self.params, len(batch)
        q = B.reshape(B.matmul(x, w.q), (n, p.heads, p.head_dim))
        k = B.reshape(B.matmul(x, w.k), (n, p.kv_heads, p.head_dim))
        v = B.reshape(B.matmul(x, w.v), (n, p.kv_heads, p.head_dim))
        if w.q_norm is not None:
            q, k = B.rms_norm(q, w.q_norm, p.norm_eps), B.rms_norm(k, w.k_norm, p.norm_eps)
        q = B.rope(q, batch.positions, self.ropes[layer])
        k = B.rope(k, batch.positions, self.ropes[layer])
        scale = self.query_scale(p)
        if self.attn_cap is None:
            out = B.attention(q, k, v, kv, layer, batch, scale)
        else:
            out = B.attention_softcap(q, k, v, kv, layer, batch, scale, self.attn_cap)
        return B.matmul(out, w.o)

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        # llama.cpp scales by sqrtf(n_embd) in float32, as here
        x = B.scale(B.embed(self.embedding, batch.tokens), math.sqrt(p.width))
        for i, layer in enumerate(self.layers):
            h = self.attention(B.rms_norm(x, layer.attn_norm, p.norm_eps), layer.attn, batch, kv, i)
            if layer.post_attn_norm is not None:
                h = B.rms_norm(h, layer.post_attn_norm, p.norm_eps)
            x = B.add(x, h)
            h = B.rms_norm(x, layer.ffn_norm, p.norm_eps)
            h = B.matmul(B.gelu_mul(B.matmul(h, layer.gate), B.matmul(h, layer.up)), layer.down)
            if layer.post_ffn_norm is not None:
                h = B.rms_norm(h, layer.post_ffn_norm, p.norm_eps)
            x = B.add(x, h)
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        logits = B.matmul(x, self.output)
        return logits if self.final_cap is None else B.softcap(logits, self.final_cap)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> GemmaParams:
        params = GemmaParams(layers=2, width=64, ffn=128, heads=4, kv_heads=2, head_dim=16, vocab=300, context=256)
        return dataclasses.replace(params, **overrides)

    @classmethod
    def tensor_shapes(cls, p: GemmaParams) -> dict[str, tuple[int, ...]]:
        shapes = {name(T.TOKEN_EMBD): (p.vocab, p.width), name(T.OUTPUT_NORM): (p.width,)}
        if not p.tied and cls.untied_output:
            shapes[name(T.OUTPUT)] = (p.vocab, p.width)
        for i in range(p.layers):
            shapes |= {
                name(T.ATTN_NORM, i): (p.width,),
                name(T.ATTN_Q, i): (p.heads * p.head_dim, p.width),
                name(T.ATTN_K, i): (p.kv_heads * p.head_dim, p.width),
                name(T.ATTN_V, i): (p.kv_heads * p.head_dim, p.width),
                name(T.ATTN_OUT, i): (p.width, p.heads * p.head_dim),
            }
            if cls.qk_norm:
                shapes |= {name(T.ATTN_Q_NORM, i): (p.head_dim,), name(T.ATTN_K_NORM, i): (p.head_dim,)}
            if cls.post_norms:
                shapes[name(T.ATTN_POST_NORM, i)] = (p.width,)
            shapes |= {
                name(T.FFN_NORM, i): (p.width,),
                name(T.FFN_GATE, i): (p.ffn, p.width),
                name(T.FFN_UP, i): (p.ffn, p.width),
                name(T.FFN_DOWN, i): (p.width, p.ffn),
            }
            if cls.post_norms:
                shapes[name(T.FFN_POST_NORM, i)] = (p.width,)
        return shapes

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, p: GemmaParams) -> None:
        writer.add_block_count(p.layers)
        writer.add_context_length(p.context)
        writer.add_embedding_length(p.width)
        writer.add_feed_forward_length(p.ffn)
        writer.add_head_count(p.heads)
        writer.add_head_count_kv(p.kv_heads)
        writer.add_key_length(p.head_dim)
        writer.add_value_length(p.head_dim)
        writer.add_layer_norm_rms_eps(p.norm_eps)
        writer.add_rope_freq_base(p.rope_base)
        writer.add_vocab_size(p.vocab)
        if p.rope_scaling is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(p.rope_scaling)
        if p.rope_base_local is not None:
            writer.add_rope_freq_base_swa(p.rope_base_local)
        if p.window is not None:
            writer.add_sliding_window(p.window)
        if p.pattern is not None:
            writer.add_sliding_window_pattern(list(p.pattern) if isinstance(p.pattern, tuple) else p.pattern)
        if p.attn_softcap is not None:
            writer.add_attn_logit_softcapping(p.attn_softcap)
        if p.final_softcap is not None:
            writer.add_final_logit_softcapping(p.final_softcap)


class Gemma2(Gemma):
    names = ("gemma2",)
    post_norms = True
    default_pattern = 2
    large_layers = 46

    @classmethod
    def window(cls, p: GemmaParams) -> int | None:
        return 4096 if p.window is None else p.window

    @classmethod
    def caps(cls, p: GemmaParams) -> tuple[float | None, float | None]:
        return (50.0 if p.attn_softcap is None else p.attn_softcap), (
            30.0 if p.final_softcap is None else p.final_softcap
        )

    @classmethod
    def local_rope(cls, p: GemmaParams) -> tuple[float, float | None]:
        return (p.rope_base if p.rope_base_local is None else p.rope_base_local), p.rope_scaling


class Gemma3(Gemma):
    names = ("gemma3",)
    post_norms = True
    qk_norm = True
    untied_output = True
    default_pattern = 6
    large_layers = 62

    @classmethod
    def window(cls, p: GemmaParams) -> int | None:
        return p.window or None

    @classmethod
    def caps(cls, p: GemmaParams) -> tuple[float | None, float | None]:
        return None, p.final_softcap or None

    @classmethod
    def local_rope(cls, p: GemmaParams) -> tuple[float, float | None]:
        return (10000.0 if p.rope_base_local is None else p.rope_base_local), None
