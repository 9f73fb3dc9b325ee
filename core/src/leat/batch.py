"""A forward pass's input: spans of tokens from several sequences, decoded together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Row:
    """One sequence's span in a batch: its KV slot, the position of its first token, the tokens.

    A decode step is a span of one token, a prefill chunk a span of many; ``all_logits`` asks for
    the logits of every position of the span instead of only the last. ``bidirectional``: each query of the span
    also sees the span's later positions (an image's span, an encoder's patches; see ``Backend.attention``).
    ``inputs``: a backend array [len(tokens), width] that replaces the token embeddings (an image's embeddings;
    its ``tokens`` are then placeholders); such a row is its batch's only row.
    """

    slot: int
    start: int
    tokens: np.ndarray
    all_logits: bool = False
    bidirectional: bool = False
    inputs: Any = None


class Batch:
    """Rows concatenated: ``tokens`` and ``positions`` are [n]; ``logit_index`` picks the output rows; ``inputs``
    is the only row's ``inputs`` (None: embed ``tokens``)."""

    def __init__(self, rows: list[Row]):
        if len(rows) > 1 and any(r.inputs is not None for r in rows):
            raise ValueError("a row with input embeddings must be its batch's only row")
        self.rows = rows
        self.inputs = rows[0].inputs if rows else None
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
