"""Generated token ids to text: the one pipeline the server and :meth:`leat.model.Model.generate` share.

The engine emits token ids only. A frontend feeds them to a :class:`TextStream`, which detokenizes them and
ends the output at the first stop string. What :meth:`TextStream.feed` returns is final: it never holds
incomplete UTF-8, a stop string, or a tail that later text could complete into one; those wait for more ids
or for :meth:`TextStream.flush`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leat.tokenizer import IncrementalDecoder


class TextStream:
    """Text of a stream of token ids, cut at the first of ``stops``.

    ``stopped`` turns true once a stop string appears; ``matched`` is that string. ``ids_read`` counts the ids
    the text covers: every id fed until a stop string matched, then those up to the one that completed it
    (ids fed after it are ignored, as the engine may still be generating when the caller cancels it).
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), skip_special: bool = True):
        self._decoder = IncrementalDecoder(tokenizer, skip_special=skip_special)
        self.stops = [s for s in stops if s]
        self._held = ""  # decoded text that may be the start of a stop string
        self.stopped = False
        self.matched: str | None = None
        self.ids_read = 0

    def feed(self, ids: Sequence[int]) -> str:
        """The text these ids make safe to release (possibly empty)."""
        if self.stopped:
            return ""
        if not self.stops:
            self.ids_read += len(ids)
            return "".join(self._decoder.feed(token) for token in ids)
        out = []
        for token in ids:
            self.ids_read += 1
            out.append(self._release(self._decoder.feed(token)))
            if self.stopped:
                break
        return "".join(out)

    def flush(self) -> str:
        """What was held back, once the ids have ended (incomplete UTF-8 comes out as U+FFFD)."""
        if self.stopped:
            return ""
        text = self._release(self._decoder.flush())
        text, self._held = text + self._held, ""
        return text

    def _release(self, text: str) -> str:
        """``text`` after what is held, less any stop string and what follows it, less a tail that may begin one."""
        text = self._held + text
        at, stop = find_first(text, self.stops)
        if at >= 0:
            self._held, self.stopped, self.matched = "", True, stop
            return text[:at]
        keep = held_prefix(text, self.stops)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str]:
    """Position and text of the earliest marker in ``text``, or (-1, "")."""
    found = (-1, "")
    for marker in markers:
        at = text.find(marker)
        if at >= 0 and (found[0] < 0 or at < found[0]):
            found = (at, marker)
    return found


def held_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a marker (it may yet become one)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
