"""Constrained decoding: at each step only tokens that keep the output a prefix of JSON matching a schema.

A JSON schema is compiled to a small context-free grammar (rules of alternatives of element
sequences, written right-recursively so nothing is left-recursive). The recognizer keeps the set of
parse stacks alive after the text so far (an NFA over stacks, as llama.cpp's grammar sampler does);
stacks drop finished frames, so repetition does not grow them and states recur, which makes the
per-state token masks cacheable. A mask is found by walking a trie of the vocabulary's token texts
with the state set, pruning a branch as soon as no stack survives it. End-of-generation tokens are
allowed only where the JSON is complete.

Enforced: type (and lists of types), properties / required (properties in schema order; no extra
properties unless ``additionalProperties`` says so: after the named ones, with keys none of theirs),
additionalProperties as a schema, prefixItems and items,
minItems / maxItems, enum, const, anyOf / oneOf, allOf of one schema, local ``$ref``,
minLength / maxLength on strings, pattern (:mod:`leat_server.pattern`; not with minLength / maxLength beside it), the
string formats date, time, date-time and uuid (calendar days only), minimum / maximum / exclusiveMinimum /
exclusiveMaximum on integers (each bound written out digit by digit, up to 17 digits). llama.cpp's grammars enforce
the same, but days a month lacks. Accepted but not enforced: other formats, bounds on non-integer numbers,
multipleOf, uniqueItems, and annotations (title, description, default, examples). Refused (400): patternProperties,
not, if / then / else, and anything else unknown.

Tokens that are a fragment of a UTF-8 character are never allowed (a non-ASCII character can still
be written whole, or as a ``\\u`` escape); control tokens are never allowed.

A schema is checked when the request arrives, so that a constraint the engine could not apply is a
400 and never reaches a step shared with other requests: compiling is bounded (nesting, rules,
seconds), a schema no JSON value satisfies is refused, parts of it that can never be written are
dropped, and a ``$ref`` loop that writes nothing before recurring is refused. So is a place in the
schema with more alternatives than :data:`MAX_ALTERNATIVES`, since each token mask costs in
proportion to them.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from leat_server.errors import APIError
from leat_server.gbnf import gbnf_rule
from leat_server.pattern import pattern_rule, text_rule

Element = Any  # int (a rule) | tuple (a terminal: ("lit", c) | ("set", chars) | ("not", chars) | ("range", a, b))
Stack = tuple  # of (rule, alternative, position) frames; the top frame's element is a terminal
State = frozenset  # of stacks; the empty stack () means the text so far is complete

ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "deprecated",
    "readOnly",
    "writeOnly",
    "strict",
    "name",
    "$defs",
    "definitions",
    "nullable",
    "contentEncoding",
    "contentMediaType",
    "uniqueItems",
}
KNOWN = ANNOTATIONS | {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "minLength",
    "maxLength",
    "prefixItems",
    "pattern",
}
FORMATS = ("date", "time", "date-time", "uuid")  # string formats written as their grammars (as llama.cpp's)
MAX_BOUND = 256  # largest minLength / maxLength / minItems / maxItems written out as rules
MAX_DIGITS = 16
MAX_INDENT = 8
MAX_NESTING = 32  # schemas inside schemas
MAX_RULES = 50_000
MAX_ALTERNATIVES = 4096  # parse stacks one place in the grammar can open at once
MAX_SECONDS = 2.0  # to compile and check one schema


class UnsupportedSchema(ValueError):
    pass


def _match(term: tuple, ch: str) -> bool:
    kind = term[0]
    if kind == "lit":
        return ch == term[1]
    if kind == "set":
        return ch in term[1]
    if kind == "not":
        return ch not in term[1] and ch >= " "
    return term[1] <= ch <= term[2]


class Grammar:
    def __init__(self) -> None:
        self.rules: list[list[tuple[Element, ...]]] = []
        self.root = -1
        self._advance: dict[tuple[State, str], State] = {}

    def add(self, *alternatives: Sequence[Any]) -> int:
        self.rules.append([])
        rule = len(self.rules) - 1
        if alternatives:
            self.define(rule, *alternatives)
        return rule

    def define(self, rule: int, *alternatives: Sequence[Any]) -> None:
        self.rules[rule] = [self._elements(a) for a in alternatives]

    def repeat(self, item: Element, low: int, high: int | None) -> list[Element]:
        """A sequence's elements for ``item`` written ``low`` to ``high`` times (None: no upper bound)."""
        rest = self.add([])
        if high is None:
            self.define(rest, [], [item, rest])
        else:
            for _ in range(high - low):
                rest = self.add([], [item, rest])
        return [*[item] * low, rest]

    @staticmethod
    def _elements(parts: Sequence[Any]) -> tuple[Element, ...]:
        out: list[Element] = []
        for part in parts if isinstance(parts, (list, tuple)) and not _is_terminal(parts) else [parts]:
            if isinstance(part, str):
                out += [("lit", c) for c in part]
            else:
                out.append(part)
        return tuple(out)

    # -- recognizing ---------------------------------------------------------------------------------------------
    def start(self) -> State:
        return frozenset(s for a in range(len(self.rules[self.root])) for s in self._expand(((self.root, a, 0),)))

    def _expand(self, stack: Stack) -> Iterator[Stack]:
        while stack:
            rule, alt, pos = stack[-1]
            elements = self.rules[rule][alt]
            if pos == len(elements):
                stack = stack[:-1]
                continue
            element = elements[pos]
            if isinstance(element, int):
                base = stack[:-1] + (((rule, alt, pos + 1),) if pos + 1 < len(elements) else ())
                for a in range(len(self.rules[element])):
                    yield from self._expand(base + ((element, a, 0),))
                return
            yield stack
            return
        yield ()

    def advance(self, state: State, ch: str) -> State:
        key = (state, ch)
        found = self._advance.get(key)
        if found is None:
            new: set[Stack] = set()
            for stack in state:
                if not stack:
                    continue
                rule, alt, pos = stack[-1]
                elements = self.rules[rule][alt]
                if _match(elements[pos], ch):
                    rest = stack[:-1] + (((rule, alt, pos + 1),) if pos + 1 < len(elements) else ())
                    new.update(self._expand(rest))
            found = self._advance[key] = frozenset(new)
            if len(self._advance) > 200_000:
                self._advance.clear()
        return found

    def accepts(self, text: str) -> bool:
        state = self.start()
        for ch in text:
            state = self.advance(state, ch)
            if not state:
                return False
        return () in state


def _is_terminal(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) >= 2 and x[0] in ("lit", "set", "not", "range")


DIGIT = ("range", "0", "9")
NONZERO = ("range", "1", "9")
HEX = ("set", frozenset("0123456789abcdefABCDEF"))


class SchemaCompiler:
    """JSON schema -> :class:`Grammar` whose language is the JSON texts the schema accepts."""

    def __init__(self, root: dict[str, Any]):
        self.g = Grammar()
        self.root_schema = root
        self.refs: dict[str, int] = {}
        self.spans: dict[tuple[str, str], int] = {}  # _span's rules, by their bounds
        self.formats: dict[str, int] = {}  # _format's rules
        self.depth = 0
        self.deadline = time.monotonic() + MAX_SECONDS
        g = self.g
        indent = g.add([])
        for _ in range(MAX_INDENT):
            indent = g.add([], [("set", frozenset(" \t")), indent])
        self.ws = g.add([], " ", ["\n", indent])
        digits = g.add([])
        for _ in range(MAX_DIGITS):
            digits = g.add([], [DIGIT, digits])
        self.digits = digits
        self.integer = g.add(["-", "0"], "0", ["-", NONZERO, digits], [NONZERO, digits])
        frac = g.add([], [".", DIGIT, digits])
        exp = g.add(
            [],
            [("set", frozenset("eE")), ("set", frozenset("+-")), DIGIT, digits],
            [("set", frozenset("eE")), DIGIT, digits],
        )
        self.number = g.add([self.integer, frac, exp])
        escape = g.add([("set", frozenset('"\\/bfnrt'))], ["u", HEX, HEX, HEX, HEX])
        self.char = g.add([("not", frozenset('"\\'))], ["\\", escape])
        chars = g.add([])
        g.define(chars, [], [self.char, chars])
        self.string = g.add(['"', chars, '"'])
        self.any = g.add()
        self._define_any()
        lead = g.add([], " ", "\n")
        g.root = g.add([lead, self.compile(root), lead])

    def _define_any(self) -> None:
        g, ws = self.g, self.ws
        member = g.add([self.string, ws, ":", ws, self.any])
        members = g.add([])
        g.define(members, [], [ws, ",", ws, member, members])
        obj = g.add(["{", ws, "}"], ["{", ws, member, members, ws, "}"])
        items = g.add([])
        g.define(items, [], [ws, ",", ws, self.any, items])
        arr = g.add(["[", ws, "]"], ["[", ws, self.any, items, ws, "]"])
        g.define(self.any, [obj], [arr], [self.string], [self.number], "true", "false", "null")
        self.any_object = obj

    def literal(self, value: Any) -> int:
        return self.g.add(json.dumps(value, ensure_ascii=True))

    def compile(self, schema: Any) -> int:
        if self.depth >= MAX_NESTING:
            raise UnsupportedSchema(f"the schema nests deeper than {MAX_NESTING} levels")
        if len(self.g.rules) > MAX_RULES or time.monotonic() > self.deadline:
            raise UnsupportedSchema(
                f"the schema is too large to enforce (over {MAX_RULES:,} grammar rules or {MAX_SECONDS:g} s to "
                "compile); make it smaller, or use $ref to share repeated parts"
            )
        self.depth += 1
        try:
            return self._compile(schema)
        finally:
            self.depth -= 1

    def _compile(self, schema: Any) -> int:
        if schema is True or schema == {}:
            return self.any
        if schema is False or not isinstance(schema, dict):
            raise UnsupportedSchema(f"a schema must be an object or true, not {schema!r}")
        unknown = sorted(set(schema) - KNOWN)
        if unknown:
            raise UnsupportedSchema(f"schema keyword {unknown[0]!r} is not supported")
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self.literal(schema["const"])
        if "enum" in schema:
            return self.g.add(*[[self.literal(v)] for v in schema["enum"]])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                options = [
                    self.compile({**rest, **option}) if isinstance(option, dict) else self.compile(option)
                    for option in schema[key]
                ]
                return self.g.add(*[[o] for o in options])
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                merged = _merge(merged, self._resolve(part))
            return self.compile(merged)
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.g.add(*[[self.compile({**schema, "type": k})] for k in kind])
        if kind is None:
            if "properties" in schema or "additionalProperties" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                return self.any
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return self._string(schema)
        if kind == "number":
            return self.number
        if kind == "integer":
            return self._integer(schema)
        if kind == "boolean":
            return self.g.add("true", "false")
        if kind == "null":
            return self.g.add("null")
        raise UnsupportedSchema(f"unknown type {kind!r}")

    def _resolve(self, schema: Any) -> Any:
        if isinstance(schema, dict) and "$ref" in schema:
            return self._lookup(schema["$ref"])
        return schema

    def _lookup(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise UnsupportedSchema(f"only local $ref ('#/...') is supported, not {ref!r}")
        node: Any = self.root_schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise UnsupportedSchema(f"$ref {ref!r} points nowhere")
            node = node[part]
        return node

    def _ref(self, ref: str) -> int:
        if ref not in self.refs:
            rule = self.refs[ref] = self.g.add()
            target = self.compile(self._lookup(ref))
            self.g.define(rule, [target])
        return self.refs[ref]

    def _object(self, schema: dict[str, Any]) -> int:
        g, ws = self.g, self.ws
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties", not props)
        if not props:
            if extra is True or extra == {}:
                return self.any_object
            value = self.compile(extra) if extra else None
            if value is None:
                return g.add(["{", ws, "}"])
            member = g.add([self.string, ws, ":", ws, value])
            members = g.add([])
            g.define(members, [], [ws, ",", ws, member, members])
            return g.add(["{", ws, "}"], ["{", ws, member, members, ws, "}"])
        required = set(schema.get("required") or [])
        names = list(props)
        pairs = [g.add([json.dumps(n, ensure_ascii=True), ws, ":", ws, self.compile(props[n])]) for n in names]
        # head[k]: properties k.. with none written yet; tail[k]: the same after at least one. After the named ones,
        # additionalProperties' members (keys none of the names), where it allows them
        tail = g.add([])
        head = g.add([])
        if extra not in (False, None):
            value = self.any if extra is True or extra == {} else self.compile(extra)
            other = g.add([self._other_key(names), ws, ":", ws, value])
            g.define(tail, [], [ws, ",", ws, other, tail])
            g.define(head, [], [other, tail])
        for k in range(len(names) - 1, -1, -1):
            new_tail = g.add([ws, ",", ws, pairs[k], tail], *([[tail]] if names[k] not in required else []))
            new_head = g.add([pairs[k], tail], *([[head]] if names[k] not in required else []))
            tail, head = new_tail, new_head
        return g.add(["{", ws, head, ws, "}"])

    def _other_key(self, names: list[str]) -> int:
        """A key that is none of ``names``: a JSON string written without escapes (so no other spelling of a name),
        walking the names' characters while it follows one and leaving them by any other character."""
        g = self.g
        rest = g.add([])
        g.define(rest, ['"'], [("not", frozenset('"\\')), rest])

        def after(prefix: str) -> int:
            nexts = {n[len(prefix)] for n in names if len(n) > len(prefix) and n.startswith(prefix)}
            nexts = {c for c in nexts if c not in '"\\' and c >= " "}  # (a name's quote or backslash: escaped)
            alternatives = [] if prefix in names else [['"']]
            alternatives += [[("lit", c), after(prefix + c)] for c in sorted(nexts)]
            alternatives.append([("not", frozenset('"\\') | nexts), rest])
            return g.add(*alternatives)

        return g.add(['"', after("")])

    def _array(self, schema: dict[str, Any]) -> int:
        """Arrays of minItems..maxItems elements: element i matches prefixItems[i] where there is one, ``items``
        after them (``items: false``: no element past the prefix)."""
        g, ws = self.g, self.ws
        prefix = schema.get("prefixItems") or []
        if not isinstance(prefix, list):
            raise UnsupportedSchema(f"prefixItems must be a list of schemas, not {prefix!r}")
        rest = schema.get("items", True)
        low, high = _bounds(schema, "minItems", "maxItems")
        if rest is False:
            high = len(prefix) if high is None else min(high, len(prefix))
            if low > high:
                raise UnsupportedSchema(f"minItems {low} is above the {len(prefix)} prefixItems with items false")
        elements = [self.compile(p) for p in prefix]
        extra = self.compile(rest) if rest is not False else None
        explicit = max(len(prefix), low, 1)  # elements past these are all `items`, as many as maxItems leaves
        # tail: the elements after the first `explicit`, each ", item"
        if extra is None or (high is not None and high <= explicit):
            tail = g.add([])
        elif high is None:
            tail = g.add([])
            g.define(tail, [], [ws, ",", ws, extra, tail])
        else:
            tail = g.add([])
            for _ in range(high - explicit):
                tail = g.add([], [ws, ",", ws, extra, tail])
        # after[j]: the elements from index j on, once j of them are written (j >= 1)
        after = tail
        for j in range(explicit - 1, 0, -1):
            element = elements[j] if j < len(elements) else extra
            alternatives = [[ws, ",", ws, element, after]] if high is None or j < high else []
            after = g.add(*alternatives, *([[]] if j >= low else []))
        first = elements[0] if elements else extra
        alternatives = [["[", ws, "]"]] if low == 0 else []
        if first is not None and (high is None or high >= 1):
            alternatives.append(["[", ws, first, after, ws, "]"])
        return g.add(*alternatives)

    def _format(self, name: str) -> int:
        """A string of one of FORMATS: RFC 3339's full-date (a day its month has: 29 February in leap years only;
        years 0001-9999, as Python's dates), full-time (an offset, "Z" or +-hh:mm, required) and date-time, and
        RFC 4122's form of a uuid (hexadecimal digits 8-4-4-4-12)."""
        if not self.formats:
            g = self.g
            date = self._date()
            hour = g.add([("range", "0", "1"), DIGIT], ["2", ("range", "0", "3")])
            minute = [("range", "0", "5"), DIGIT]
            fraction = g.repeat(DIGIT, 1, 9)  # a fraction of a second: up to nine digits
            second = g.add(minute, [*minute, ".", *fraction])
            offset = g.add("Z", [("set", frozenset("+-")), hour, ":", *minute])
            time_ = g.add([hour, ":", *minute, ":", second, offset])
            uuid = [*[HEX] * 8, "-", *[HEX] * 4, "-", *[HEX] * 4, "-", *[HEX] * 4, "-", *[HEX] * 12]
            bodies = {"date": [date], "time": [time_], "date-time": [date, "T", time_], "uuid": uuid}
            self.formats = {each: g.add(['"', *body, '"']) for each, body in bodies.items()}
        return self.formats[name]

    def _date(self) -> int:
        """yyyy-mm-dd of a day that exists: a leap year (two last digits a multiple of 4 but 00, or 00 after two
        that are) takes 29 February."""
        g = self.g

        def one(chars: str) -> tuple:
            return ("set", frozenset(chars))

        # two digits that are a multiple of 4 other than 00, and two that are not a multiple of 4
        by_four = g.add(["0", one("48")], [one("2468"), one("048")], [one("13579"), one("26")])
        not_by_four = g.add([one("02468"), one("26")], [one("13579"), one("048")], [DIGIT, one("13579")])
        leap = g.add([DIGIT, DIGIT, by_four], [by_four, "00"])
        common = g.add([DIGIT, DIGIT, not_by_four], [not_by_four, "00"])
        tens = [("range", "1", "2"), DIGIT]  # days 10-29
        thirty_one = g.add(["0", NONZERO], tens, ["3", one("01")])
        thirty = g.add(["0", NONZERO], tens, "30")
        february = {
            days: g.add(["0", NONZERO], ["1", DIGIT], ["2", ("range", "0", last)])
            for days, last in ((28, "8"), (29, "9"))
        }
        month_day = {
            days: g.add(
                ["0", one("13578"), "-", thirty_one],
                ["1", one("02"), "-", thirty_one],
                ["0", one("469"), "-", thirty],
                ["11-", thirty],
                ["02-", february[days]],
            )
            for days in (28, 29)
        }
        return g.add([leap, "-", month_day[29]], [common, "-", month_day[28]])

    def _integer(self, schema: dict[str, Any]) -> int:
        """The integers within the schema's bounds: negative ones as "-" and a magnitude, the rest plainly."""
        low, high = _integer_bounds(schema)
        if low is None and high is None:
            return self.integer
        alternatives = []
        if low is None or low < 0:
            smallest = 1 if high is None or high >= 0 else -high
            if low is None or smallest <= -low:
                alternatives.append(["-", self._naturals(smallest, None if low is None else -low)])
        if high is None or high >= 0:
            alternatives.append([self._naturals(max(low or 0, 0), high)])
        return self.g.add(*alternatives)

    def _naturals(self, low: int, high: int | None) -> int:
        """Whole numbers from ``low`` to ``high`` (None: as many digits as an integer here may have), written without
        leading zeros: an alternative for each count of digits."""
        longest = MAX_DIGITS + 1
        top = 10**longest - 1 if high is None else min(high, 10**longest - 1)
        alternatives = []
        for length in range(len(str(low)), len(str(top)) + 1):
            first, last = max(low, 10 ** (length - 1) if length > 1 else 0), min(top, 10**length - 1)
            alternatives.append([self._span(str(first), str(last))])
        return self.g.add(*alternatives)

    def _span(self, a: str, b: str) -> int:
        """The digit strings of a's length from a to b (a <= b): the first digit at a's, between, or at b's, then
        the rest within what that first digit leaves."""
        if (a, b) in self.spans:
            return self.spans[(a, b)]
        g, rest = self.g, len(a) - 1
        if not a:
            rule = g.add([])
        elif a[0] == b[0]:
            rule = g.add([a[0], self._span(a[1:], b[1:])])
        else:
            from_bottom, to_top = a[1:] == "0" * rest, b[1:] == "9" * rest
            start = a[0] if from_bottom else chr(ord(a[0]) + 1)
            end = b[0] if to_top else chr(ord(b[0]) - 1)
            alternatives: list[list[Any]] = []
            if not from_bottom:
                alternatives.append([a[0], self._span(a[1:], "9" * rest)])
            if start <= end:
                alternatives.append([("range", start, end), self._span("0" * rest, "9" * rest)])
            if not to_top:
                alternatives.append([b[0], self._span("0" * rest, b[1:])])
            rule = g.add(*alternatives)
        self.spans[(a, b)] = rule
        return rule

    def _string(self, schema: dict[str, Any]) -> int:
        if "pattern" in schema:  # (as llama.cpp's grammars: minLength / maxLength not enforced beside it)
            if not isinstance(schema["pattern"], str):
                raise UnsupportedSchema(f"pattern must be a string, not {schema['pattern']!r}")
            return pattern_rule(self.g, schema["pattern"], self.char, UnsupportedSchema)
        if schema.get("format") in FORMATS:
            return self._format(schema["format"])
        low, high = _bounds(schema, "minLength", "maxLength")
        if low == 0 and high is None:
            return self.string
        return self.g.add(['"', *self.g.repeat(self.char, low, high), '"'])


def _bounds(schema: dict[str, Any], low_key: str, high_key: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise UnsupportedSchema(f"{key} must be a whole number of at least 0, not {value!r}")
        if value is not None and value > MAX_BOUND:
            raise UnsupportedSchema(f"{low_key} / {high_key} above {MAX_BOUND} are not supported")
    if high is not None and low > high:
        raise UnsupportedSchema(f"{low_key} {low} is above {high_key} {high}: nothing fits")
    return low, high


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and largest integer an integer schema allows (None: no bound), from minimum / maximum and
    exclusiveMinimum / exclusiveMaximum (numbers, or draft 4's booleans that make minimum / maximum exclusive)."""
    values = {}
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if value is None or (key.startswith("exclusive") and isinstance(value, bool)):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UnsupportedSchema(f"{key} must be a number, not {value!r}")
        values[key] = value
    lows, highs = [], []
    if "minimum" in values:
        lows.append(
            math.floor(values["minimum"]) + 1
            if schema.get("exclusiveMinimum") is True
            else math.ceil(values["minimum"])
        )
    if "exclusiveMinimum" in values:
        lows.append(math.floor(values["exclusiveMinimum"]) + 1)
    if "maximum" in values:
        highs.append(
            math.ceil(values["maximum"]) - 1
            if schema.get("exclusiveMaximum") is True
            else math.floor(values["maximum"])
        )
    if "exclusiveMaximum" in values:
        highs.append(math.ceil(values["exclusiveMaximum"]) - 1)
    low, high = max(lows, default=None), min(highs, default=None)
    bounds = ", ".join(f"{k} {v}" for k, v in values.items())
    if low is not None and high is not None and low > high:
        raise UnsupportedSchema(f"no integer fits the bounds ({bounds})")
    limit = 10 ** (MAX_DIGITS + 1) - 1  # the largest magnitude an integer is written with here
    if (low is not None and low > limit) or (high is not None and high < -limit):
        raise UnsupportedSchema(f"no integer of at most {MAX_DIGITS + 1} digits fits the bounds ({bounds})")
    return None if low is None else max(low, -limit), None if high is None else min(high, limit)


def _merge(a: dict[str, Any], b: Any) -> dict[str, Any]:
    if not isinstance(b, dict):
        raise UnsupportedSchema("allOf parts must be objects")
    out = {**a}
    for key, value in b.items():
        if key == "properties":
            out["properties"] = {**out.get("properties", {}), **value}
        elif key == "required":
            out["required"] = sorted(set(out.get("required", [])) | set(value))
        elif key in out and out[key] != value and key not in ANNOTATIONS:
            raise UnsupportedSchema(f"allOf parts disagree on {key!r}")
        else:
            out[key] = value
    return out


# --- tokens ----------------------------------------------------------------------------------------------------


class TokenTrie:
    """The vocabulary's token texts as a character trie; tokens with no whole-character text are left out."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self.root: dict[str, Any] = {}
        self.eog = [i for i in range(vocab_size) if tokenizer.is_eog(i)]
        for i in range(vocab_size):
            if tokenizer.is_eog(i) or tokenizer.is_control(i):
                continue
            try:
                text = tokenizer.piece(i).decode("utf-8")
            except (UnicodeDecodeError, ValueError):
                continue
            if not text:
                continue
            node = self.root
            for ch in text:
                node = node.setdefault(ch, {})
            node.setdefault(None, []).append(i)


class JSONConstraint:
    """A logits processor: ``(logits, generated_ids) -> logits`` with every token that would break the JSON at -inf."""

    def __init__(self, grammar: Grammar, trie: TokenTrie, tokenizer: Any):
        self.grammar = grammar
        self.trie = trie
        self.tokenizer = tokenizer
        self.state = grammar.start()
        self.consumed = 0
        self.masks: OrderedDict[State, np.ndarray] = OrderedDict()

    def __call__(self, logits: np.ndarray, generated: Sequence[int]) -> np.ndarray:
        for token in generated[self.consumed :]:
            self.feed(token)
        self.consumed = len(generated)
        allowed = self.mask(self.state)
        out = np.where(allowed[: logits.shape[-1]], logits, -np.inf)
        return out

    def feed(self, token: int) -> None:
        if self.tokenizer.is_eog(token):
            return
        try:
            text = self.tokenizer.piece(token).decode("utf-8")
        except (UnicodeDecodeError, ValueError):
            text = ""
        for ch in text:
            self.state = self.grammar.advance(self.state, ch)

    def mask(self, state: State) -> np.ndarray:
        found = self.masks.get(state)
        if found is not None:
            self.masks.move_to_end(state)
            return found
        allowed = np.zeros(self.trie.vocab_size, dtype=bool)
        if () in state or not state:
            allowed[self.trie.eog] = True
        if state:
            self._walk(self.trie.root, state, allowed)
        self.masks[state] = allowed
        if len(self.masks) > 256:
            self.masks.popitem(last=False)
        return allowed

    def _walk(self, node: dict[str, Any], state: State, allowed: np.ndarray) -> None:
        advance = self.grammar.advance
        todo = [(node, state)]
        while todo:
            node, state = todo.pop()
            for ch, child in node.items():
                if ch is None:
                    continue
                after = advance(state, ch)
                if after:
                    ids = child.get(None)
                    if ids:
                        allowed[ids] = True
                    if len(child) > (1 if ids else 0):
                        todo.append((child, after))


def compile_schema(schema: Any) -> Grammar:
    return _checked(SchemaCompiler(schema if schema is not None else True).g)


def compile_text(kind: str, value: Any) -> Grammar:
    """Plain text (not JSON): one of the strings of ``value`` (``kind`` "choice", vLLM's ``guided_choice``), the
    text a regular expression matches whole ("regex", its ``guided_regex``; :func:`leat_server.pattern.text_rule`),
    or the text a GBNF grammar writes ("grammar", llama-server's ``grammar``; :mod:`leat_server.gbnf`)."""
    g = Grammar()
    if kind == "grammar":
        if not isinstance(value, str):
            raise UnsupportedSchema(f"a grammar must be GBNF text, not {value!r}")
        g.root = gbnf_rule(g, value, UnsupportedSchema)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise UnsupportedSchema("give a list of one or more strings to choose from")
        g.root = g.add(*[[("lit", c) for c in choice] for choice in value])
    elif isinstance(value, str):
        g.root = text_rule(g, value, UnsupportedSchema)
    else:
        raise UnsupportedSchema(f"a regular expression must be a string, not {value!r}")
    return _checked(g)


def _checked(grammar: Grammar) -> Grammar:
    """``grammar`` with what can never be written dropped; refused (UnsupportedSchema) where nothing can, where it is
    left-recursive, or where one place opens too many alternatives."""
    _drop_unwritable(grammar)
    nullable = _nullable(grammar)
    _refuse_left_recursion(grammar, nullable)
    _refuse_wide_places(grammar, nullable)
    return grammar


def _fixpoint(g: Grammar, holds: Any) -> set[int]:
    """The least set of rules such that ``holds(alternative, found)`` for one of each member's alternatives."""
    found: set[int] = set()
    changed = True
    while changed:
        changed = False
        for rule, alternatives in enumerate(g.rules):
            if rule not in found and any(holds(a, found) for a in alternatives):
                found.add(rule)
                changed = True
    return found


def _drop_unwritable(g: Grammar) -> None:
    """Keep only alternatives whose every rule can produce some text; refuse a root that cannot."""
    productive = _fixpoint(g, lambda a, found: all(e in found for e in a if isinstance(e, int)))
    if g.root not in productive:
        raise UnsupportedSchema(
            "no JSON value satisfies the schema (an empty enum or anyOf, a required property that cannot exist, "
            "or a $ref that leads only back to itself?)"
        )
    g.rules = [[a for a in alts if all(e in productive for e in a if isinstance(e, int))] for alts in g.rules]


def _nullable(g: Grammar) -> set[int]:
    return _fixpoint(g, lambda a, found: all(isinstance(e, int) and e in found for e in a))


def _leading(alternative: tuple, nullable: set[int]) -> list[int]:
    """The rules that can start ``alternative`` before any character is written."""
    out = []
    for element in alternative:
        if not isinstance(element, int):
            break
        out.append(element)
        if element not in nullable:
            break
    return out


def _refuse_left_recursion(g: Grammar, nullable: set[int]) -> None:
    """A rule that can reach itself before writing anything would make the recognizer recurse without end."""
    leading = [[r for a in alts for r in _leading(a, nullable)] for alts in g.rules]
    state = [0] * len(g.rules)  # 0 unseen, 1 on the path, 2 done
    for start in range(len(g.rules)):
        if state[start]:
            continue
        state[start] = 1
        path = [(start, iter(leading[start]))]
        while path:
            rule, children = path[-1]
            child = next(children, None)
            if child is None:
                state[rule] = 2
                path.pop()
            elif state[child] == 1:
                raise UnsupportedSchema(
                    "the schema (a $ref) or grammar (a rule) refers to itself before writing anything: it never ends"
                )
            elif state[child] == 0:
                state[child] = 1
                path.append((child, iter(leading[child])))


def _refuse_wide_places(g: Grammar, nullable: set[int]) -> None:
    """Refuse a rule that opens too many parse stacks when expanded: every token mask walks each of them."""
    opens: dict[int, int] = {}
    for rule in range(len(g.rules)):
        todo = [rule]
        while todo:  # leading rules first; they are acyclic by now
            top = todo[-1]
            if top in opens:
                todo.pop()
                continue
            pending = [r for a in g.rules[top] for r in _leading(a, nullable) if r not in opens]
            if pending:
                todo.extend(pending)
                continue
            todo.pop()
            opens[top] = sum(_opens(a, nullable, opens) for a in g.rules[top])
            if opens[top] > MAX_ALTERNATIVES:
                raise UnsupportedSchema(
                    f"the schema allows over {MAX_ALTERNATIVES} alternatives at one place (a large enum or anyOf, or "
                    "nested ones); split it, or use a plain type there"
                )


def _opens(alternative: tuple, nullable: set[int], opens: dict[int, int]) -> int:
    total = 0
    for element in alternative:
        if not isinstance(element, int):
            return total + 1
        total += opens[element]
        if element not in nullable:
            return total
    return total + 1  # all of it can be empty: the stack ends here


def processor(service: Any, schema: Any, param: str, kind: str = "json") -> JSONConstraint:
    """A constraint for one request: JSON matching ``schema``, or for ``kind`` "choice" and "regex" plain text
    (:func:`compile_text` of ``schema``); what this module cannot enforce is a 400 naming ``param``."""
    try:
        grammar = compile_schema(schema) if kind == "json" else compile_text(kind, schema)
    except (UnsupportedSchema, TypeError, ValueError, LookupError, AttributeError, RecursionError) as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None
    constraint = JSONConstraint(grammar, _trie(service, service.tokenizer, service.model), service.tokenizer)
    constraint.mask(constraint.state)  # the first step's mask, made here rather than in the engine's step
    constraint.label = f"{param} constraint"
    # how an engine in another process rebuilds it (leat.engine_process)
    constraint.spec = (
        (f"{__name__}:rebuild", schema) if kind == "json" else (f"{__name__}:rebuild_text", [kind, schema])
    )
    return constraint


def rebuild(schema: Any, model: Any) -> JSONConstraint:
    """The constraint :func:`processor` made, rebuilt in an engine process from its spec's payload (the schema,
    already checked): ``leat.engine_process.build_processor`` imports and calls this."""
    return JSONConstraint(compile_schema(schema), _trie(model, model.tokenizer, model), model.tokenizer)


def rebuild_text(payload: list, model: Any) -> JSONConstraint:
    """:func:`rebuild` for a plain-text constraint, its payload ``[kind, value]``."""
    return JSONConstraint(compile_text(*payload), _trie(model, model.tokenizer, model), model.tokenizer)


def _trie(holder: Any, tokenizer: Any, model: Any) -> TokenTrie:
    """The vocabulary's trie, made once and kept on ``holder`` (the service, or the engine process's model)."""
    trie = getattr(holder, "_token_trie", None)
    if trie is None:
        trie = holder._token_trie = TokenTrie(tokenizer, model.architecture.vocab_size)
    return trie
