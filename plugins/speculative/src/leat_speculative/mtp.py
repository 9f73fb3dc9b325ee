"""Multi-token prediction: the target model's own nextn layer drafts (:mod:`leat.nextn`).

The layer at position p reads token x_p and the target's final-normed hidden state after x_{p-1}, so it follows
the target one position behind, with a KV cache of its own per request. The engine hands over the target's states
of every row it runs (:meth:`observe`); at the next proposal, the positions before the request's last token (a
rejected draft's states lie past it) are fed to the layer as pairs (x_{p+1}, h_p), the last of which, at the
request's last token, gives the first draft token. Each further draft token is the layer's guess from its own
hidden state, one position on, as llama.cpp's ``draft-mtp`` does. Position 0 has no state before it: the layer sees
zeros there, as llama.cpp's does. Positions the target never ran in this engine (a prefix taken from the cache) are
never fed; the layer's attention then reads empty KV there, which costs acceptance, never correctness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from leat.architecture import Architecture
from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.speculative import Proposer


@dataclass
class _Span:
    start: int
    tokens: np.ndarray
    hidden: Any  # the target's states at positions start, start + 1, ...
    kv: list[tuple[Any, Any]] = field(default_factory=list)  # what else of the target's step a proposer keeps there


@dataclass
class _State:
    kv: Any
    capacity: int
    spans: list[_Span] = field(default_factory=list)  # observed since the last proposal
    last: list[tuple[Any, Any]] = field(default_factory=list)


class OwnCache(Proposer):
    """A proposer that reads the target's states and keeps a KV cache of ``layouts`` per request."""

    reads_hidden = True
    layouts: list[Any]
    what = "the drafter's context"

    def __init__(self, model: Any, **options: Any):
        super().__init__(model)
        self.backend = model.backend
        self.states: dict[int, _State] = {}

    def _state(self, key: int, need: int) -> _State:
        """The request's state, its KV holding at least ``need`` positions (grown by copying its pages)."""
        state = self.states.get(key)
        if state is not None and state.capacity >= need:
            return state
        context = self.model.context_length
        if need > context:
            raise LeatError(f"{self.what} ({context}) is shorter than {need}")
        capacity = min(max(256, 1 << (need - 1).bit_length()), context)
        kv = self.backend.allocate_kv(self.layouts, 1, capacity)
        if state is None:
            state = self.states[key] = _State(kv, capacity)
        else:
            pages = list(range(state.kv.page_table.shape[1]))
            self.backend.write_pages(kv, pages, self.backend.read_pages(state.kv, pages))
            state.kv, state.capacity = kv, capacity
        return state

    def forget(self, key: int) -> None:
        self.states.pop(key, None)


class MultiTokenPrediction(OwnCache):
    """Drafts greedily with the model's multi-token-prediction layer (files that keep ``nextn_predict_layers``)."""

    name = "mtp"
    what = "the multi-token-prediction layer's context"

    def __init__(self, model: Any, **options: Any):
        super().__init__(model)
        architecture = model.architecture
        family = type(architecture)
        if family.forward_hidden is Architecture.forward_hidden or not architecture.nextn_kv_layouts():
            raise LeatError(
                f"{model.file.path.name} ({model.file.architecture}) has no multi-token-prediction layer that leat runs: "
                f"--speculate mtp needs a file converted with its nextn layers (nextn_predict_layers > 0) of a family "
                f"that drafts with them; use --speculate ngram or --draft MODEL instead"
            )
        self.architecture = architecture
        self.layouts = architecture.nextn_kv_layouts()

    def observe(self, key: int, start: int, tokens: np.ndarray, hidden: Any, at: int = 0) -> None:
        self._state(key, start + len(tokens)).spans.append(_Span(start, np.asarray(tokens), hidden))

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        state = self.states.get(key)
        if state is None:
            return []
        last = len(tokens) - 1  # the request's last token, not yet run by the target: the first draft's pair
        state = self._state(key, last + k)
        B, ids = self.backend, np.asarray(tokens, dtype=np.int64)
        out = None
        for span in state.spans:
            # a verified row's states are the request's up to its last token: past that lie rejected drafts
            kept = min(len(span.tokens), last - span.start)
            if kept == 0:
                continue
            if span.start == 0:  # x_0 has no state before it
                zeros = B.scale(B.take_rows(span.hidden, np.zeros(1, np.int64)), 0.0)
                self.architecture.nextn(Batch([Row(0, 0, ids[:1])]), zeros, state.kv)
            hidden = B.take_rows(span.hidden, np.arange(kept))
            row = Row(0, span.start + 1, ids[span.start + 1 : span.start + 1 + kept])
            result = self.architecture.nextn(Batch([row]), hidden, state.kv)
            out = result if span.start + kept == last else None
        state.spans = []
        if out is None:  # the target's state before the last token is not known here
            return []
        draft: list[int] = []
        while True:
            logits, hidden = out
            draft.append(int(B.argmax(logits)[-1]))
            if len(draft) == k:
                return draft
            row = Row(0, last + len(draft), np.asarray(draft[-1:], dtype=np.int64))
            out = self.architecture.nextn(Batch([row]), hidden, state.kv)
