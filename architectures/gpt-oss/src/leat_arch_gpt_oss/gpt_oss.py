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
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat.rope import rope_from_metadata

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor


def sliding_layers(layers: int, period: int) -> tuple[bool, ...]:
    """llama.cpp's ``set_swa_pattern``: in each period of layers all but the last slide (period 0: all)."""
    return tuple(period == 0 or i % period < period - 1 for i in range(layers))


@dataclass(frozen=True)
class GptOssParams:
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    experts_used: int
    expert_ffn: int
    window: int
    sliding: tuple[bool, ...]  # per layer: does it attend to the last `window` positions only
    norm_eps: float = 1e-5
    rope_base: float = 150000.0
    rope_base_swa: float | None = None
    yarn_factor: float = 32.0
    yarn_context: int = 4096
    context: int = 131072


@dataclass
class Layer:
    attn_norm: Any
    attn: blocks.AttentionWeights
    sinks: Any
    ffn_norm: Any
    experts: moe.MoEWeights
    rope: RopeSpec


class GptOss(Architecture):
    names = ("gpt-oss",)

    @classmethod
    def read_params(cls, file: ModelFile) -> GptOssParams:
        width = int(file.get(K.LLM.EMBEDDING_LENGTH))
        heads = int(file.get(K.Attention.HEAD_COUNT))
        layers = int(file.get(K.LLM.BLOCK_COUNT))
        pattern = file.get(K.Attention.SLIDING_WINDOW_PATTERN, 2)
        sliding = tuple(bool(s) for s in pattern) if isinstance(pattern, list) else sliding_layers(layers, pattern)
        if len(sliding) != layers:
            raise ModelFileError(f"{file.path}: sliding_window_pattern has {len(sliding)} flags for {layers} layers")
        base_swa = file.get(K.Rope.FREQ_BASE_SWA, None)
        return GptOssParams(
            layers=layers,
            width=width,
            heads=heads,
            kv_heads=int(file.get(K.Attention.HEAD_COUNT_KV, heads)),
            head_dim=int(file.get(K.Attention.KEY_LENGTH, width // heads)),
            vocab=file.tensor(name(T.TOKEN_EMBD)).shape[0],
            experts=int(file.get(K.LLM.EXPERT_COUNT)),
            experts_used=int(file.get(K.LLM.EXPERT_USED_COUNT)),
            expert_ffn=int(file.get(K.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            window=int(file.get(K.Attention.SLIDING_WINDOW)),
            sliding=sliding,
            norm_eps=float(file.get(K.Attention.LAYERNORM_RMS_EPS)),
            rope_base=float(file.get(K.Rope.FREQ_BASE, 10000.0)),
            rope_base_swa=float(base_swa) if base_swa is not None else None,
            yarn_factor=float(file.get(K.Rope.SCALING_FACTOR, 0.0)),
            yarn_context=int(file.get(K.Rope.SCALING_ORIG_CTX_LEN, 0)),
            context=int(file.get(K.LLM.CONTEXT_LENGTH)),
        )

    @property
    def vocab_size(self) -> int:
        return self.params.vocab

    @classmethod
    def kv_layouts(cls, p: GptOssParams) -> list[KVLayout]:
        return [KVLayout(p.kv_heads, p.head_dim, window=p.window if s else None) for s in p.sliding]

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD))
        self.output_norm = w(name(T.OUTPUT_NORM))
        self.output = w(name(T.OUTPUT))
        rope = rope_from_metadata(self.file, p.head_dim, neox=True)
        rope_swa = rope_from_metadata(self.file, p.head_dim, neox=True, base=p.rope_base_swa or p.rope_base)
        self.spec = moe.MoESpec(p.experts, p.experts_used, "softmax_selected", activation="swiglu_oai")
        self.layers = [
            Layer(
                attn_norm=w(name(T.ATTN_NORM, i)),
                attn=blocks.load_attention(w, i),
                sinks=w(name(T.ATTN_SINKS, i)),
                ffn_norm=w(name(T.ATTN_POST_NORM, i)),
                experts=moe.load_moe(w, i),
                rope=rope_swa if p.sliding[i] else rope,
            )
            for i in range(p.layers)
        ]

    def attention(self, x: Any, layer: Layer, i: int, batch: Batch, kv: Any) -> Any:
        B, p, w, n = self.backend, self.params, layer.attn, len(batch)
        q = B.reshape(B.matmul(x, w.q, w.q_bias), (n, p.heads, p.head_dim))
        k = B.reshape(B.matmul(x, w.k, w.k_bias), (n, p.kv_heads, p.head_dim))
        v = B.reshape(B.matmul(x, w.v, w.v_bias), (n, p.kv_heads, p.head_dim))
        q = B.rope(q, batch.positions, layer.rope)
        k = B.rope(k, batch.positions, layer.rope)
        out = B.attention_sinks(q, k, v, kv, i, batch, p.head_dim**-0.5, layer.sinks)
        return B.matmul(out, w.o, w.o_bias)

    def forward(self, batch: Batch, kv: Any) -> Any:
        B, p = self.backend, self.params
        x = B.embed(self.embedding, batch.tokens)
        for i, layer in enumerate(self.layers):
            x = B.add(x, self.attention(B.rms_norm(x, layer.attn_norm, p.norm_eps), layer, i, batch, kv))
            x = B.add(x, B.moe(B.rms_norm(x, layer.ffn_norm, p.norm_eps), layer.experts, self.spec))
        x = B.rms_norm(B.take_rows(x, batch.logit_index), self.output_norm, p.norm_eps)
        return B.matmul(x, self.output)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> GptOssParams:
        layers = overrides.get("layers", 2)
        params = GptOssParams(
            layers=layers,
            width=64,
            heads=4,
            kv_heads=2,
            head_dim=16,
            vocab=300,
            experts=4,
            experts_used=2,
            expert_ffn=32,
            window=8,
            sliding=sliding_layers(layers, 2),
            context=256,
        )
        return dataclasses.replace(params, **overrides)

    @classmethod
    def tensor_shapes(cls, p: GptOssParams) -> dict[str, tuple[int, ...]]:
        shapes = {
            name(T.TOKEN_EMBD): (p.vocab, p.width),
            name(T.OUTPUT_NORM): (p.width,),
            name(T.OUTPUT): (p.vocab, p.width),
        }
        q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
        for i in range(p.layers):
            shapes |= {
                name(T.ATTN_NORM, i): (p.width,),
                name(T.ATTN_Q, i): (q, p.width),
                name(T.ATTN_Q, i, "bias"): (q,),
                name(T.ATTN_K, i): (kv, p.width),
                name(T.ATTN_K, i, "bias"): (kv,),
                name(T.ATTN_V, i): (kv, p.width),
                name(T.ATTN_V, i, "bias"): (kv,),
                name(T.ATTN_OUT, i): (p.width, q),
                name(T.ATTN_OUT, i, "bias"): (p.width,),
                name(T.ATTN_SINKS, i): (p.heads,),
                name(T.ATTN_POST_NORM, i): (p.width,),
            }
            shapes |= moe.moe_shapes(i, p.width, p.expert_ffn, p.experts, biases=True)
        return shapes

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, p: GptOssParams) -> None:
        writer.add_block_count(p.layers)
        writer.add_context_length(p.context)
        writer.add_embedding_length(p.width)
        writer.add_feed_forward_length(p.expert_ffn)
        writer.add_head_count(p.heads)
        writer.add_head_count_kv(p.kv_heads)
        writer.add_key_length(p.head_dim)
        writer.add_value_length(p.head_dim)
        writer.add_rope_dimension_count(p.head_dim)
        writer.add_layer_norm_rms_eps(p.norm_eps)
        writer.add_rope_freq_base(p.rope_base)
        if p.rope_base_swa is not None:
            writer.add_rope_freq_base_swa(p.rope_base_swa)
        if p.yarn_factor:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(p.yarn_factor)
            writer.add_rope_scaling_orig_ctx_len(p.yarn_context)
        writer.add_sliding_window(p.window)
        if p.sliding != sliding_layers(p.layers, 2):
            writer.add_sliding_window_pattern(list(p.sliding))
        writer.add_expert_count(p.experts)
        writer.add_expert_used_count(p.experts_used)
        writer.add_expert_feed_forward_length(p.expert_ffn)
        writer.add_vocab_size(p.vocab)
