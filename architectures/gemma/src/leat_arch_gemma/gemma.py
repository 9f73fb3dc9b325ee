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
from leat.hparams import REQUIRED, DecoderParams, derived, key, tensor_rows
from leat.modelfile import ModelFile
from leat.vision import Projector

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclass(frozen=True, kw_only=True)
class GemmaParams(DecoderParams):
    """Hyperparameters as the file states them; ``None`` = key absent, the family's default applies."""

    context: int = key(K.LLM.CONTEXT_LENGTH, 8192)
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-6, missing=REQUIRED)
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    rope_scaling_type: str | None = key(K.Rope.SCALING_TYPE, None)
    rope_scaling: float | None = key(K.Rope.SCALING_FACTOR, None)  # linear (unless named otherwise): positions / it
    rope_base_local: float | None = key(K.Rope.FREQ_BASE_SWA, None)
    window: int | None = key(K.Attention.SLIDING_WINDOW, None)
    pattern: int | tuple[bool, ...] | None = key(K.Attention.SLIDING_WINDOW_PATTERN, None)
    attn_softcap: float | None = key(K.LLM.ATTN_LOGIT_SOFTCAPPING, None)
    final_softcap: float | None = key(K.LLM.FINAL_LOGIT_SOFTCAPPING, None)
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, True)

    @property
    def linear_scaling(self) -> float | None:
        """The global layers' linear RoPE scaling factor: llama.cpp takes the factor as linear unless the file names
        another kind."""
        linear = (self.rope_scaling_type or "linear") == "linear"
        return self.rope_scaling if self.rope_scaling and linear else None


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
    Params = GemmaParams
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
        return p.rope_base, p.linear_scaling

    @classmethod
    def query_scale(cls, p: GemmaParams) -> float:
        return (p.width / p.heads if p.layers == cls.large_layers else p.head_dim) ** -0.5

    # -- description ---------------------------------------------------------------------------------
    @classmethod
    def read_params(cls, file: ModelFile) -> GemmaParams:
        p = super().read_params(file)
        if isinstance(p.pattern, tuple) and len(p.pattern) != p.layers:
            raise ModelFileError(
                f"{file.path}: sliding_window_pattern has {len(p.pattern)} flags for {p.layers} layers"
            )
        return p

    @classmethod
    def kv_layouts(cls, p: GemmaParams) -> list[KVLayout]:
        window = cls.window(p)
        return [KVLayout(p.kv_heads, p.head_dim, window=window if s else None) for s in cls.sliding(p)]

    # -- compute -------------------------------------------------------------------------------------
    def load_weights(self, w: Weights) -> None:
        p = self.params
        tied = p.tied or not self.untied_output
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, tied)
        self.attn_cap, self.final_cap = self.caps(p)
        local_base, local_scaling = self.local_rope(p)
        ropes = {
            False: RopeSpec(p.head_dim, p.rope_base, True, 1 / (p.linear_scaling or 1.0)),
            True: RopeSpec(p.head_dim, local_base, True, 1 / (local_scaling or 1.0)),
        }
        self.ropes = [ropes[s] for s in self.sliding(p)]

        def norm(kind: gguf.MODEL_TENSOR, i: int, present: bool = True) -> Any:
            return w(name(kind, i), (p.width,)) if present else None

        post = self.post_norms
        self.layers = [
            Layer(
                attn_norm=norm(T.ATTN_NORM, i),
                attn=blocks.load_attention(w, i, p.width, p.heads, p.kv_heads, p.head_dim, qk_norm=self.qk_norm),
                post_attn_norm=norm(T.ATTN_POST_NORM, i, post),
                ffn_norm=norm(T.FFN_NORM, i),
                gate=w(name(T.FFN_GATE, i), (p.ffn, p.width)),
                up=w(name(T.FFN_UP, i), (p.ffn, p.width)),
                down=w(name(T.FFN_DOWN, i), (p.width, p.ffn)),
                post_ffn_norm=norm(T.FFN_POST_NORM, i, post),
            )
            for i in range(p.layers)
        ]

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        # llama.cpp scales by sqrtf(n_embd) in float32, as here; an image's embeddings (batch.inputs) are not scaled
        x = B.scale(B.embed(self.embedding, batch.tokens), math.sqrt(p.width)) if batch.inputs is None else batch.inputs
        shape, scale = (p.heads, p.kv_heads, p.head_dim), self.query_scale(p)
        for i, layer in enumerate(self.layers):
            h = B.rms_norm(x, layer.attn_norm, p.norm_eps)
            h = blocks.attention(
                B, h, layer.attn, batch, kv, i, *shape, self.ropes[i], p.norm_eps, scale, self.attn_cap
            )
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
        params = dataclasses.replace(params, **overrides)
        return dataclasses.replace(params, rope_scaling_type="linear") if params.rope_scaling else params


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
        return (p.rope_base if p.rope_base_local is None else p.rope_base_local), p.linear_scaling


class Gemma3(Gemma):
    names = ("gemma3",)
    projectors = {  # noqa: RUF012 (a class constant)
        gguf.VisionProjectorType.GEMMA3: Projector("leat.vision.siglip:SigLIP", "<start_of_image>", "<end_of_image>")
    }
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
