"""A JSON schema's ``pattern`` as grammar rules of :mod:`leat_server.constrained`: the JSON string contents whose
decoded text the regular expression matches (searched for, as JSON Schema says: a pattern without ``^`` or ``$``
may have any text before or after it); and vLLM's ``guided_regex``, plain text the expression matches whole.

The expressions taken are those JSON schemas use (ECMA-262's common part): literals and escapes, ``.``, classes
(``[a-z_]``, ``[^"]``) and the escapes ``\\d \\w \\s`` (and their negations), groups (plain and ``(?:``),
alternation, ``* + ?`` and ``{n}``, ``{n,}``, ``{n,m}`` (lazy forms taken as the greedy ones: the same strings), and
``^`` / ``$`` at the pattern's ends. Refused (:class:`~leat_server.constrained.UnsupportedSchema`): backreferences,
lookaround, named groups, flags, word boundaries, Unicode property classes, anchors inside the pattern.

Every string the rules write matches the pattern, written as JSON writes it (``"`` and ``\\`` escaped, newline and
tab, carriage return, form feed and backspace as their short escapes); characters a pattern allows that JSON could
only write as a ``\\u`` escape (other control characters) are never written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

MAX_REPEAT = 256  # largest count of a {n,m} written out
MAX_CLASS = 1024  # largest character range written out
# characters JSON writes as an escape, and how (other control characters only as \u escapes: never written here)
ESCAPED = {'"': '"', "\\": "\\", "\n": "n", "\t": "t", "\r": "r", "\f": "f", "\b": "b"}
CLASSES = {
    "d": "0123456789",
    "w": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_",
    "s": " \t\n\r\f\v",
}
LITERAL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}


def char_range(first: str, last: str, widest: int, fail: Callable[[str], NoReturn]) -> set[str]:
    """The characters from ``first`` to ``last`` of a class; ``fail`` takes the error of a reversed range or one of
    more than ``widest`` characters."""
    if ord(last) < ord(first) or ord(last) - ord(first) > widest:
        fail(f"the range {first!r}-{last!r} is reversed or wider than {widest} characters")
    return {chr(i) for i in range(ord(first), ord(last) + 1)}


class Chars:
    """A set of characters: ``chars`` itself, or (``negated``) every character but those."""

    def __init__(self, chars: str | set[str], negated: bool = False):
        self.chars, self.negated = frozenset(chars), negated

    def has(self, c: str) -> bool:
        return (c in self.chars) != self.negated


def pattern_rule(g: Any, pattern: str, any_char: int, refuse: type[Exception]) -> int:
    """The rule for a JSON string (quotes included) whose text ``pattern`` matches; ``any_char`` is the grammar's
    rule for one JSON string character; ``refuse`` the exception for what cannot be taken."""
    return _Parser(g, pattern, any_char, refuse).string()


def text_rule(g: Any, pattern: str, refuse: type[Exception]) -> int:
    """The rule for plain text (not JSON) that ``pattern`` matches whole (vLLM's ``guided_regex``: ``^`` and ``$``
    change nothing), every character written as itself; of the control characters only newline, tab and carriage
    return."""
    parser = _Parser(g, pattern, -1, refuse, raw=True)
    parser.text = pattern.removeprefix("^")
    if _anchored_end(parser.text):
        parser.text = parser.text[:-1]
    return parser.whole()


def _anchored_end(text: str) -> bool:
    """Whether ``text`` ends with ``$`` that is not escaped (an even number of backslashes before it)."""
    backslashes = len(text[:-1]) - len(text[:-1].rstrip("\\"))
    return text.endswith("$") and backslashes % 2 == 0


class _Parser:
    def __init__(self, g: Any, pattern: str, any_char: int, refuse: type[Exception], raw: bool = False):
        self.g, self.text, self.at, self.any_char, self.refuse, self.raw = g, pattern, 0, any_char, refuse, raw

    def string(self) -> int:
        g, text = self.g, self.text
        anchored_start = text.startswith("^")
        anchored_end = _anchored_end(text) and len(text) > anchored_start
        self.text = text[1 if anchored_start else 0 : len(text) - (1 if anchored_end else 0)]
        body = self.whole()
        anything = g.add([])
        g.define(anything, [], [self.any_char, anything])
        return g.add(['"', *([] if anchored_start else [anything]), body, *([] if anchored_end else [anything]), '"'])

    def whole(self) -> int:
        """The rule for all of ``self.text``."""
        body = self.alternation()
        if self.at < len(self.text):
            self.fail(f"unexpected {self.text[self.at]!r}")
        return body

    def fail(self, why: str) -> NoReturn:
        raise self.refuse(f"pattern {self.text!r}: {why} (at {self.at})")

    def peek(self) -> str:
        return self.text[self.at] if self.at < len(self.text) else ""

    def take(self) -> str:
        c = self.peek()
        if not c:
            self.fail("the pattern ends too soon")
        self.at += 1
        return c

    def alternation(self) -> int:
        options = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            options.append(self.sequence())
        return self.g.add(*options)

    def sequence(self) -> list[Any]:
        items: list[Any] = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified(self.atom()))
        return items

    def atom(self) -> int:
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.text[self.at : self.at + 2] != "?:":
                    self.fail("lookaround, named groups and flags are not supported")
                self.at += 2
            inner = self.alternation()
            if self.take() != ")":
                self.fail("a group is not closed")
            return inner
        if c == "[":
            return self.chars(self.char_class())
        if c == ".":
            return self.chars(Chars("\n", negated=True))
        if c == "\\":
            return self.escape()
        if c in "^$":
            self.fail("^ and $ are taken only at the pattern's ends")
        if c in "*+?{":
            self.fail(f"{c!r} repeats nothing")
        if c in ")]}":
            self.fail(f"unbalanced {c!r}")
        return self.chars(Chars(c))

    def escape(self) -> int:
        c = self.take()
        if c.lower() in CLASSES:
            return self.chars(Chars(CLASSES[c.lower()], negated=c.isupper()))
        if c in LITERAL_ESCAPES:
            return self.chars(Chars(LITERAL_ESCAPES[c]))
        if c.isalnum():
            self.fail(f"\\{c} is not supported")
        return self.chars(Chars(c))

    def char_class(self) -> Chars:
        negated = self.peek() == "^"
        self.at += negated
        chars: set[str] = set()
        first = True
        while first or self.peek() != "]":
            first = False
            c = self.take()
            if c == "\\":
                e = self.take()
                if e.lower() in CLASSES and not e.isupper():
                    chars |= set(CLASSES[e])
                    continue
                if e.isupper() and e.lower() in CLASSES or (e.isalnum() and e not in LITERAL_ESCAPES):
                    self.fail(f"\\{e} is not supported in a class")
                c = LITERAL_ESCAPES.get(e, e)
            if self.peek() == "-" and self.text[self.at + 1 : self.at + 2] not in ("]", ""):
                self.at += 1
                end = self.take()
                if end == "\\":
                    end = LITERAL_ESCAPES.get(self.peek(), self.peek())
                    self.take()
                chars |= char_range(c, end, MAX_CLASS, self.fail)
            else:
                chars.add(c)
        self.at += 1
        return Chars(chars, negated)

    def chars(self, chars: Chars) -> int:
        """One character of the set, as JSON writes it: the plain ones as one terminal, the escaped ones apart (as
        itself in plain text, control characters but newline, tab and carriage return left out)."""
        if self.raw:
            controls = [[("lit", c)] for c in "\n\t\r" if chars.has(c)]
            if chars.negated:
                return self.g.add([("not", chars.chars)], *controls)
            kept = frozenset(c for c in chars.chars if c >= " ")
            if not kept and not controls:
                self.fail("a control character that is not written")
            return self.g.add(*([[("set", kept)]] if kept else []), *controls)
        escapes = [["\\", name] for c, name in ESCAPED.items() if chars.has(c)]
        if chars.negated:
            plain: Any = ("not", frozenset(chars.chars | set(ESCAPED)))
        else:
            kept = frozenset(c for c in chars.chars if c not in ESCAPED and c >= " ")
            plain = ("set", kept) if kept else None
        alternatives = ([[plain]] if plain is not None else []) + escapes
        if not alternatives:
            self.fail("a character JSON writes only as a \\u escape")
        return self.g.add(*alternatives)

    def quantified(self, atom: int) -> int:
        c = self.peek()
        if c not in ("*", "+", "?", "{"):
            return atom
        if c == "{":
            low, high = self.counts()
        else:
            self.at += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":  # lazy: the same strings
            self.at += 1
        if self.peek() in ("*", "+", "?", "{"):
            self.fail("a repeat of a repeat")
        return self.g.add(self.g.repeat(atom, low, high))

    def counts(self) -> tuple[int, int | None]:
        end = self.text.find("}", self.at)
        body = self.text[self.at + 1 : end] if end > 0 else ""
        low_text, comma, high_text = body.partition(",")
        if not low_text.isdigit() or (high_text and not high_text.isdigit()):
            self.fail("a repeat count must be {n}, {n,} or {n,m}")
        low = int(low_text)
        high = None if comma and not high_text else int(high_text) if high_text else low
        if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
            self.fail(f"a repeat count must be {{n,m}} with n <= m <= {MAX_REPEAT}")
        self.at = end + 1
        return low, high
