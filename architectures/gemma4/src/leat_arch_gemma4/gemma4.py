"""Gemma 4 (``gemma4``): Gemma 3's post-normed GeGLU blocks, with two kinds of attention layer, per-layer embeddings
and layers that share the KV of earlier ones.

As llama.cpp's src/models/gemma4.cpp computes it:

* ``attention.sliding_window_pattern`` flags each layer sliding-window or full. The kinds have their own head size
  (``key_length_swa`` / ``key_length``), KV heads (``head_count_kv`` may be per layer), RoPE dimensions and base
  (``rope.dimension_count_swa`` and ``rope.freq_base_swa``, else 10000); full layers divide their frequencies by
  ``rope_freqs`` (the converter's "proportional" RoPE: factors of 1e30 leave dimensions unrotated). NEOX RoPE.
* q and k are RMS-normed per head with their weights, v without a weight; a file without ``attn_v`` uses k's
  projection, before its norm, as v. Scores are not scaled (llama.cpp's f_attention_scale 1).
* ``feed_forward_length`` may be per layer (E2B's double-wide MLPs in its shared-KV layers).
* Per-layer embeddings (``embedding_length_per_layer_input`` n > 0: E2B, E4B): layer l gets the input
  ``(rms_norm(per_layer_model_proj_l @ x0 / sqrt(width)) * per_layer_proj_norm + per_layer_token_embd_l[token] *
  sqrt(n)) / sqrt(2)``, with x0 the scaled token embedding and ``_l`` the l-th n-wide slice; after its MLP,
  ``x += rms_norm(per_layer_proj @ (gelu(per_layer_inp_gate @ x) * input_l)) * per_layer_post_norm``.
* ``layer_output_scale``, where present, multiplies each layer's output.
* The last ``attention.shared_kv_layers`` layers compute no K/V: they attend to the cache of the last sliding (or
  full) layer before them, as llama.cpp's reuse callback maps them, so the KV cache holds only the layers before.
* The final logits are soft-capped where ``final_logit_softcapping`` is set.
* Images (``gemma4v`` mmproj, :mod:`leat_arch_gemma4.vision`) go between ``<|image>`` and ``<image|>``; their
  embeddings are not scaled, and their per-layer inputs take token 0's row (llama.cpp's padding). Their row attends
  bidirectionally in the sliding layers only, the full layers staying causal (LLAMA_NON_CAUSAL_TYPE_SWA_ONLY), and
  causally everywhere in E2B and E4B (widths 1536 and 2560: mtmd_decode_use_non_causal).

The MoE models (26B-A4B: ``ffn_gate_inp``) are refused: their router reads another norm of the input than their
experts do, which :meth:`leat.backend.Backend.moe` does not take.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from leat import blocks
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.errors import ModelFileError
from leat.hparams import REQUIRED, DecoderParams, derived, has_tensor, key, tensor_rows
from leat.modelfile import ModelFile
from leat.vision import Projector

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


@dataclass(frozen=True, kw_only=True)
class Gemma4Params(DecoderParams):
    """Hyperparameters as the file states them. ``head_dim``, ``rope_dims`` and ``rope_base`` are the full layers'."""

    context: int = key(K.LLM.CONTEXT_LENGTH, 8192)
    ffn: int | tuple[int, ...] = key(K.LLM.FEED_FORWARD_LENGTH)
    kv_heads: int | tuple[int, ...] = key(K.Attention.HEAD_COUNT_KV, missing=lambda v: v["heads"])
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-6, missing=REQUIRED)
    head_dim_swa: int = key(
        K.Attention.KEY_LENGTH_SWA, missing=lambda v: v["head_dim"], also=(K.Attention.VALUE_LENGTH_SWA,)
    )
    rope_dims: int = key(K.Rope.DIMENSION_COUNT, missing=lambda v: v["head_dim"])
    rope_dims_swa: int = key(K.Rope.DIMENSION_COUNT_SWA, missing=lambda v: v["rope_dims"])
    rope_base: float = key(K.Rope.FREQ_BASE, 10000.0)
    rope_base_swa: float = key(K.Rope.FREQ_BASE_SWA, 10000.0)
    window: int = key(K.Attention.SLIDING_WINDOW)
    pattern: tuple[bool, ...] = key(K.Attention.SLIDING_WINDOW_PATTERN)
    shared_kv_layers: int = key(K.Attention.SHARED_KV_LAYERS, 0)
    per_layer: int = key(K.LLM.EMBD_LENGTH_PER_LAYER_INP, 0)
    final_softcap: float | None = key(K.LLM.FINAL_LOGIT_SOFTCAPPING, None)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))
    tied: bool = derived(lambda file, v: name(T.OUTPUT) not in file.tensors, True)
    separate_v: bool = derived(has_tensor(name(T.ATTN_V, 0)), True)
    output_scale: bool = derived(has_tensor(name(T.LAYER_OUT_SCALE, 0)), False)

    def per(self, value: int | tuple[int, ...], layer: int) -> int:
        return value[layer] if isinstance(value, tuple) else value

    @property
    def kv_layers(self) -> int:
        """The layers that compute their own K/V: all but the shared ones."""
        return self.layers - self.shared_kv_layers

    def kv_source(self, layer: int) -> int:
        """Whose KV ``layer`` attends to: its own, or (a shared layer) the last of its kind before them."""
        return layer if layer < self.kv_layers else self.kv_layers - (2 if self.pattern[layer] else 1)

    def head_size(self, layer: int) -> int:
        return self.head_dim_swa if self.pattern[layer] else self.head_dim


@dataclass
class Layer:
    attn_norm: Any
    q: Any
    q_norm: Any
    k: Any  # None in a shared-KV layer
    k_norm: Any
    v: Any  # None: v is k's projection
    o: Any
    post_attn_norm: Any
    ffn_norm: Any
    gate: Any
    up: Any
    down: Any
    post_ffn_norm: Any
    output_scale: float | None
    per_layer: tuple[Any, Any, Any, Any, Any] | None  # model projection rows, token embedding columns, gate, proj, norm


def check_pattern(file: ModelFile, p: Any) -> Any:
    if len(p.pattern) != p.layers:
        raise ModelFileError(f"{file.path}: sliding_window_pattern has {len(p.pattern)} flags for {p.layers} layers")
    return p


def layer_ropes(w: Weights, p: Gemma4Params) -> list[RopeSpec]:
    """Each layer's RoPE: the sliding layers' own; the full layers' divide their frequencies by ``rope_freqs``."""
    factors = w.host(name(T.ROPE_FREQS), (p.head_dim // 2,)) if not all(p.pattern) else None
    return [
        RopeSpec(p.rope_dims_swa, p.rope_base_swa, True)
        if p.pattern[i]
        else RopeSpec(p.rope_dims, p.rope_base, True, freq_factors=factors)
        for i in range(p.layers)
    ]


def load_layer(w: Weights, p: Gemma4Params, i: int) -> Layer:
    """Layer i's weights (a layer that reads another's KV, ``i >= p.kv_layers``, has no k or v)."""
    size, kv_heads, ffn, n = p.head_size(i), p.per(p.kv_heads, i), p.per(p.ffn, i), p.per_layer
    own_kv = i < p.kv_layers

    def norm(kind: gguf.MODEL_TENSOR, width: int = p.width) -> Any:
        return w(name(kind, i), (width,))

    per_layer = None
    if n:
        rows, total = np.arange(i * n, (i + 1) * n), (p.layers * n, p.width)
        per_layer = (
            w.rows(name(T.PER_LAYER_MODEL_PROJ), total, rows),
            w.columns(name(T.PER_LAYER_TOKEN_EMBD), (p.vocab, p.layers * n), i * n, (i + 1) * n),
            w(name(T.PER_LAYER_INP_GATE, i), (n, p.width)),
            w(name(T.PER_LAYER_PROJ, i), (p.width, n)),
            norm(T.PER_LAYER_POST_NORM),
        )
    scale = w.host(name(T.LAYER_OUT_SCALE, i), (1,)) if p.output_scale else None
    return Layer(
        attn_norm=norm(T.ATTN_NORM),
        q=w(name(T.ATTN_Q, i), (p.heads * size, p.width)),
        q_norm=norm(T.ATTN_Q_NORM, size),
        k=w(name(T.ATTN_K, i), (kv_heads * size, p.width)) if own_kv else None,
        k_norm=norm(T.ATTN_K_NORM, size) if own_kv else None,
        v=w(name(T.ATTN_V, i), (kv_heads * size, p.width)) if own_kv and p.separate_v else None,
        o=w(name(T.ATTN_OUT, i), (p.width, p.heads * size)),
        post_attn_norm=norm(T.ATTN_POST_NORM),
        ffn_norm=norm(T.FFN_NORM),
        gate=w(name(T.FFN_GATE, i), (ffn, p.width)),
        up=w(name(T.FFN_UP, i), (ffn, p.width)),
        down=w(name(T.FFN_DOWN, i), (p.width, ffn)),
        post_ffn_norm=norm(T.FFN_POST_NORM),
        output_scale=None if scale is None else float(scale[0]),
        per_layer=per_layer,
    )


def feed_forward(B: Any, x: Any, layer: Layer, eps: float) -> Any:
    """``x`` plus the layer's post-normed GeGLU MLP of ``rms_norm(x)``."""
    h = B.rms_norm(x, layer.ffn_norm, eps)
    h = B.matmul(B.gelu_mul(B.matmul(h, layer.gate), B.matmul(h, layer.up)), layer.down)
    return B.add(x, B.rms_norm(h, layer.post_ffn_norm, eps))


class Gemma4(Architecture):
    names = ("gemma4",)
    Params = Gemma4Params
    projectors = {  # noqa: RUF012 (a class constant)
        gguf.VisionProjectorType.GEMMA4V: Projector("leat_arch_gemma4.vision:Gemma4Vision", "<|image>", "<image|>")
    }
    CAUSAL_IMAGES = (1536, 2560)  # E2B's and E4B's widths: their images attend causally

    @classmethod
    def read_params(cls, file: ModelFile) -> Gemma4Params:
        p = check_pattern(file, super().read_params(file))
        if any(name(T.FFN_GATE_INP, i) in file.tensors for i in range(p.layers)):
            raise ModelFileError(
                f"{file.path}: a Gemma 4 MoE model (ffn_gate_inp): leat-arch-gemma4 runs the dense ones only, since "
                f"its router reads another norm of the input than its experts, which Backend.moe does not take"
            )
        if p.shared_kv_layers and (p.kv_layers < 2 or not p.pattern[p.kv_layers - 2] or p.pattern[p.kv_layers - 1]):
            raise ModelFileError(
                f"{file.path}: {p.shared_kv_layers} shared-KV layers need a sliding then a full layer just before them"
            )
        return p

    @classmethod
    def kv_layouts(cls, p: Gemma4Params) -> list[KVLayout]:
        return [
            KVLayout(p.per(p.kv_heads, i), p.head_size(i), window=p.window if p.pattern[i] else None)
            for i in range(p.kv_layers)
        ]

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, p.tied)
        self.ropes = layer_ropes(w, p)
        if p.per_layer:
            self.per_layer_norm = w(name(T.PER_LAYER_PROJ_NORM), (p.per_layer,))
        self.layers = [load_layer(w, p, i) for i in range(p.layers)]

    def attention(self, x: Any, i: int, batch: Batch, kv: Any, computed: dict[int, tuple[Any, Any]]) -> Any:
        """Layer i's attention; ``computed`` holds each KV layer's k and v of this batch, for the shared layers."""
        B, p, layer, n = self.backend, self.params, self.layers[i], len(batch)
        size, kv_heads = p.head_size(i), p.per(p.kv_heads, i)
        q = B.rms_norm(B.reshape(B.matmul(x, layer.q), (n, p.heads, size)), layer.q_norm, p.norm_eps)
        q = B.rope(q, batch.positions, self.ropes[i])
        if layer.k is not None:
            k = B.reshape(B.matmul(x, layer.k), (n, kv_heads, size))
            v = k if layer.v is None else B.reshape(B.matmul(x, layer.v), (n, kv_heads, size))
            k = B.rope(B.rms_norm(k, layer.k_norm, p.norm_eps), batch.positions, self.ropes[i])
            computed[i] = (k, B.rms_norm(v, None, p.norm_eps))
        source = p.kv_source(i)  # a shared layer writes its source's k and v again: the same values
        return B.matmul(B.attention(q, *computed[source], kv, source, batch, 1.0), layer.o)

    def per_layer_inputs(self, x0: Any, batch: Batch) -> list[Any]:
        B, p = self.backend, self.params
        tokens = batch.tokens if batch.inputs is None else np.zeros_like(batch.tokens)
        inputs = []
        for layer in self.layers:
            assert layer.per_layer is not None
            projection, embedding = layer.per_layer[:2]
            h = B.rms_norm(B.scale(B.matmul(x0, projection), 1 / math.sqrt(p.width)), self.per_layer_norm, p.norm_eps)
            h = B.add(h, B.scale(B.embed(embedding, tokens), math.sqrt(p.per_layer)))
            inputs.append(B.scale(h, 1 / math.sqrt(2)))
        return inputs

    def forward(self, batch: Batch, kv: Any) -> Any:
        return self.logits(self.hidden(batch, kv))

    def logits(self, hidden: Any) -> Any:
        logits = self.backend.matmul(hidden, self.output)
        cap = self.params.final_softcap
        return self.backend.softcap(logits, cap) if cap else logits

    def hidden(self, batch: Batch, kv: Any) -> Any:
        x, _ = self.layers_out(batch, kv)
        return self.backend.rms_norm(
            self.backend.take_rows(x, batch.logit_index), self.output_norm, self.params.norm_eps
        )

    def forward_hidden(self, batch: Batch, kv: Any) -> tuple[Any, Any]:
        logits, hidden, _ = self.forward_shared_kv(batch, kv)
        return logits, hidden

    def forward_shared_kv(self, batch: Batch, kv: Any) -> tuple[Any, Any, list[tuple[Any, Any]]]:
        """:meth:`forward_hidden`'s logits and states, and the keys and values (as the cache holds them) of every
        position of the batch in the KV layers that the last two layers read: a Gemma 4 assistant drafter attends to
        these (the last sliding layer's source, then the last full layer's, as llama.cpp shares them)."""
        B, p = self.backend, self.params
        x, computed = self.layers_out(batch, kv)
        h = B.rms_norm(x, self.output_norm, p.norm_eps)
        shared = [computed[p.kv_source(p.layers - 2)], computed[p.kv_source(p.layers - 1)]]
        return self.logits(B.take_rows(h, batch.logit_index)), h, shared

    def layers_out(self, batch: Batch, kv: Any) -> tuple[Any, dict[int, tuple[Any, Any]]]:
        """The last layer's output at every position, and each KV layer's k and v of this batch."""
        B, p = self.backend, self.params
        x = B.scale(B.embed(self.embedding, batch.tokens), math.sqrt(p.width)) if batch.inputs is None else batch.inputs
        inputs = self.per_layer_inputs(x, batch) if p.per_layer else []
        causal = self.causal(batch)
        computed: dict[int, tuple[Any, Any]] = {}
        for i, layer in enumerate(self.layers):
            seen = batch if p.pattern[i] and p.width not in self.CAUSAL_IMAGES else causal
            h = self.attention(B.rms_norm(x, layer.attn_norm, p.norm_eps), i, seen, kv, computed)
            x = feed_forward(B, B.add(x, B.rms_norm(h, layer.post_attn_norm, p.norm_eps)), layer, p.norm_eps)
            if layer.per_layer is not None:
                gate, projection, norm = layer.per_layer[2:]
                h = B.matmul(B.gelu_mul(B.matmul(x, gate), inputs[i]), projection)
                x = B.add(x, B.rms_norm(h, norm, p.norm_eps))
            if layer.output_scale is not None:
                x = B.scale(x, layer.output_scale)
        return x, computed

    @staticmethod
    def causal(batch: Batch) -> Batch:
        """``batch`` with every row causal (an image's row as the full layers see it)."""
        if not any(row.bidirectional for row in batch.rows):
            return batch
        return Batch([Row(r.slot, r.start, r.tokens, r.all_logits, False, r.inputs) for r in batch.rows])

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> Gemma4Params:
        """E2B's shape, small: 6 layers alternating sliding (window 8, heads of 16, 2 KV heads, RoPE base 10000) and
        full (heads of 32, 1 KV head, proportional RoPE base 1e6), the last two sharing the KV of the two before them
        with double-wide MLPs, per-layer embeddings 32 wide, output scales, logits capped at 30."""
        params = Gemma4Params(
            layers=6, width=64, ffn=(128, 128, 128, 128, 256, 256), heads=4, kv_heads=(2, 1, 2, 1, 2, 1),
            head_dim=32, head_dim_swa=16, rope_dims=32, rope_dims_swa=16, rope_base=1e6, rope_base_swa=10000.0,
            window=8, pattern=(True, False) * 3, shared_kv_layers=2, per_layer=32, final_softcap=30.0, vocab=300,
            context=256, output_scale=True,
        )  # fmt: skip
        return dataclasses.replace(params, **overrides)
