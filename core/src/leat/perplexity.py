"""Perplexity as llama.cpp's ``llama-perplexity`` computes it, and KL divergence against its ``--kl-divergence-base``.

The text is split into chunks of ``ctx`` tokens; each chunk is evaluated from an empty cache with its first token
replaced by BOS (when the model adds one), and only the second half is scored: positions ``ctx//2 .. ctx-2`` predict
the token after them, so every scored prediction has at least ``ctx//2`` tokens of context.

The KL-base file (``llama-perplexity --kl-divergence-base FILE``; tools/perplexity/perplexity.cpp) is, little-endian::

    char[8]  "_logits_"
    int32    n_ctx
    int32    n_vocab
    int32    n_chunk
    int32    tokens[n_chunk * n_ctx]          (as tokenized; the BOS substitution is not stored)
    then for each chunk, for each scored position (n_ctx - 1 - n_ctx//2 of them), a row of nv = 2*((n_vocab+1)//2) + 4
    uint16: the first 4 are two float32, scale and min_log_prob; then n_vocab uint16 q with
    log p = scale * q + min_log_prob (the range is clipped to 16 below the top logit, q = 0 below it).

KL and top-1 follow llama.cpp's definitions: KL(base || ours) summed over tokens whose base log-prob is above -16,
top-1 agreement comparing the two argmaxes.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from leat.errors import LeatError

MAGIC = b"_logits_"
ChunkProgress = Callable[[int, int, float], None] | None
"""``progress(chunks_done, chunks, running_perplexity)``, called after each chunk."""


@dataclass
class KlBase:
    n_ctx: int
    n_vocab: int
    tokens: np.ndarray  # [n_chunk, n_ctx] int32
    rows: np.ndarray  # [n_chunk, n_ctx - 1 - n_ctx//2, nv] uint16

    @property
    def n_chunk(self) -> int:
        return self.tokens.shape[0]

    def log_probs(self, chunk: int) -> np.ndarray:
        """The base's log-probabilities for one chunk's scored positions: [positions, n_vocab] float32."""
        rows = self.rows[chunk]
        header = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # [positions, 2]: scale, min_log_prob
        q = rows[:, 4 : 4 + self.n_vocab].astype(np.float32)
        return q * header[:, :1] + header[:, 1:2]


def read_kl_base(path: str | Path) -> KlBase:
    """Read a ``llama-perplexity --kl-divergence-base`` file (gzip-compressed ones too)."""
    path = Path(path)
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    data = gzip.decompress(path.read_bytes()) if gzipped else path.read_bytes()
    if data[:8] != MAGIC:
        raise LeatError(f"{path} is not a llama-perplexity --kl-divergence-base file (it does not start with _logits_)")
    n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(data, "<i4", 3, 8))
    if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
        raise LeatError(f"{path}: implausible header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
    offset = 20
    tokens = np.frombuffer(data, "<i4", n_chunk * n_ctx, offset).reshape(n_chunk, n_ctx)
    offset += 4 * n_chunk * n_ctx
    nv = 2 * ((n_vocab + 1) // 2) + 4
    positions = n_ctx - 1 - n_ctx // 2
    expected = offset + 2 * n_chunk * positions * nv
    if len(data) != expected:
        raise LeatError(f"{path} has {len(data)} bytes; its header (n_ctx {n_ctx}, {n_chunk} chunks) says {expected}")
    rows = np.frombuffer(data, "<u2", n_chunk * positions * nv, offset).reshape(n_chunk, positions, nv)
    return KlBase(n_ctx, n_vocab, tokens, rows)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _chunk_log_probs(model: Any, ids: np.ndarray) -> np.ndarray:
    ids = ids.copy()
    if model.tokenizer.add_bos and model.tokenizer.bos_id is not None:
        ids[0] = model.tokenizer.bos_id
    n_ctx = len(ids)
    return _log_softmax(model.logits(ids)[n_ctx // 2 : n_ctx - 1])


def _summary(nll: list[float]) -> dict[str, float]:
    values = np.asarray(nll)
    mean = float(values.mean())
    # llama.cpp's uncertainty: the standard error of the mean NLL, carried through exp
    stderr = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0
    return {"perplexity": math.exp(mean), "perplexity_stderr": math.exp(mean) * stderr, "mean_nll": mean}


def perplexity(
    model: Any, tokens: list[int] | np.ndarray, ctx: int, chunks: int | None = None, progress: ChunkProgress = None
) -> dict[str, Any]:
    """Perplexity of ``model`` over ``tokens`` in chunks of ``ctx`` tokens, scoring each chunk's second half."""
    tokens = np.asarray(tokens, dtype=np.int64)
    available = len(tokens) // ctx
    if available < 1 or ctx < 4:
        raise LeatError(f"the text has {len(tokens)} tokens: fewer than one chunk of --ctx {ctx}; lower --ctx")
    n_chunk = min(available, chunks) if chunks else available
    nll, per_chunk = [], []
    for c in range(n_chunk):
        ids = tokens[c * ctx : (c + 1) * ctx]
        log_probs = _chunk_log_probs(model, ids)
        targets = ids[ctx // 2 + 1 :]
        nll.extend(-log_probs[np.arange(len(targets)), targets])
        per_chunk.append(math.exp(float(np.mean(nll))))
        if progress:
            progress(c + 1, n_chunk, per_chunk[-1])
    return {"ctx": ctx, "chunks": n_chunk, "tokens_scored": len(nll), "running_perplexity": per_chunk, **_summary(nll)}


def kl_divergence(
    model: Any, base: KlBase, chunks: int | None = None, progress: ChunkProgress = None
) -> dict[str, Any]:
    """Score ``model`` against a KL base: its perplexity on the base's tokens, KL(base || model) and top-1 agreement."""
    vocab = model.architecture.vocab_size
    if vocab != base.n_vocab:
        raise LeatError(f"the KL base was written by a model with {base.n_vocab} tokens; this one has {vocab}")
    n_chunk = min(base.n_chunk, chunks) if chunks else base.n_chunk
    nll, nll_base, kld, same_top = [], [], [], []
    for c in range(n_chunk):
        ids = base.tokens[c].astype(np.int64)
        ours = _chunk_log_probs(model, ids)
        theirs = base.log_probs(c).astype(np.float64)
        targets = ids[base.n_ctx // 2 + 1 :]
        rows = np.arange(len(targets))
        nll.extend(-ours[rows, targets])
        nll_base.extend(-theirs[rows, targets])
        kept = theirs > -16.0  # llama.cpp leaves out tokens whose base log-prob is below -16
        kld.extend(np.where(kept, np.exp(theirs) * (theirs - ours), 0.0).sum(axis=1))
        same_top.extend(ours.argmax(axis=1) == theirs.argmax(axis=1))
        if progress:
            progress(c + 1, n_chunk, math.exp(float(np.mean(nll))))
    kld_values = np.asarray(kld)
    ours_summary = _summary(nll)
    return {
        "ctx": base.n_ctx,
        "chunks": n_chunk,
        "tokens_scored": len(nll),
        **ours_summary,
        "base_perplexity": _summary(nll_base)["perplexity"],
        "kl_divergence_mean": float(kld_values.mean()),
        "kl_divergence_median": float(np.median(kld_values)),
        "kl_divergence_max": float(kld_values.max()),
        "kl_divergence_p99": float(np.percentile(kld_values, 99)),
        "top1_agreement": float(np.mean(same_top)),
    }
