"""llama.cpp's GBNF grammars (``grammar`` in a request, as llama-server takes it; vLLM's ``guided_grammar``) as rules
of :class:`leat_server.constrained.Grammar`, for plain-text output.

Taken as llama.cpp's ``grammars/README.md`` writes them: rules ``name ::= alternatives`` (``root`` the whole output),
alternatives ``|``, sequences of ``"literals"`` (escapes ``\\n \\r \\t \\\\ \\" \\xHH \\uHHHH \\UHHHHHHHH``),
``[classes]`` (ranges, ``^`` negation), rule names (defined anywhere), ``( groups )``, ``.``, the repeats
``* + ? {m} {m,} {m,n} {,n}``, ``#`` comments; a rule goes on over newlines after ``::=``, after ``|`` and inside
parentheses. Refused (the exception given): token references (``<[id]>``), an undefined rule, a rule defined
twice, no ``root``; the grammar's later checks refuse left recursion. ``.`` and negated classes leave out control
characters (they are never written), where llama.cpp's take any.
"""

from __future__ import annotations

from typing import Any, NoReturn

from leat_server.pattern import char_range

MAX_REPEAT = 1024  # largest count of a {m,n} written out
MAX_CLASS = 1 << 16  # largest character range written out
ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^"}
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


def gbnf_rule(g: Any, text: str, refuse: type[Exception]) -> int:
    """The ``root`` rule of the GBNF ``text``, its rules added to ``g``."""
    return _Gbnf(g, text, refuse).grammar()


class _Gbnf:
    def __init__(self, g: Any, text: str, refuse: type[Exception]):
        self.g, self.text, self.at, self.refuse = g, text, 0, refuse
        self.rules: dict[str, int] = {}
        self.defined: set[str] = set()

    def fail(self, why: str) -> NoReturn:
        line = self.text.count("\n", 0, self.at) + 1
        raise self.refuse(f"grammar line {line}: {why}")

    def peek(self, n: int = 1) -> str:
        return self.text[self.at : self.at + n]

    def space(self, newlines: bool) -> None:
        while self.at < len(self.text):
            c = self.text[self.at]
            if c == "#":
                while self.at < len(self.text) and self.text[self.at] != "\n":
                    self.at += 1
            elif c in " \t" or (newlines and c in "\r\n"):
                self.at += 1
            else:
                return

    def grammar(self) -> int:
        self.space(newlines=True)
        while self.at < len(self.text):
            name = self.name()
            self.space(newlines=False)
            if self.peek(3) != "::=":
                self.fail(f"expected ::= after the rule name {name!r}")
            self.at += 3
            self.space(newlines=True)
            if name in self.defined:
                self.fail(f"the rule {name!r} is defined twice")
            self.defined.add(name)
            self.g.define(self.rule(name), *self.alternatives(nested=False))
            if self.peek() not in ("", "\n", "\r"):
                self.fail(f"unexpected {self.peek()!r}")
            self.space(newlines=True)
        if undefined := sorted(set(self.rules) - self.defined):
            self.fail(f"the rule {undefined[0]!r} is used but not defined")
        if "root" not in self.defined:
            self.fail("no root rule (root ::= ...: the whole output)")
        return self.rules["root"]

    def name(self) -> str:
        start = self.at
        while self.at < len(self.text) and (self.text[self.at].isalnum() or self.text[self.at] in "-_"):
            self.at += 1
        if self.at == start:
            self.fail(f"expected a rule name, not {self.peek()!r}")
        return self.text[start : self.at]

    def rule(self, name: str) -> int:
        if name not in self.rules:
            self.rules[name] = self.g.add()
        return self.rules[name]

    def alternatives(self, nested: bool) -> list[list[Any]]:
        options = [self.sequence(nested)]
        while self.peek() == "|":
            self.at += 1
            self.space(newlines=True)
            options.append(self.sequence(nested))
        return options

    def sequence(self, nested: bool) -> list[Any]:
        items: list[Any] = []
        while self.peek() not in ("", "|", ")", "\n", "\r"):
            items += self.repeated(self.term())
            self.space(newlines=nested)
        return items

    def term(self) -> list[Any]:
        c = self.peek()
        if c == '"':
            self.at += 1
            chars = []
            while self.peek() != '"':
                chars.append(self.char())
            self.at += 1
            return [("lit", ch) for ch in chars]
        if c == "[":
            return [self.char_class()]
        if c == "(":
            self.at += 1
            self.space(newlines=True)
            options = self.alternatives(nested=True)
            if self.peek() != ")":
                self.fail("a group is not closed")
            self.at += 1
            return [self.g.add(*options)]
        if c == ".":
            self.at += 1
            return [("not", frozenset())]
        if c == "<":
            self.fail("token references (<[id]>) are not supported")
        return [self.rule(self.name())]

    def char(self) -> str:
        """One character of a literal or a class, its escape read."""
        if self.at >= len(self.text):
            self.fail("the grammar ends inside a literal or a class")
        c = self.text[self.at]
        self.at += 1
        if c != "\\":
            return c
        e = self.peek()
        self.at += 1
        if e in HEX_DIGITS:
            digits = self.text[self.at : self.at + HEX_DIGITS[e]]
            if len(digits) != HEX_DIGITS[e] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{e} takes {HEX_DIGITS[e]} hexadecimal digits")
            self.at += HEX_DIGITS[e]
            return chr(int(digits, 16))
        if e not in ESCAPES:
            self.fail(f"unknown escape \\{e}")
        return ESCAPES[e]

    def char_class(self) -> tuple:
        self.at += 1
        negated = self.peek() == "^"
        self.at += negated
        chars: set[str] = set()
        while self.peek() != "]":
            first = self.char()
            if self.peek() == "-" and self.peek(2)[1:] not in ("]", ""):
                self.at += 1
                chars |= char_range(first, self.char(), MAX_CLASS, self.fail)
            else:
                chars.add(first)
        self.at += 1
        return ("not", frozenset(chars)) if negated else ("set", frozenset(chars))

    def repeated(self, elements: list[Any]) -> list[Any]:
        c = self.peek()
        if c not in ("*", "+", "?", "{"):
            return elements
        if c == "{":
            end = self.text.find("}", self.at)
            low_text, comma, high_text = self.text[self.at + 1 : end if end > 0 else self.at].partition(",")
            if (
                end < 0
                or not (low_text.strip() or comma)
                or not all(t.strip().isdigit() for t in (low_text, high_text) if t.strip())
            ):
                self.fail("a repeat count is {m}, {m,}, {m,n} or {,n}")
            low = int(low_text) if low_text.strip() else 0
            high = None if comma and not high_text.strip() else int(high_text) if comma else low
            self.at = end + 1
        else:
            self.at += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if (high is not None and high < low) or max(low, high or 0) > MAX_REPEAT:
            self.fail(f"a repeat count must be {{m,n}} with m <= n <= {MAX_REPEAT}")
        return self.g.repeat(self.g.add(elements), low, high)
