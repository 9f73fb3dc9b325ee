"""Gemma 4's assistant drafter (``gemma4-assistant``): a small model that drafts for a Gemma 4 target from the target's
own hidden state and KV cache.

As llama.cpp's src/models/gemma4-assistant.cpp computes it, for token x_p at position p and h, the target's
final-normed hidden state after x_{p-1} (``embedding_length_out`` wide, the target's width):

* ``cur = nextn.pre_projection @ [embed_target(x_p) * sqrt(width_out) ; h]``: the token's row of the *target's*
  embedding first.
* Each layer is Gemma 4's post-normed GeGLU block whose attention has queries only (q RMS-normed per head, NEOX RoPE
  at p, full layers dividing their frequencies by ``rope_freqs``, scores unscaled): sliding layers read the keys and
  values of the target's last sliding layer, full layers those of its last full layer (the layers they share their
  KV with), at the positions before p; ``layer_output_scale`` multiplies each layer's output.
* ``rms_norm(cur) * output_norm`` times the assistant's own ``token_embd`` gives its logits (no soft-capping), a
  guess at x_{p+1}; ``nextn.post_projection`` of it is the next h. Every further draft token is read at the same
  position p with that h (llama.cpp's ``draft-mtp`` with a shared KV).

``masked_embd_centroids`` / ``masked_embd_ordering``, where a file has them, are not used (nor are they by llama.cpp).
leat-speculative's ``assistant`` proposer drafts with it (``--speculate assistant --draft FILE``), keeping a copy
per request of the two target layers it reads (:meth:`Gemma4Assistant.shared_kv_layouts`, from
:meth:`leat_arch_gemma4.gemma4.Gemma4.forward_shared_kv`).
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
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.errors import LeatError, ModelFileError
from leat.hparams import key
from leat.modelfile import ModelFile
from leat.nextn import Unloaded

from leat_arch_gemma4.gemma4 import Gemma4, Gemma4Params, check_pattern, feed_forward, layer_ropes, load_layer

K = gguf.Keys
T = gguf.MODEL_TENSOR
name = blocks.layer_tensor
# llama.cpp's names (src/llama-arch.cpp), which gguf-py 0.19 does not export yet
PRE_PROJECTION, POST_PROJECTION = "nextn.pre_projection.weight", "nextn.post_projection.weight"
UNUSED = ("masked_embd_centroids.weight", "masked_embd_ordering")


@dataclass(frozen=True, kw_only=True)
class AssistantParams(Gemma4Params):
    """Gemma 4's keys, and the target's width (the hidden state read and written)."""

    width_out: int = key(K.LLM.EMBEDDING_LENGTH_OUT)
    nextn_layers: int = key(K.LLM.NEXTN_PREDICT_LAYERS, missing=lambda v: v["layers"])

    @property
    def kv_layers(self) -> int:
        return 0  # every layer reads the target's KV


class Gemma4Assistant(Architecture):
    names = ("gemma4-assistant",)
    Params = AssistantParams
    drafts_only = True

    @classmethod
    def read_params(cls, file: ModelFile) -> AssistantParams:
        p = check_pattern(file, super().read_params(file))
        if p.width_out == p.width:
            raise ModelFileError(f"{file.path}: a Gemma 4 assistant's embedding_length_out is its target's width")
        return p

    @classmethod
    def kv_layouts(cls, p: AssistantParams) -> list[KVLayout]:
        # it reads its target's KV: this one layer is never written, and only lets an engine be made for the file,
        # whose forward then says what the file is for
        return [KVLayout(1, p.head_dim)]

    def load_weights(self, w: Weights) -> None:
        p = self.params
        self.embedding = w(name(T.TOKEN_EMBD), (p.vocab, p.width))
        self.output_norm = w(name(T.OUTPUT_NORM), (p.width,))
        for tensor in UNUSED:
            if w.has(tensor):
                Unloaded(w)(tensor)
        pre = (p.width, 2 * p.width_out)
        self.from_token = w.columns(PRE_PROJECTION, pre, 0, p.width_out)
        self.from_hidden = w.columns(PRE_PROJECTION, pre, p.width_out, 2 * p.width_out)
        self.post_projection = w(POST_PROJECTION, (p.width_out, p.width))
        self.ropes = layer_ropes(w, p)
        self.layers = [load_layer(w, p, i) for i in range(p.layers)]

    def forward(self, batch: Batch, kv: Any) -> Any:
        raise LeatError(
            f"{self.file.path.name} is a Gemma 4 assistant (gemma4-assistant): it drafts for its Gemma 4 target and "
            f"runs no text alone; load the target and pass this file with --speculate assistant --draft FILE"
        )

    def shared_kv_layouts(self, target: Any) -> list[KVLayout]:
        """The layouts of a copy of the target's last sliding layer's KV source, then its last full layer's, which
        this model reads: the sliding one's window one shorter (a query at p reads p - window + 1 .. p - 1 from a row
        at p - 1, :meth:`draft`). A :class:`~leat.errors.LeatError` says why where this model does not fit
        ``target``."""
        if not isinstance(target, Gemma4):
            raise LeatError(f"a Gemma 4 assistant drafts for a Gemma 4 model (gemma4); {target.file.path.name} is not")
        t, a, layouts = target.params, self.params, target.kv_layouts(target.params)
        swa, full = t.kv_source(t.layers - 2), t.kv_source(t.layers - 1)
        problems = [
            f"its embedding_length_out is {a.width_out}, the target's width {t.width}"
            if a.width_out != t.width
            else "",
            f"its vocabulary has {a.vocab} tokens, the target's {t.vocab}" if a.vocab != t.vocab else "",
            "the target's last two layers are not a sliding then a full one" if t.pattern[-2:] != (True, False) else "",
        ]
        for layer, source in ((i, swa if a.pattern[i] else full) for i in range(a.layers)):
            if (a.head_size(layer), a.per(a.kv_heads, layer)) != (layouts[source].head_dim, layouts[source].kv_heads):
                problems.append(f"its layer {layer}'s KV heads are not the target's layer {source}'s")
        if any(problems):
            reasons = "; ".join(problem for problem in problems if problem)
            raise LeatError(f"{self.file.path.name} does not draft for {target.file.path.name}: {reasons}")
        return [dataclasses.replace(layouts[swa], window=a.window - 1), layouts[full]]

    def draft(
        self, token: int, hidden: Any, position: int, target: Any, kv: Any, last: list[tuple[Any, Any]]
    ) -> tuple[Any, Any]:
        """One draft step at ``position``: ``token`` with ``hidden`` [1, width_out] (the target's state after the
        position before, or this model's own from the step before), over the target's keys and values of the
        positions before ``position`` held in ``kv`` (layer 0 its last sliding layer's, layer 1 its last full
        layer's), of which ``last`` holds the position before's pair per layer: the attention op writes the row's
        keys and values as it reads, so that one is written again, unchanged. The token's embedding is ``target``'s.
        Returns the logits [1, vocab] and the next hidden state [1, width_out]."""
        B, p = self.backend, self.params
        x = B.scale(B.embed(target.embedding, np.array([token], np.int64)), math.sqrt(p.width_out))
        cur = B.add(B.matmul(x, self.from_token), B.matmul(hidden, self.from_hidden))
        at, read = np.array([position], np.int64), Batch([Row(0, position - 1, np.zeros(1, np.int64))])
        for i, layer in enumerate(self.layers):
            source, size = 0 if p.pattern[i] else 1, p.head_size(i)
            h = B.rms_norm(cur, layer.attn_norm, p.norm_eps)
            q = B.rms_norm(B.reshape(B.matmul(h, layer.q), (1, p.heads, size)), layer.q_norm, p.norm_eps)
            q = B.rope(q, at, self.ropes[i])
            h = B.matmul(B.attention(q, *last[source], kv, source, read, 1.0), layer.o)
            attended = B.add(B.rms_norm(h, layer.post_attn_norm, p.norm_eps), cur)
            cur = feed_forward(B, attended, layer, p.norm_eps)
            if layer.output_scale is not None:
                cur = B.scale(cur, layer.output_scale)
        out = B.rms_norm(cur, self.output_norm, p.norm_eps)
        return B.matmul(out, self.embedding), B.matmul(out, self.post_projection)

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> AssistantParams:
        """An assistant for :meth:`leat_arch_gemma4.gemma4.Gemma4.tiny` (width 64): 32 wide, a sliding layer (heads
        of 16, window 8) then a full one (heads of 32, proportional RoPE), 4 query heads over the target's 2 and 1 KV
        heads there, MLPs 64 wide."""
        params = AssistantParams(
            layers=2, width=32, ffn=64, heads=4, kv_heads=(2, 1), head_dim=32, head_dim_swa=16, rope_dims=32,
            rope_dims_swa=16, rope_base=1e6, rope_base_swa=10000.0, window=8, pattern=(True, False), vocab=300,
            context=256, output_scale=True, separate_v=False, width_out=64, nextn_layers=2,
        )  # fmt: skip
        return dataclasses.replace(params, **overrides)
