"""The ``assistant`` proposer: a Gemma 4 assistant (:mod:`leat_arch_gemma4.assistant`) drafts for its Gemma 4 target.

The assistant reads the target's keys and values of two layers, which live in the engine's paged cache; a proposer
sees no cache of the engine's, so it keeps a copy of those two layers per request: its target step
(:meth:`Assistant.forward_hidden`) keeps them from the target's forward, and :meth:`observe` takes each speculating
row's positions with the target's hidden states. At the next proposal, the positions before the request's last token
(past it lie a rejected draft's) are written into the request's copy, and the assistant drafts from the last token
paired with the target's state at the position before it, each further token from its own state at the same
position, as llama.cpp's ``draft-mtp`` does with a shared KV. The copy's sliding layer has a window one shorter than
the target's: the assistant's query at p sees positions p - window + 1 .. p - 1, and the attention op reads from the
row's own position p - 1. Positions the target never ran in this engine (a prefix taken from the cache) are never
copied and read as zeros, which costs acceptance, never correctness: every draft is verified by the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.speculative import Proposer

from leat_arch_gemma4.assistant import Gemma4Assistant
from leat_arch_gemma4.gemma4 import Gemma4


@dataclass
class _Span:
    start: int
    length: int
    hidden: Any  # the target's states at positions start, start + 1, ...
    kv: list[tuple[Any, Any]]  # the two shared layers' keys and values there


@dataclass
class _State:
    kv: Any
    capacity: int
    spans: list[_Span] = field(default_factory=list)  # observed since the last proposal
    last: list[tuple[Any, Any]] = field(default_factory=list)  # each layer's K/V at the position before the last token


class Assistant(Proposer):
    """Drafts greedily with a Gemma 4 assistant: ``--speculate assistant --draft FILE``."""

    name = "assistant"
    reads_hidden = True

    def __init__(self, model: Any, draft: Any = None, **options: Any):
        super().__init__(model)
        if draft is None:
            raise LeatError("the assistant proposer needs the assistant model: --speculate assistant --draft FILE")
        if isinstance(draft, str):
            from leat.model import load

            draft = load(draft, backend=model.backend.name, precision=model.backend.precision)
        target, assistant = model.architecture, draft.architecture
        if not isinstance(target, Gemma4):
            raise LeatError(
                f"--speculate assistant drafts for a Gemma 4 model (gemma4); {model.file.path.name} is "
                f"{model.file.architecture}"
            )
        if not isinstance(assistant, Gemma4Assistant):
            raise LeatError(
                f"{draft.file.path.name} ({draft.file.architecture}) is not a Gemma 4 assistant (gemma4-assistant)"
            )
        t, a = target.params, assistant.params
        swa, full = t.kv_source(t.layers - 2), t.kv_source(t.layers - 1)
        problems = [
            f"its embedding_length_out is {a.width_out}, the target's width {t.width}"
            if a.width_out != t.width
            else "",
            f"its vocabulary has {a.vocab} tokens, the target's {t.vocab}" if a.vocab != t.vocab else "",
            "the target's last two layers are not a sliding then a full one" if t.pattern[-2:] != (True, False) else "",
        ]
        layouts = target.kv_layouts(t)
        for layer, source in ((i, swa if a.pattern[i] else full) for i in range(a.layers)):
            if (a.head_size(layer), a.per(a.kv_heads, layer)) != (layouts[source].head_dim, layouts[source].kv_heads):
                problems.append(f"its layer {layer}'s KV heads are not the target's layer {source}'s")
        problems = [problem for problem in problems if problem]
        if problems:
            raise LeatError(f"{draft.file.path.name} does not draft for {model.file.path.name}: {'; '.join(problems)}")
        self.draft, self.target, self.assistant = draft, target, assistant
        self.layouts = [dataclasses.replace(layouts[swa], window=a.window - 1), layouts[full]]
        self.states: dict[int, _State] = {}
        self._shared: list[tuple[Any, Any]] = []  # the last target step's shared K/V, every position of its batch

    def forward_hidden(self, batch: Batch, kv: Any) -> tuple[Any, Any]:
        logits, hidden, self._shared = self.target.forward_shared_kv(batch, kv)
        return logits, hidden

    def _state(self, key: int, need: int) -> _State:
        """The request's state, its copy holding at least ``need`` positions (grown by copying its pages)."""
        state = self.states.get(key)
        if state is not None and state.capacity >= need:
            return state
        context = self.model.context_length
        if need > context:
            raise LeatError(f"the assistant's copy of the target's KV ({context} positions) is shorter than {need}")
        capacity = min(max(256, 1 << (need - 1).bit_length()), context)
        kv = self.backend.allocate_kv(self.layouts, 1, capacity)
        if state is None:
            state = self.states[key] = _State(kv, capacity)
        else:
            pages = list(range(state.kv.page_table.shape[1]))
            self.backend.write_pages(kv, pages, self.backend.read_pages(state.kv, pages))
            state.kv, state.capacity = kv, capacity
        return state

    @property
    def backend(self) -> Any:
        return self.model.backend

    def observe(self, key: int, start: int, tokens: np.ndarray, hidden: Any, at: int = 0) -> None:
        rows = at + np.arange(len(tokens))
        shared = [(self.backend.take_rows(k, rows), self.backend.take_rows(v, rows)) for k, v in self._shared]
        self._state(key, start + len(tokens)).spans.append(_Span(start, len(tokens), hidden, shared))

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        state = self.states.get(key)
        if state is None:
            return []
        B, last = self.backend, len(tokens) - 1  # the request's last token, not yet run by the target
        hidden = None
        for span in state.spans:
            kept = min(span.length, last - span.start)  # a verified row's positions past the last are rejected
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
            logits, hidden = self.assistant.draft(token, hidden, last, self.target.embedding, state.kv, state.last)
            token = int(B.argmax(logits)[-1])
            draft.append(token)
        return draft

    def forget(self, key: int) -> None:
        self.states.pop(key, None)
