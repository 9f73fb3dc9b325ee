"""Measures of how closely two models' logits agree, teacher-forced over the same token ids.

This is the "what agrees means" of leat's design, used by the llama.cpp agreement tests, the CPU
precision tests and the conformance kit. Every measure compares a *reference* (the side trusted:
llama.cpp, or leat's float64 oracle) with an *other* (the side under test) over ``n`` positions:

* **top-1 agreement**: the fraction of positions where both pick the same most likely token,
  counted only where the reference's top-2 gap (difference of its two largest logits) is at least
  ``min_gap``: where the reference itself is nearly tied, either answer is right.
* **mean KL(ref || other)** over the reference's top-``k`` tokens: the KL divergence between the
  two distributions coarse-grained to those ``k`` tokens plus one bucket holding the rest of the
  vocabulary. Both sides' log-probs are normalized over their *full* vocabulary first. By the data
  processing inequality this is never negative and never more than the full KL; with ``k`` = 64
  it is the full KL to within the tail's share, which is what matters.
* **log-prob error**: over positions, the largest ``|logprob_ref - logprob_other|`` on the
  reference's top-``k`` tokens, divided by the spread (max - min) of the reference's logits at
  that position; a scale-free "how far off is the curve", 0.02 meaning 2% of the logits' range.

The reference may be full logits (``[n, vocab]``) or a compact :class:`TopK` record (top-``k`` ids
and log-probs, top-2 gap and spread per position), which is how large-vocabulary references are
stored. The other side is always full logits. All arithmetic is float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_K = 64
DEFAULT_MIN_GAP = 1e-3
REST_RESOLUTION = 1e-14  # probability masses below this are float64 rounding noise

__all__ = [
    "Agreement",
    "TopK",
    "combine",
    "compare",
    "first_near_tie",
    "kl_per_position",
    "log_softmax",
    "logprob_error",
    "logprob_error_per_position",
    "mean_kl",
    "top1_agreement",
    "top2_gap",
]


def log_softmax(logits: Any, axis: int = -1) -> np.ndarray:
    """Log-probabilities of ``logits`` along ``axis``, in float64 (max-shifted, so no overflow)."""
    x = np.asarray(logits, dtype=np.float64)
    peak = np.max(x, axis=axis, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    shifted = x - peak
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def top2_gap(logits: Any) -> np.ndarray:
    """Per position: the largest logit minus the second largest (``[n]``, float64)."""
    x = np.asarray(logits, dtype=np.float64)
    two = -np.partition(-x, 1, axis=-1)[..., :2]
    return two[..., 0] - two[..., 1]


@dataclass
class TopK:
    """A compact reference: per position, the ``k`` most likely tokens and what the measures need.

    ``ids`` and ``logprobs`` are ``[n, k]``, most likely first, the log-probs normalized over the
    full vocabulary; ``gap`` is the top-2 logit gap and ``spread`` the max - min of the logits, both
    ``[n]`` and over the full vocabulary (a top-``k`` slice cannot give the minimum).
    """

    ids: np.ndarray
    logprobs: np.ndarray
    gap: np.ndarray
    spread: np.ndarray

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float64)
        self.gap = np.asarray(self.gap, dtype=np.float64)
        self.spread = np.asarray(self.spread, dtype=np.float64)
        n = len(self.ids)
        if self.ids.ndim != 2 or self.logprobs.shape != self.ids.shape:
            raise ValueError(f"ids and logprobs must both be [n, k], not {self.ids.shape} and {self.logprobs.shape}")
        if self.gap.shape != (n,) or self.spread.shape != (n,):
            raise ValueError(f"gap and spread must be [{n}], not {self.gap.shape} and {self.spread.shape}")

    @classmethod
    def from_logits(cls, logits: Any, k: int = DEFAULT_K) -> TopK:
        """The top-``k`` record of full logits ``[n, vocab]`` (sorted, most likely first)."""
        x = np.asarray(logits, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"logits must be [n, vocab], not {x.shape}")
        k = min(k, x.shape[1])
        lp = log_softmax(x)
        part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
        # Sort the k by logit, descending; ties broken by token id so the order is deterministic.
        order = np.lexsort((part, -np.take_along_axis(x, part, axis=-1)), axis=-1)
        ids = np.take_along_axis(part, order, axis=-1)
        spread = x.max(axis=-1) - x.min(axis=-1)
        return cls(ids, np.take_along_axis(lp, ids, axis=-1), top2_gap(x), spread)

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def __len__(self) -> int:
        return len(self.ids)

    def arrays(self, prefix: str = "") -> dict[str, np.ndarray]:
        """Compact arrays to store (``np.savez_compressed(**record.arrays())``): int32 ids, float32 values."""
        return {
            f"{prefix}ids": self.ids.astype(np.int32),
            f"{prefix}logprobs": self.logprobs.astype(np.float32),
            f"{prefix}gap": self.gap.astype(np.float32),
            f"{prefix}spread": self.spread.astype(np.float32),
        }

    @classmethod
    def from_arrays(cls, arrays: Any, prefix: str = "") -> TopK:
        """The record :meth:`arrays` stored (``arrays`` may be an ``np.load`` result)."""
        return cls(
            arrays[f"{prefix}ids"], arrays[f"{prefix}logprobs"], arrays[f"{prefix}gap"], arrays[f"{prefix}spread"]
        )


def _as_topk(ref: Any, k: int) -> TopK:
    if isinstance(ref, TopK):
        if ref.k < k:
            raise ValueError(f"the reference keeps the top {ref.k} tokens per position, fewer than the {k} asked for")
        return TopK(ref.ids[:, :k], ref.logprobs[:, :k], ref.gap, ref.spread)
    return TopK.from_logits(ref, k)


def _other(other_logits: Any, n: int) -> np.ndarray:
    x = np.asarray(other_logits, dtype=np.float64)
    if x.ndim != 2 or len(x) != n:
        raise ValueError(f"other logits must be [{n}, vocab], not {x.shape}")
    return x


def top1_agreement(ref: Any, other_logits: Any, min_gap: float = DEFAULT_MIN_GAP) -> tuple[int, int]:
    """``(agreeing, counted)``: positions where both top-1 tokens match, among those counted.

    A position is counted when the reference's top-2 gap is at least ``min_gap``.
    """
    if isinstance(ref, TopK):
        ref_top, gap = ref.ids[:, 0], ref.gap
    else:
        r = np.asarray(ref, dtype=np.float64)
        ref_top, gap = np.argmax(r, axis=-1), top2_gap(r)
    other = _other(other_logits, len(ref_top))
    counted = gap >= min_gap
    agree = (np.argmax(other, axis=-1) == ref_top) & counted
    return int(agree.sum()), int(counted.sum())


def kl_per_position(ref_topk_ids: Any, ref_topk_logprobs: Any, other_logits: Any) -> np.ndarray:
    """KL(ref || other) per position over the reference's top-k tokens plus a "rest" bucket (``[n]``).

    ``ref_topk_logprobs`` are normalized over the reference's full vocabulary; ``other_logits`` are
    full logits and normalized here over their own vocabulary.
    """
    ids = np.asarray(ref_topk_ids, dtype=np.int64)
    lp_ref = np.asarray(ref_topk_logprobs, dtype=np.float64)
    lp_other = np.take_along_axis(log_softmax(_other(other_logits, len(ids))), ids, axis=-1)
    p_ref = np.exp(lp_ref)
    with np.errstate(invalid="ignore"):  # 0 * -inf for tokens the reference gives no mass
        terms = np.where(p_ref > 0, p_ref * (lp_ref - lp_other), 0.0)
    kl = terms.sum(axis=-1)
    # The rest of the vocabulary as one bucket: mass 1 - sum(top-k) on each side. Masses below
    # REST_RESOLUTION are rounding noise (top-k covering the whole vocabulary leaves ~1e-16), so both
    # are floored there: noise against noise adds nothing, and a side that leaves no mass at all where
    # the reference leaves some costs a large but finite amount instead of infinity.
    rest_ref = np.maximum(_rest_mass(lp_ref), REST_RESOLUTION)
    rest_other = np.maximum(_rest_mass(lp_other), REST_RESOLUTION)
    return kl + rest_ref * (np.log(rest_ref) - np.log(rest_other))


def _rest_mass(topk_logprobs: np.ndarray) -> np.ndarray:
    """1 - sum(exp(logprobs)) computed as -expm1(logsumexp), clipped at 0 (rounding can overshoot)."""
    peak = np.max(topk_logprobs, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    lse = (peak + np.log(np.sum(np.exp(topk_logprobs - peak), axis=-1, keepdims=True)))[..., 0]
    return np.clip(-np.expm1(np.minimum(lse, 0.0)), 0.0, 1.0)


def mean_kl(ref_topk_ids: Any, ref_topk_logprobs: Any, other_logits: Any) -> float:
    """Mean over positions of :func:`kl_per_position`."""
    return float(np.mean(kl_per_position(ref_topk_ids, ref_topk_logprobs, other_logits)))


def logprob_error_per_position(
    ref_topk_ids: Any, ref_topk_logprobs: Any, ref_spread: Any, other_logits: Any
) -> np.ndarray:
    """Per position: max over the reference's top-k tokens of ``|lp_ref - lp_other|`` / the reference's spread."""
    ids = np.asarray(ref_topk_ids, dtype=np.int64)
    lp_ref = np.asarray(ref_topk_logprobs, dtype=np.float64)
    lp_other = np.take_along_axis(log_softmax(_other(other_logits, len(ids))), ids, axis=-1)
    spread = np.asarray(ref_spread, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        err = np.abs(lp_ref - lp_other).max(axis=-1) / spread
    return np.where(spread > 0, err, np.where(err == 0, 0.0, np.inf))


def logprob_error(ref_topk_ids: Any, ref_topk_logprobs: Any, ref_spread: Any, other_logits: Any) -> float:
    """Max over positions of :func:`logprob_error_per_position`: 0.02 is 2% of the logits' spread."""
    return float(np.max(logprob_error_per_position(ref_topk_ids, ref_topk_logprobs, ref_spread, other_logits)))


@dataclass
class Agreement:
    """The measures of one comparison; ``str()`` gives a one-line summary for test messages."""

    positions: int
    counted: int  # positions whose reference top-2 gap is at least min_gap
    agreeing: int  # of those, positions where top-1 matches
    mean_kl: float
    max_kl: float
    max_kl_position: int
    logprob_error: float  # relative to the reference's spread, max over positions
    logprob_error_position: int
    k: int = DEFAULT_K
    min_gap: float = DEFAULT_MIN_GAP
    max_abs_logit_diff: float | None = None  # only when the reference is full logits
    disagreements: list[int] = field(default_factory=list)  # counted positions where top-1 differs
    label: str = ""

    @property
    def top1(self) -> float:
        """Fraction of counted positions where top-1 agrees (1.0 when none are counted)."""
        return self.agreeing / self.counted if self.counted else 1.0

    def failures(
        self, top1: float | None = None, kl: float | None = None, logprob_error: float | None = None
    ) -> list[str]:
        """The bars this comparison misses: ``top1`` a minimum, ``kl`` and ``logprob_error`` maxima."""
        out = []
        if top1 is not None and self.top1 < top1:
            out.append(f"top-1 agreement {self.top1:.2%} < {top1:.2%}")
        if kl is not None and not self.mean_kl <= kl:
            out.append(f"mean KL {self.mean_kl:.3g} > {kl:.3g}")
        if logprob_error is not None and not self.logprob_error <= logprob_error:
            out.append(f"log-prob error {_percent(self.logprob_error)} of spread > {_percent(logprob_error)}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "counted": self.counted,
            "top1": self.top1,
            "mean_kl": self.mean_kl,
            "max_kl": self.max_kl,
            "logprob_error": self.logprob_error,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "disagreements": list(self.disagreements),
        }

    def __str__(self) -> str:
        head = f"{self.label}: " if self.label else ""
        text = (
            f"{head}top-1 {self.agreeing}/{self.counted} = {self.top1:.2%} "
            f"(of {self.positions} positions, gap >= {self.min_gap:g}); "
            f"mean KL {self.mean_kl:.3g} (max {self.max_kl:.3g} at {self.max_kl_position}, top-{self.k}); "
            f"log-prob error {_percent(self.logprob_error)} of spread (at {self.logprob_error_position})"
        )
        if self.max_abs_logit_diff is not None:
            text += f"; max |logit diff| {self.max_abs_logit_diff:.3g}"
        if self.disagreements:
            shown = ", ".join(map(str, self.disagreements[:10]))
            text += f"; top-1 differs at {shown}" + (" ..." if len(self.disagreements) > 10 else "")
        return text


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.3g}%"


def compare(
    ref: Any, other_logits: Any, k: int = DEFAULT_K, min_gap: float = DEFAULT_MIN_GAP, label: str = ""
) -> Agreement:
    """All measures of ``other_logits`` (``[n, vocab]``) against ``ref`` (full logits or a :class:`TopK`)."""
    topk = _as_topk(ref, k)
    other = _other(other_logits, len(topk))
    if other.shape[1] <= int(topk.ids.max(initial=0)):
        raise ValueError(f"other logits have a vocabulary of {other.shape[1]}, smaller than the reference's ids")
    kl = kl_per_position(topk.ids, topk.logprobs, other)
    err = logprob_error_per_position(topk.ids, topk.logprobs, topk.spread, other)
    agreeing, counted = top1_agreement(topk, other, min_gap)
    differs = np.flatnonzero((np.argmax(other, axis=-1) != topk.ids[:, 0]) & (topk.gap >= min_gap))
    max_abs = None
    if not isinstance(ref, TopK):
        r = np.asarray(ref, dtype=np.float64)
        if r.shape == other.shape:
            max_abs = float(np.max(np.abs(r - other)))
    return Agreement(
        positions=len(topk),
        counted=counted,
        agreeing=agreeing,
        mean_kl=float(np.mean(kl)),
        max_kl=float(np.max(kl)),
        max_kl_position=int(np.argmax(kl)),
        logprob_error=float(np.max(err)),
        logprob_error_position=int(np.argmax(err)),
        k=topk.k,
        min_gap=min_gap,
        max_abs_logit_diff=max_abs,
        disagreements=[int(i) for i in differs],
        label=label,
    )


def combine(agreements: list[Agreement], label: str = "") -> Agreement:
    """One :class:`Agreement` over several sequences, as if their positions were concatenated.

    Counts add up, the mean KL is weighted by positions, maxima are taken; positions in the result
    index the concatenation.
    """
    if not agreements:
        raise ValueError("nothing to combine")
    offsets = np.cumsum([0] + [a.positions for a in agreements])
    worst_kl = max(range(len(agreements)), key=lambda i: agreements[i].max_kl)
    worst_err = max(range(len(agreements)), key=lambda i: agreements[i].logprob_error)
    diffs = [a.max_abs_logit_diff for a in agreements]
    return Agreement(
        positions=int(offsets[-1]),
        counted=sum(a.counted for a in agreements),
        agreeing=sum(a.agreeing for a in agreements),
        mean_kl=float(sum(a.mean_kl * a.positions for a in agreements) / offsets[-1]),
        max_kl=agreements[worst_kl].max_kl,
        max_kl_position=int(offsets[worst_kl] + agreements[worst_kl].max_kl_position),
        logprob_error=agreements[worst_err].logprob_error,
        logprob_error_position=int(offsets[worst_err] + agreements[worst_err].logprob_error_position),
        k=min(a.k for a in agreements),
        min_gap=agreements[0].min_gap,
        max_abs_logit_diff=None if any(d is None for d in diffs) else max(diffs),
        disagreements=[int(o + i) for a, o in zip(agreements, offsets) for i in a.disagreements],
        label=label,
    )


def first_near_tie(gaps: Any, min_gap: float = DEFAULT_MIN_GAP) -> int | None:
    """The first position whose top-2 gap is below ``min_gap`` (where greedy decoding may go either way)."""
    below = np.flatnonzero(np.asarray(gaps, dtype=np.float64) < min_gap)
    return int(below[0]) if len(below) else None
