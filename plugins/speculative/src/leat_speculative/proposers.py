"""Two proposers: prompt lookup (an n-gram match in the request's own tokens) and a small draft model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.speculative import Proposer

PREFILL_CHUNK = 512


@dataclass
class _Index:
    """Where each n-gram of a request's tokens last ended, for n in the proposer's range."""

    last: dict[tuple[int, ...], int] = field(default_factory=dict)
    upto: int = 0  # n-grams ending before this position are indexed


class PromptLookup(Proposer):
    """Finds the longest recent n-gram (``max_n`` down to ``min_n`` tokens) that ends the sequence
    earlier in its prompt or output, and proposes what followed it there. No model runs."""

    name = "ngram"

    def __init__(self, model: Any = None, max_n: int = 4, min_n: int = 2, **options: Any):
        super().__init__(model)
        self.max_n, self.min_n = max_n, min_n
        self.indexes: dict[int, _Index] = {}

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        index = self.indexes.setdefault(key, _Index())
        end = len(tokens)
        # index every n-gram that ends before the sequence's own end, later ones overwriting earlier
        for stop in range(max(index.upto, self.min_n), end):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                index.last[tuple(tokens[stop - n : stop])] = stop
        index.upto = max(index.upto, end)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = index.last.get(tuple(tokens[end - n :]))
            if at is not None:
                # copy forward from the match; one that overlaps the end repeats its period (a run, a cycle)
                out: list[int] = []
                while len(out) < k:
                    out.append(tokens[at] if at < end else out[at - end])
                    at += 1
                return out
        return []

    def forget(self, key: int) -> None:
        self.indexes.pop(key, None)


@dataclass
class _DraftState:
    kv: Any
    capacity: int
    cached: list[int] = field(default_factory=list)  # tokens whose K/V the draft KV holds, from position 0


class DraftModel(Proposer):
    """A second, smaller model with the same vocabulary proposes greedily, with its own KV per request.

    ``draft`` is a loaded :class:`leat.model.Model` or anything ``leat.load`` takes (loaded on the
    target's backend and precision). Each proposal first feeds the draft what it has not seen yet
    (K/V past the common prefix are simply overwritten), then decodes ``k`` tokens one at a time.
    """

    name = "draft"

    def __init__(self, model: Any, draft: Any = None, **options: Any):
        super().__init__(model)
        draft = draft_model(model, draft, "the draft proposer needs a draft model: --draft MODEL")
        target_vocab = model.file.metadata.get(gguf.Keys.Tokenizer.LIST)
        draft_vocab = draft.file.metadata.get(gguf.Keys.Tokenizer.LIST)
        if target_vocab is None or list(target_vocab) != list(draft_vocab or ()):
            raise LeatError(
                f"the draft model {draft.file.path.name} has a different vocabulary "
                f"({len(draft_vocab or ())} tokens) from the target's ({len(target_vocab or ())}); "
                f"choose a draft of the same model family"
            )
        if draft.architecture.recurrent:
            raise LeatError(
                f"the draft model {draft.file.path.name} keeps a recurrent state, which cannot rewind to the common "
                f"prefix of its next proposal; choose a draft without one, or --speculate ngram"
            )
        self.draft = draft
        self.states: dict[int, _DraftState] = {}

    def _state(self, key: int, need: int) -> _DraftState:
        state = self.states.get(key)
        if state is None or state.capacity < need:
            capacity = min(max(256, 1 << (need - 1).bit_length()), self.draft.context_length)
            if capacity < need:
                raise LeatError(f"the draft model's context ({self.draft.context_length}) is shorter than {need}")
            state = self.states[key] = _DraftState(self.draft.new_kv(capacity), capacity)
        return state

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        if len(tokens) + k > self.draft.context_length:
            return []
        state = self._state(key, len(tokens) + k)
        same = 0
        for a, b in zip(state.cached, tokens):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)  # the last token is always fed, for the logits after it
        feed = list(tokens[same:])
        state.cached = list(tokens[:same])
        out: list[int] = []
        while len(out) < k:
            logits = None
            for start in range(0, len(feed), PREFILL_CHUNK):
                chunk = np.asarray(feed[start : start + PREFILL_CHUNK], dtype=np.int64)
                batch = Batch([Row(0, len(state.cached), chunk)])
                logits = self.draft.backend.to_host(self.draft.architecture.forward(batch, state.kv))
                state.cached.extend(int(t) for t in chunk)
            token = int(np.argmax(logits[-1]))
            out.append(token)
            feed = [token]
        return out

    def forget(self, key: int) -> None:
        self.states.pop(key, None)


def draft_model(model: Any, draft: Any, missing: str) -> Any:
    """``draft`` (a loaded model, or anything ``leat.load`` takes: loaded on ``model``'s backend and precision); a
    :class:`~leat.errors.LeatError` saying ``missing`` where there is none."""
    if draft is None:
        raise LeatError(missing)
    if isinstance(draft, str):
        from leat.model import load

        draft = load(draft, backend=model.backend.name, precision=model.backend.precision)
    return draft
