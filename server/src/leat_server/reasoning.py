"""Per-request reasoning control: thinking on or off, an effort, and a budget of reasoning tokens.

Each API says it its own way (OpenAI ``reasoning_effort`` and ``reasoning: {effort, max_tokens, enabled}``,
Anthropic ``thinking: {type, budget_tokens}``, Responses ``reasoning.effort``); each becomes a :class:`Reasoning`,
which sets the chat template's switches (``enable_thinking``, ``reasoning_effort``) and, for models that write
``<think>...</think>``, a :class:`ThinkingBudget`: a logits processor that ends the thinking section after the
budget by forcing its closing tag, so the answer follows. Thinking turned off is a budget of 0 as well, so it holds
also for templates without a switch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from leat.chatformat import ReasoningSplitter, opens_thinking

from leat_server.errors import unsupported

OFF_EFFORTS = ("none", "minimal")  # efforts that turn thinking off
CLOSE = ReasoningSplitter.CLOSE + "\n\n"  # what a forced end of thinking writes, as Qwen3's template does
LOOKAHEAD = 32  # generated tokens in which an answer must open <think> for its reasoning to count


@dataclass
class Reasoning:
    """What one request asks of the model's thinking: on or off (None: as the template does by default), an effort
    for templates that take one, and a cap on reasoning tokens (None: none)."""

    enabled: bool | None = None
    effort: str | None = None
    budget: int | None = None

    @classmethod
    def of_effort(cls, effort: str | None, budget: int | None = None, enabled: bool | None = None) -> Reasoning:
        if enabled is None and effort is not None:
            enabled = effort not in OFF_EFFORTS
        return cls(enabled, effort, budget)

    def template_vars(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.enabled is not None:
            out["enable_thinking"] = self.enabled
        if self.effort is not None:
            out["reasoning_effort"] = self.effort
        return out

    def processors(self, service: Any, prompt_text: str, param: str) -> list[ThinkingBudget]:
        """The budget's processor for a prompt rendered as ``prompt_text``; none when there is no budget or the
        model does not write ``<think>`` reasoning. A budget for a format with its own reasoning channel is a 400."""
        fmt = service.format.format
        if fmt is not None and fmt.own_reasoning:
            if self.budget is not None:
                raise unsupported(param, f"a reasoning budget needs <think> reasoning; {fmt.__name__} has its own")
            return []
        budget = 0 if self.enabled is False else self.budget
        if budget is None or not service.format.reasoning:
            return []
        if not service.supports("processors"):
            raise unsupported(param, "a reasoning budget needs per-request logits processors, which this engine lacks")
        return [ThinkingBudget(budget, opens_thinking(prompt_text), service.tokenizer)]


class ThinkingBudget:
    """Ends a ``<think>`` section once it holds ``budget`` tokens, by forcing the tokens of :data:`CLOSE` one at a
    time. The section starts at the first generated token when the prompt opened it (``open_at_start``), else
    after a ``<think>`` the answer begins with; an answer that closes it, or begins without one, is left alone."""

    def __init__(self, budget: int, open_at_start: bool, tokenizer: Any):
        self.budget = budget
        self.close = tokenizer.encode(CLOSE, add_special=False, parse_special=True)
        self.tokenizer = tokenizer
        self.start: int | None = 0 if open_at_start else None  # where the reasoning begins among the generated ids
        self.over = False  # the section has closed, or the answer has none
        self.label = "reasoning budget"
        self.spec = (f"{__name__}:rebuild", {"budget": budget, "open_at_start": open_at_start})

    def __call__(self, logits: np.ndarray, generated: Any) -> np.ndarray:
        if self.over or not self._started(generated):
            return logits
        assert self.start is not None
        thought = list(generated[self.start :])
        closed = ReasoningSplitter.CLOSE in self._text(thought[-LOOKAHEAD:])
        # how much of CLOSE is written already: forced in earlier steps, or the model had begun it
        written = max(p for p in range(len(self.close)) if p == 0 or thought[-p:] == self.close[:p])
        if len(thought) < self.budget or (closed and not written):
            self.over = closed
            return logits
        forced = np.full_like(logits, -np.inf)
        forced[self.close[written]] = 0.0
        return forced

    def _started(self, generated: Any) -> bool:
        if self.start is not None:
            return True
        for count in range(1, min(len(generated), LOOKAHEAD) + 1):
            if self._text(generated[:count]).lstrip().startswith(ReasoningSplitter.OPEN):
                self.start = count
                return True
        head = self._text(generated[:LOOKAHEAD]).lstrip()
        if len(generated) >= LOOKAHEAD or (head and not ReasoningSplitter.OPEN.startswith(head)):
            self.over = True  # no reasoning in this answer
        return False

    def _text(self, ids: Any) -> str:
        return self.tokenizer.decode(list(ids), skip_special=False)


def rebuild(payload: dict[str, Any], model: Any) -> ThinkingBudget:
    """The budget :meth:`Reasoning.processors` made, rebuilt in an engine process from its spec's payload
    (``leat.engine_process.build_processor`` imports and calls this)."""
    return ThinkingBudget(int(payload["budget"]), bool(payload["open_at_start"]), model.tokenizer)
