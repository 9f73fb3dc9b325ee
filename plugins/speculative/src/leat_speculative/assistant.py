"""An assistant drafter: a small model that drafts from the target's hidden state and the keys and values of some of
the target's layers (Gemma 4's assistant, ``gemma4-assistant``: leat-arch-gemma4 has both sides).

What the two architectures provide (beyond the contract, between a family and its drafter): the target's
``forward_shared_kv(batch, kv)``, ``forward_hidden``'s logits and states with the keys and values, as the cache holds
them, of every position of the batch in the layers the drafter reads; the drafter's ``shared_kv_layouts(target)``, the
KV layouts of a copy of those layers (a :class:`~leat.errors.LeatError` saying why where it does not draft for the
target), and its ``draft(token, hidden, position, target, kv, last)``, one draft step at ``position`` over that copy
(``last``: each layer's keys and values at the position before, written again as the attention op reads), returning
its logits and next hidden state.

A proposer sees no cache of the engine's, so it keeps the copy per request: its target step (:meth:`forward_hidden`)
keeps the layers' keys and values, and :meth:`observe` takes each speculating row's positions with the target's
states. At the next proposal, the positions before the request's last token (past it lie a rejected draft's) are
written into the request's copy, and the drafter drafts from the last token paired with the target's state at the
position before it, each further token from its own state, as llama.cpp's ``draft-mtp`` does with a shared KV.
Positions the target never ran in this engine (a prefix taken from the cache) are never copied and read as zeros,
which costs acceptance, never correctness: every draft is verified by the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from leat.batch import Batch, Row
from leat.errors import LeatError

from leat_speculative.mtp import OwnCache, _Span
from leat_speculative.proposers import draft_model


class Assistant(OwnCache):
    """Drafts greedily with an assistant model: ``--speculate assistant --draft FILE``."""

    name = "assistant"
    what = "the assistant's copy of the target's KV"

    def __init__(self, model: Any, draft: Any = None, **options: Any):
        super().__init__(model)
        missing = "the assistant proposer needs the assistant model: --speculate assistant --draft FILE"
        draft = draft_model(model, draft, missing)
        target, assistant = model.architecture, draft.architecture
        if not hasattr(assistant, "shared_kv_layouts"):
            raise LeatError(f"{draft.file.path.name} ({draft.file.architecture}) is not an assistant drafter")
        if not hasattr(target, "forward_shared_kv"):
            raise LeatError(
                f"--speculate assistant drafts for a model that shares its KV with an assistant (gemma4); "
                f"{model.file.path.name} is {model.file.architecture}"
            )
        self.layouts = assistant.shared_kv_layouts(target)
        self.draft, self.target, self.assistant = draft, target, assistant
        self._shared: list[tuple[Any, Any]] = []  # the last target step's shared K/V, every position of its batch

    def forward_hidden(self, batch: Batch, kv: Any) -> tuple[Any, Any]:
        logits, hidden, self._shared = self.target.forward_shared_kv(batch, kv)
        return logits, hidden

    def observe(self, key: int, start: int, tokens: np.ndarray, hidden: Any, at: int = 0) -> None:
        rows = at + np.arange(len(tokens))
        shared = [(self.backend.take_rows(k, rows), self.backend.take_rows(v, rows)) for k, v in self._shared]
        self._state(key, start + len(tokens)).spans.append(_Span(start, np.asarray(tokens), hidden, shared))

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        state = self.states.get(key)
        if state is None:
            return []
        B, last = self.backend, len(tokens) - 1  # the request's last token, not yet run by the target
        hidden = None
        for span in state.spans:
            kept = min(len(span.tokens), last - span.start)  # a verified row's positions past the last are rejected
            if kept <= 0:
                continue
            rows, write = np.arange(kept), Batch([Row(0, span.start, np.zeros(kept, np.int64))])
            for layer, (k_all, v_all) in enumerate(span.kv):
                keys, values = B.take_rows(k_all, rows), B.take_rows(v_all, rows)
                B.attention(B.scale(keys, 0.0), keys, values, state.kv, layer, write, 1.0)  # writes; reads nothing
            if span.start + kept == last:
                hidden = B.take_rows(span.hidden, rows[-1:])
                state.last = [
                    (B.take_rows(k_all, rows[-1:]), B.take_rows(v_all, rows[-1:])) for k_all, v_all in span.kv
                ]
        state.spans = []
        if hidden is None:  # the target's state before the last token is not known here
            return []
        draft: list[int] = []
        token = int(tokens[-1])
        while len(draft) < k:
            logits, hidden = self.assistant.draft(token, hidden, last, self.target, state.kv, state.last)
            token = int(B.argmax(logits)[-1])
            draft.append(token)
        return draft
