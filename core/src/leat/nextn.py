"""Multi-token-prediction ("nextn") layers: the block a DeepSeek-V3-style file appends after its decoder layers.

As llama.cpp's MTP graphs compute it (``graph_mtp`` in src/models/deepseek2.cpp and glm4-moe.cpp): at position p
the block reads token x_p and a final-normed hidden state h from the position before (the target model's, or the
block's own while it drafts further), forms ``eh_proj @ [rms_norm(embed(x_p)) * enorm ; rms_norm(h) * hnorm]``
(the token half first), runs one decoder layer of the family on that with a KV cache of its own, and normalizes
with ``shared_head_norm``: its hidden state. ``shared_head_head`` of that is its logits, a guess at x_{p+1}. Files
without ``embed_tokens``, ``shared_head_norm`` or ``shared_head_head`` use the model's embedding, output norm and
output matrix. A forward pass of the model never runs these layers; their weights load when a proposer first asks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from leat.architecture import Weights
from leat.backend import Backend
from leat.batch import Batch
from leat.blocks import layer_tensor

T = gguf.MODEL_TENSOR


@dataclass
class NextNWeights:
    from_token: Any  # eh_proj's columns that multiply the normed token embedding [width, width]
    from_hidden: Any  # eh_proj's columns that multiply the normed hidden state [width, width]
    enorm: Any
    hnorm: Any
    embedding: Any
    head_norm: Any
    head: Any


class Unloaded:
    """Weights for layers a forward pass never runs: each tensor counts as consumed and is not uploaded (a test
    file's description still records it)."""

    def __init__(self, weights: Weights):
        self.weights = weights

    def __call__(self, tensor: str, shape: tuple[int, ...] | None = None, optional: bool = False) -> None:
        if self.weights.has(tensor):
            self.weights.used.add(tensor)
        else:
            self.weights(tensor, shape, optional)  # records it, or names it as missing from a real file

    def has(self, tensor: str) -> bool:
        return self.weights.has(tensor)

    def rows(self, tensor: str, shape: tuple[int, ...], rows: Any) -> None:
        self(tensor, shape)

    def host(self, tensor: str, shape: tuple[int, ...]) -> np.ndarray:
        self(tensor, shape)
        return np.zeros(shape, np.float32)

    def array(self, tensor: str, values: Any) -> None:
        return None


def skip_nextn(w: Weights, layer: int, width: int) -> None:
    """Account for layer ``layer``'s nextn tensors without uploading them (the decoder layer's own are the family's)."""
    unloaded = Unloaded(w)
    for kind, shape in {T.NEXTN_EH_PROJ: (width, 2 * width), T.NEXTN_ENORM: (width,), T.NEXTN_HNORM: (width,)}.items():
        unloaded(layer_tensor(kind, layer), shape)
    for kind in (T.NEXTN_EMBED_TOKENS, T.NEXTN_SHARED_HEAD_HEAD, T.NEXTN_SHARED_HEAD_NORM):
        if w.has(layer_tensor(kind, layer)):
            unloaded(layer_tensor(kind, layer))


def load_nextn(w: Weights, layer: int, width: int, embedding: Any, output_norm: Any, output: Any) -> NextNWeights:
    """Layer ``layer``'s nextn weights, uploaded; the model's ``embedding``, ``output_norm`` and ``output`` where the
    file shares them."""
    eh = layer_tensor(T.NEXTN_EH_PROJ, layer)

    def own(kind: gguf.MODEL_TENSOR, shared: Any) -> Any:
        return w(layer_tensor(kind, layer)) if w.has(layer_tensor(kind, layer)) else shared

    return NextNWeights(
        w.columns(eh, (width, 2 * width), 0, width),
        w.columns(eh, (width, 2 * width), width, 2 * width),
        w(layer_tensor(T.NEXTN_ENORM, layer), (width,)),
        w(layer_tensor(T.NEXTN_HNORM, layer), (width,)),
        own(T.NEXTN_EMBED_TOKENS, embedding),
        own(T.NEXTN_SHARED_HEAD_NORM, output_norm),
        own(T.NEXTN_SHARED_HEAD_HEAD, output),
    )


def nextn_input(B: Backend, w: NextNWeights, tokens: Any, hidden: Any, eps: float) -> Any:
    """``eh_proj @ [rms_norm(embed(tokens)) * enorm ; rms_norm(hidden) * hnorm]``: [n, width]."""
    e = B.rms_norm(B.embed(w.embedding, tokens), w.enorm, eps)
    return B.add(B.matmul(e, w.from_token), B.matmul(B.rms_norm(hidden, w.hnorm, eps), w.from_hidden))


def nextn_forward(
    B: Backend, w: NextNWeights, batch: Batch, hidden: Any, layer: Callable[[Any], Any], eps: float
) -> tuple[Any, Any]:
    """The block on ``batch`` with ``layer`` (the family's decoder layer, x -> x) in between: logits and hidden states
    of the rows ``batch.logit_index`` picks."""
    x = layer(nextn_input(B, w, batch.tokens, hidden, eps))
    h = B.rms_norm(B.take_rows(x, batch.logit_index), w.head_norm, eps)
    return B.matmul(h, w.head), h


class WithNextN:
    """:meth:`~leat.architecture.Architecture.forward_hidden` and :meth:`~leat.architecture.Architecture.nextn` for an
    architecture that has ``trunk(batch, kv)`` (its decoder layers on the embedded batch: [n, width] before the final
    norm), ``block(x, layer, batch, kv, index)`` (one decoder layer), ``load_layer(w, index)``, ``embedding``,
    ``output_norm`` and ``output``, and hyperparameters ``trunk`` (the layers before the nextn ones), ``width`` and
    ``norm_eps``; its ``load_weights`` sets ``_nextn`` to None."""

    backend: Backend
    params: Any
    file: Any
    embedding: Any
    output_norm: Any
    output: Any
    _nextn: tuple[Any, NextNWeights] | None

    def trunk(self, batch: Batch, kv: Any) -> Any:
        raise NotImplementedError

    def block(self, x: Any, layer: Any, batch: Batch, kv: Any, index: int) -> Any:
        raise NotImplementedError

    def load_layer(self, w: Any, index: int) -> Any:
        raise NotImplementedError

    def forward_hidden(self, batch: Batch, kv: Any) -> tuple[Any, Any]:
        B = self.backend
        h = B.rms_norm(self.trunk(batch, kv), self.output_norm, self.params.norm_eps)
        return B.matmul(B.take_rows(h, batch.logit_index), self.output), h

    def nextn(self, batch: Batch, hidden: Any, kv: Any) -> tuple[Any, Any]:
        p = self.params
        if self._nextn is None:
            w = Weights(self.file, self.backend)
            head = load_nextn(w, p.trunk, p.width, self.embedding, self.output_norm, self.output)
            self._nextn = (self.load_layer(w, p.trunk), head)
        layer, head = self._nextn
        return nextn_forward(
            self.backend, head, batch, hidden, lambda x: self.block(x, layer, batch, kv, 0), p.norm_eps
        )
