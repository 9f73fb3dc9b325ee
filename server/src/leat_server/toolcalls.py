"""How the server reads a model's output: the chat format (tool calls, reasoning) the installed plugins recognise.

The formats themselves come from plugins (:func:`leat.hookspecs.register_chat_formats`, usually the model's
architecture plugin); :mod:`leat.chatformat` holds what they share. Here the server picks one per model and decides,
per request, whether its parser runs (tools active, or a format whose structure is always there) and whether special
tokens' text reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

from leat.chatformat import OutputParser, ReasoningSplitter, build_parser, choose, formats, has_reasoning
from leat.errors import LeatError


@dataclass
class ModelFormat:
    """The chat format one model speaks (None: plain content) and whether it writes ``<think>`` reasoning."""

    format: type[OutputParser] | None
    reasoning: bool

    @classmethod
    def of(cls, template: str, vocab: list[str], architecture: str, name: str | None, reasoning: bool | None):
        """The format ``name`` (``--tool-parser``), else the one the installed formats recognise."""
        known = formats()
        if name is not None and name not in known:
            raise LeatError(
                f"--tool-parser {name!r} is not a chat format of the loaded plugins; they have: "
                f"{', '.join(sorted(known)) or 'none (install an architecture plugin that brings one)'}"
            )
        name = name or choose(template, vocab, architecture)
        return cls(known[name] if name else None, has_reasoning(template, vocab) if reasoning is None else reasoning)

    def parser(self, tools_active: bool, prompt_text: str) -> OutputParser | ReasoningSplitter:
        active = self.format if tools_active or self.always_parsed else None
        return build_parser(active, self.reasoning, prompt_text)

    @property
    def always_parsed(self) -> bool:
        return bool(self.format and self.format.always_parsed)
