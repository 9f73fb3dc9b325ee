"""leat-speculative: registers the proposers; their code loads only when an engine speculates."""

from __future__ import annotations

from collections.abc import Callable

from leat import hookimpl


@hookimpl
def register_proposers(register: Callable[..., None]) -> None:
    register("ngram", "leat_speculative.proposers:PromptLookup")
    register("draft", "leat_speculative.proposers:DraftModel")
    register("mtp", "leat_speculative.mtp:MultiTokenPrediction")
    register("assistant", "leat_speculative.assistant:Assistant")
