"""Speculative decoding: a proposer guesses a request's next tokens, the target model checks them all in one row.

A decoding request's row becomes its last token plus ``k`` draft tokens, with the logits of every
position (``Row.all_logits``); :func:`verify` keeps the draft's longest acceptable prefix and adds
one token of its own, so each forward yields between 1 and ``k + 1`` tokens. Verification is
exact: greedy requests produce what plain decoding produces, and sampled requests follow the
target's distribution (after the request's whole sampling chain) by rejection sampling
(Leviathan et al. 2023, Chen et al. 2023). Proposers are plugins
(:func:`leat.hookspecs.register_proposers`); :class:`Controller` picks each request's draft length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from leat import plugins
from leat.errors import PluginError
from leat.sampling import Sampler


class Proposer:
    """Guesses the tokens that follow a sequence. One instance serves every request of an engine.

    ``key`` identifies the request, so a proposer may keep per-request state (a draft model's KV);
    ``forget(key)`` is called when the request ends. ``tokens`` only grows between calls for a key.
    """

    name: str = ""
    #: True when the proposer drafts from the target's own hidden states (multi-token prediction): the engine then
    #: steps the target with :meth:`leat.architecture.Architecture.forward_hidden` (not a captured step) and hands
    #: each speculating request's rows to :meth:`observe`
    reads_hidden: bool = False

    def __init__(self, model: Any, **options: Any):
        self.model = model

    def forward_hidden(self, batch: Any, kv: Any) -> tuple[Any, Any]:
        """Where :attr:`reads_hidden`: the target's step on ``batch``, as
        :meth:`leat.architecture.Architecture.forward_hidden` (which this default calls). A proposer that reads more
        of the step (a drafter that attends to the target's keys and values) overrides it and keeps what :meth:`observe`,
        called next for each speculating row, slices at ``at``."""
        return self.model.architecture.forward_hidden(batch, kv)

    def observe(self, key: int, start: int, tokens: np.ndarray, hidden: Any, at: int = 0) -> None:
        """Where :attr:`reads_hidden`: the target has just run ``tokens`` of request ``key`` from position ``start``
        (a prompt chunk, or a token and its draft, which verification may yet reject), and ``hidden``
        [len(tokens), width] (a backend array) are its final-normed hidden states there; ``at`` is the row's first
        position in the step's batch."""

    def propose(self, key: int, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` token ids likely to follow ``tokens`` (fewer, or none, when it has no guess)."""
        raise NotImplementedError

    def forget(self, key: int) -> None:
        pass


def load_proposer(name: str, model: Any, host: plugins.PluginHost | None = None, **options: Any) -> Proposer:
    host = host or plugins.host()
    entry = host.get("proposers", name)
    if entry is None:
        installed = ", ".join(sorted(host.registry["proposers"])) or "none"
        raise PluginError(
            f"speculative proposer {name!r} is not registered by any loaded plugin (installed: {installed}); "
            f"install leat-speculative or add it to LEAT_PLUGINS / --plugins"
        )
    cls = entry.load()
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise PluginError(f"plugin {entry.plugin}: proposer {name!r} ({entry.ref}) is not a Proposer subclass")
    return cls(model, **options)


def accept_greedy(draft: Sequence[int], picks: Sequence[int]) -> list[int]:
    """Greedy verification from the target's pick at each position (``len(draft) + 1`` of them, the argmax
    after ``history + draft[:i]``): the draft's prefix that matches, then the pick where it first differs
    (or the bonus pick after a fully accepted draft). The same tokens :func:`verify` gives a greedy sampler
    with no stages, from ids alone."""
    for i, x in enumerate(draft):
        if int(picks[i]) != int(x):
            return [int(t) for t in draft[:i]] + [int(picks[i])]
    return [int(t) for t in draft] + [int(picks[len(draft)])]


def verify(
    sampler: Sampler,
    history: Sequence[int],
    draft: Sequence[int],
    logits: np.ndarray,
    draft_probabilities: np.ndarray | None = None,
) -> list[int]:
    """The tokens a request gains from one verified span: the accepted draft prefix, then one more.

    ``logits[i]`` are the target's logits after ``history + draft[:i]`` (``len(draft) + 1`` rows).
    Greedy: a draft token is accepted when it is the token plain decoding picks there; the first
    mismatch is replaced by that pick. Sampled, with p the request's final distribution (its
    whole chain: penalties, top-k/p, min-p, temperature) and q the proposer's
    (``draft_probabilities[i]``; None means each draft token was proposed with certainty): token
    x is accepted with probability min(1, p(x) / q(x)); on rejection the replacement is drawn from
    max(0, p - q) normalised; after all are accepted a bonus token is drawn from p. The result is
    distributed exactly as plain sampling from p would be.
    """
    history = list(history)
    out: list[int] = []
    for i, x in enumerate(draft):
        if sampler.greedy:
            pick = sampler.sample(logits[i], history)
            if pick != x:
                return out + [pick]
        else:
            p = sampler.probabilities(logits[i], history)
            q = draft_probabilities[i] if draft_probabilities is not None else None
            qx = 1.0 if q is None else float(q[x])
            if not sampler.rng.random() < min(1.0, p[x] / qx):
                residual = p.copy()
                if q is None:
                    residual[x] = 0.0
                else:
                    residual = np.maximum(residual - q, 0.0)
                return out + [int(sampler.rng.choice(residual.size, p=residual / residual.sum()))]
        out.append(int(x))
        history.append(int(x))
    return out + [sampler.sample(logits[len(draft)], history)]


@dataclass
class Speculation:
    """An engine's speculation settings: the proposer, and the bounds the controller works within.

    What a longer row costs is measured as the engine runs: the time of decode-only steps (the whole
    step: proposing, the forward pass, verifying and emitting tokens; on a fast GPU the host work is
    a large part of a step), by the number of tokens in the step (an average weighted to recent
    steps). Where a forward pass is bound by reading weights (a GPU) extra positions are nearly free
    and long drafts pay; where it is bound by arithmetic (numpy on a CPU) only well-accepted drafts do, and a backend may
    have steps in cost (the CPU backend switches BLAS threading past 8 rows). Sizes not yet
    measured are priced at ``token_cost`` (a fraction of a one-token step) per extra position.
    """

    proposer: Proposer
    max_draft: int = 8
    token_cost: float = 0.3
    threshold: float = 1.05
    probe_every: int = 16
    step_seconds: dict[int, float] = field(default_factory=dict)  # tokens in a decode-only step -> seconds
    _seen: set[int] = field(default_factory=set, repr=False)  # step sizes met once (their first step not counted)

    def controller(self, sampler: Sampler) -> Controller | None:
        """A new request's controller; None when its selector has no distribution to verify against."""
        if sampler.selector.name not in ("greedy", "categorical"):
            return None
        return Controller(self.max_draft, self.threshold, self.probe_every)

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode-only step of ``tokens`` positions took ``seconds``. The first step of each size is not
        counted: a backend compiles or captures a step shape when it first meets it (CUDA graphs, TinyJit),
        a one-off cost that is not the step's. Counted, one capture priced a verification at fifty plain
        steps and paused drafting for the rest of the request on CUDA."""
        if tokens not in self._seen:
            self._seen.add(tokens)
            return
        before = self.step_seconds.get(tokens)
        self.step_seconds[tokens] = seconds if before is None else 0.8 * before + 0.2 * seconds

    def cost(self, rows: int, extra: int) -> float:
        """A step of ``rows`` decoding rows with ``extra`` draft positions, relative to one without."""
        base = self.step_seconds.get(rows)
        measured = self.step_seconds.get(rows + extra)
        if base and measured:
            return measured / base
        # unmeasured: from the largest measured size below, plus the prior for each position past it
        known = [n for n in self.step_seconds if rows < n < rows + extra]
        if base and known:
            n = max(known)
            return self.step_seconds[n] / base + self.token_cost * (rows + extra - n)
        return 1 + self.token_cost * extra


class Controller:
    """Chooses one request's draft length from its recent acceptance, and pauses drafting that does not pay.

    With a per-token acceptance rate a, a draft of k yields (1 - a^(k+1)) / (1 - a) tokens per
    step, at ``cost(k)`` times a plain step's time; the controller takes the k with the best
    ratio, or drafts nothing when no k beats plain decoding by ``threshold``. While paused it
    probes with a one-token draft every ``probe_every`` steps, backing off further each time a
    probe fails, and never so often that failed probes cost more than ``probe_budget`` of the time.
    """

    def __init__(self, max_draft: int = 8, threshold: float = 1.05, probe_every: int = 16):
        self.max_draft = max_draft
        self.threshold = threshold
        self.probe_every = probe_every
        self.probe_budget = 0.02
        self.acceptance = 0.6  # an optimistic prior, so the first drafts are tried
        self.wait = 0  # steps left before the next probe while paused
        self.backoff = probe_every
        self.proposed = 0
        self.accepted = 0
        self.verifications = 0
        self._cost: Callable[[int], float] = _prior  # what a step with k drafts costs, until the engine says

    def _best(self, cost: Callable[[int], float]) -> tuple[int, float]:
        a = min(self.acceptance, 0.999)
        gains = [((1 - a ** (k + 1)) / (1 - a)) / cost(k) for k in range(1, self.max_draft + 1)]
        best = int(np.argmax(gains))
        return best + 1, gains[best]

    def draft_length(self, cost: Callable[[int], float] | None = None) -> int:
        """How many tokens to draft this step; ``cost(k)`` prices a step with k drafts against one without."""
        self._cost = cost or self._cost
        k, gain = self._best(self._cost)
        if gain >= self.threshold:
            return k
        if self.wait > 0:
            self.wait -= 1
            return 0
        return 1  # a probe

    def record(self, proposed: int, accepted: int) -> None:
        """One verification: ``accepted`` of the ``proposed`` draft tokens were kept."""
        if proposed == 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.verifications += 1
        # a rejection at draft i says little about i + 1 .. k: weigh the tokens actually tested
        tested = min(proposed, accepted + 1)
        rate = accepted / tested
        weight = min(1.0, 0.25 * tested)
        self.acceptance += weight * (rate - self.acceptance)
        if self._best(self._cost)[1] >= self.threshold:
            self.backoff = self.probe_every
        else:
            # a failed probe costs cost(1) - 1 plain steps: space probes so they spend at most probe_budget
            self.wait = max(self.backoff, int((self._cost(1) - 1) / self.probe_budget))
            self.backoff = min(self.backoff * 2, 16 * self.probe_every)


def _prior(k: int) -> float:
    return 1 + 0.3 * k
