"""gpt-oss (OpenAI's open-weight MoE): pre-norm blocks, GQA attention with sinks, a MoE MLP in every layer.

Particular to this family, as llama.cpp's ``openai-moe`` graph computes it:

* attention sinks: a learned logit per query head (``attn_sinks``) joins each softmax's denominator;
* layers alternate between a sliding window (``attention.sliding_window``) and full attention: with
  llama.cpp's default pattern period 2, even layers slide (``attention.sliding_window_pattern``, a
  period or one flag per layer, overrides it);
* YaRN RoPE (NEOX layout) from the ``rope.scaling.*`` keys, the same on both kinds of layer unless
  ``rope.freq_base_swa`` gives sliding layers their own base; scores scaled by 1/sqrt(head_dim);
* biases on every projection, and the MLP's norm is named ``post_attention_norm``;
* the MoE router has a bias, and the softmax is taken over the top-k *logits* only; the experts
  (MXFP4 in the released files) use the clamped SwiGLU ``swiglu_oai`` (alpha 1.702, limit 7) and
  have biases; the output matrix is never tied.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gguf
from leat import blocks, moe
from leat.architecture import Architecture, Weights
from leat.backend import KVLayout
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.hparams import REQUIRED, key, tensor_rows
from leat.modelfile import ModelFile
from leat.rope import rope_from_metadata

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


def sliding_layers(layers: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's ``set_swa_pattern``: in each period of layers all but the last slide (period 0: all)."""
    return tuple(period == 0 or i % period < period - 1 for i in range(layers))


def read_pattern(file: ModelFile, values: dict[str, Any]) -> tuple[bool, ...] | None:
    """The per-layer sliding flags the file states (a list, or a period as ``sliding_layers``), None without the key."""
    pattern = file.get(K.Attention.SLIDING_WINDOW_PATTERN, None)
    if pattern is None or isinstance(pattern, list):
        return pattern
    return sliding_layers(values["layers"], int(pattern))


@dataclass(frozen=True, kw_only=True)
class GptOssParams:
    layers: int = key(K.LLM.BLOCK_COUNT)
    context: int = key(K.LLM.CONTEXT_LENGTH, 131072, missing=REQUIRED)
    width: int = key(K.LLM.EMBEDDING_LENGTH)
    ffn: int | None = key(K.LLM.FEED_FORWARD_LENGTH, None)  # the converter writes the experts' size here too
    heads: int = key(K.Attention.HEAD_COUNT)
    kv_heads: int = key(K.Attention.HEAD_COUNT_KV, missing=lambda v: v["heads"])
    head_dim: int = key(
        K.Attention.KEY_LENGTH,
        missing=lambda v: v["width"] // v["heads"],
        also=(K.Attention.VALUE_LENGTH, K.Rope.DIMENSION_COUNT),
    )
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-5, missing=REQUIRED)
    rope_base: float = key(K.Rope.FREQ_BASE, 150000.0, missing=10000.0)
    rope_base_swa: float | None = key(K.Rope.FREQ_BASE_SWA, None)
    rope_scaling: str | None = key(K.Rope.SCALING_TYPE, "yarn", missing=None)
    yarn_factor: float | None = key(K.Rope.SCALING_FACTOR, 32.0, missing=None)
    yarn_context: int | None = key(K.Rope.SCALING_ORIG_CTX_LEN, 4096, missing=None)
    window: int = key(K.Attention.SLIDING_WINDOW)
    # per layer: does it attend to the last `window` positions only (None: llama.cpp's default, period 2)
    sliding: tuple[bool, ...] | None = key(K.Attention.SLIDING_WINDOW_PATTERN, None, read=read_pattern)
    experts: int = key(K.LLM.EXPERT_COUNT)
    experts_used: int = key(K.LLM.EXPERT_USED_COUNT)
    expert_ffn: int = key(K.LLM.EXPERT_FEED_FORWARD_LENGTH)
    vocab: int = key(K.LLM.VOCAB_SIZE, read=tensor_rows(name(T.TOKEN_EMBD)))

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        return self.sliding if self.sliding is not None else sliding_layers(self.layers, 2)


@dataclass
class Layer(blocks.DecoderLayer):
    sinks: Any = None  # [heads]: each query head's learned logit in the softmax's denominator


class GptOss(Architecture):
    names = ("gpt-oss",)
    Params = GptOssParams

    @classmethod
    def read_params(cls, file: ModelFile) -> GptOssParams:
        p = super().read_params(file)
        if len(p.sliding_layers) != p.layers:
            raise ModelFileError(
                f"{file.path}: sliding_window_pattern has {len(p.sliding_layers)} flags for {p.layers} layers"
            )
        return p

    @classmethod
    def kv_layouts(cls, p: GptOssParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim, window=p.window if s else None) for s in p.sliding_layers]

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding, self.output_norm, self.output = blocks.load_embedding_and_output(w, p.vocab, p.width, False)
        rope = rope_from_metadata(self.file, p.head_dim, neox=True)
        rope_swa = rope_from_metadata(self.file, p.head_dim, neox=True, base=p.rope_base_swa or p.rope_base)
        self.ropes = [rope_swa if sliding else rope for sliding in p.sliding_layers]
        self.spec = moe.MoESpec(p.experts, p.experts_used, "softmax_selected", activation="swiglu_oai")
        q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim

        def projection(kind: gguf.MODEL_TENSOR, i: int, rows: int, cols: int) -> tuple[Any, Any]:
            return w(name(kind, i), (rows, cols)), w(name(kind, i, "bias"), (rows,))

        self.layers = []
        for i in range(p.layers):
            attn_norm = w(name(T.ATTN_NORM, i), (p.width,))
            (wq, bq), (wk, bk), (wv, bv) = (
                projection(t, i, n, p.width) for t, n in zip((T.ATTN_Q, T.ATTN_K, T.ATTN_V), (q, kv, kv))
            )
            wo, bo = projection(T.ATTN_OUT, i, p.width, q)
            attn = blocks.AttentionWeights(wq, wk, wv, wo, bq, bk, bv, bo)
            sinks = w(name(T.ATTN_SINKS, i), (p.heads,))
            ffn_norm = w(name(T.ATTN_POST_NORM, i), (p.width,))
            experts = moe.load_moe(w, i, p.width, p.expert_ffn, p.experts, biases=True, selection_bias=False)
            self.layers.append(Layer(attn_norm, attn, ffn_norm, experts=experts, sinks=sinks))

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        shape = (p.heads, p.kv_heads, p.head_dim)
        for i, layer in enumerate(self.layers):  # pre-norm attention with sinks, then a pre-norm MoE
            x = blocks.decoder_layer(
                B, x, layer, batch, kv, i, *shape, self.ropes[i], p.norm_eps, self.spec, layer.sinks
            )
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.output)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> GptOssParams:
        shape = {"layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 300, "context": 256}
        experts = {"experts": 4, "experts_used": 2, "expert_ffn": 32, "window": 8}
        params = GptOssParams(**shape | experts | overrides)
        default = params.sliding == sliding_layers(params.layers, 2)
        yarn = {} if params.yarn_factor else {"rope_scaling": None, "yarn_factor": None, "yarn_context": None}
        return dataclasses.replace(params, ffn=params.expert_ffn, sliding=None if default else params.sliding, **yarn)
