"""A forward pass's input: spans of tokens from several sequences, decoded together."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Row:
    """One sequence's span in a batch: its KV slot, the position of its first token, the tokens.

    A decode step is a span of one token, a prefill chunk a span of many; ``all_logits`` asks for
    the logits of every position of the span instead of only the last.
    """

    slot: int
    start: int
    tokens: np.ndarray
    all_logits: bool = False


class Batch:
    """Rows concatenated: ``tokens`` and ``positions`` are [n]; ``logit_index`` picks the output rows."""

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self.tokens = np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in rows])
        self.positions = np.concatenate([r.start + np.arange(len(r.tokens)) for r in rows])
        self.offsets = np.cumsum([0] + [len(r.tokens) for r in rows])
        picks = []
        for row, offset in zip(rows, self.offsets):
            n = len(row.tokens)
            picks.append(np.arange(offset, offset + n) if row.all_logits else np.array([offset + n - 1]))
        self.logit_index = np.concatenate(picks)

    def __len__(self) -> int:
        return len(self.tokens)
