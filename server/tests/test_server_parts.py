"""The server's pieces without a server: request bodies, keys, receipts, constrained decoding."""

from __future__ import annotations

import itertools
import json
import re
import stat

import msgspec
import pytest
from leat.errors import LeatError
from leat.keys import KeyStore
from leat_server.errors import from_msgspec
from leat_server.receipts import Signer, body_hash, load_or_create_key, load_public_key, public_key_path, verify
from leat_server.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest


def test_bad_fields_name_the_field():
    cases = [
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}', ChatCompletionRequest, "max_tokens"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', ChatCompletionRequest, "messages[0].role"),
        (b'{"messages": [{"role": "user"}], "temperature": 3}', ChatCompletionRequest, "temperature"),
        (b'{"messages": [{"role": "user"}], "frobnicate": 1}', ChatCompletionRequest, "frobnicate"),
        (b'{"prompt": {"text": "a"}}', CompletionRequest, "prompt"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', MessagesRequest, "max_tokens"),
    ]
    for raw, kind, param in cases:
        with pytest.raises(msgspec.DecodeError) as info:
            msgspec.json.decode(raw, type=kind)
        error = from_msgspec(info.value)
        assert error.status == 400
        if param:
            assert error.param == param, error.message
    assert from_msgspec(msgspec.DecodeError("JSON is malformed")).code == "invalid_json"


def test_keys_are_shown_once_and_stored_as_hashes(tmp_path):
    path = tmp_path / "keys.json"
    store = KeyStore(path)
    key = store.add("laptop")
    assert key.startswith("leat_") and len(key) > 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key not in path.read_text()
    again = KeyStore(path)
    assert again.check(key) == "laptop"
    assert again.check(key + "x") is None and again.check(None) is None
    assert [k["name"] for k in again.list()] == ["laptop"]
    with pytest.raises(LeatError, match="exists"):
        again.add("laptop")
    again.remove("laptop")
    assert not KeyStore(path)
    with pytest.raises(LeatError, match="no key named"):
        again.remove("laptop")


class FakeFile:
    def sha256(self) -> str:
        return "ab" * 32


def test_receipts_verify_and_fail_after_any_change(tmp_path):
    key_path = tmp_path / "k.pem"
    signer = Signer(load_or_create_key(key_path), FakeFile(), "cpu")
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    public = load_public_key(public_key_path(key_path))
    body = {"id": "chatcmpl-1", "choices": [{"message": {"content": "Hello"}}], "usage": {"total_tokens": 3}}
    body["receipt"] = signer.sign({"model_sha256": signer.model_sha256(), "body_sha256": body_hash(body)})
    body = json.loads(json.dumps(body))  # as a client receives it
    assert verify(body, public)["model_sha256"] == "ab" * 32
    assert verify(body["receipt"], public)

    changed = json.loads(json.dumps(body))
    changed["choices"][0]["message"]["content"] = "Hellp"
    with pytest.raises(LeatError, match="altered"):
        verify(changed, public)
    changed = json.loads(json.dumps(body))
    changed["receipt"]["claims"]["model_sha256"] = "cd" * 32
    with pytest.raises(LeatError, match="signature"):
        verify(changed, public)
    changed = json.loads(json.dumps(body))
    sig = changed["receipt"]["signature"]
    changed["receipt"]["signature"] = ("B" if sig[0] != "B" else "C") + sig[1:]
    with pytest.raises(LeatError, match="signature"):
        verify(changed, public)
    other = (
        load_public_key(public_key_path(tmp_path / "other.pem")) if load_or_create_key(tmp_path / "other.pem") else None
    )
    with pytest.raises(LeatError, match="not by this public key"):
        verify(body, other)


def test_api_processes_racing_to_make_the_receipt_key_get_one_key(tmp_path):
    """Before: two API processes starting with --receipts and no key both made one; the second's exclusive create
    failed with a FileExistsError traceback and the process was restarted."""
    import threading

    from cryptography.hazmat.primitives import serialization

    keys, errors = [], []

    def make() -> None:
        try:
            keys.append(load_or_create_key(tmp_path / "key.pem"))
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    raw = {
        k.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        for k in keys
    }
    assert errors == [] and len(keys) == 8 and len(raw) == 1
    assert (tmp_path / "key.pem").stat().st_mode & 0o777 == 0o600
    public = load_public_key(public_key_path(tmp_path / "key.pem"))
    assert public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == keys[
        0
    ].public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.pem", "key.pub.pem"]  # no temporary file left


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer"},
        "note": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["city", "days"],
}


RANGED = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -7, "maximum": 23},
        "id": {"type": "string", "pattern": "^[A-Z]\\d{2}$"},
    },
    "required": ["n", "id"],
}


def test_schema_grammar_accepts_exactly_the_matching_json():
    from leat_server.constrained import UnsupportedSchema, compile_schema

    g = compile_schema(SCHEMA)
    good = [
        '{"city": "Paris", "days": 3}',
        '{"city":"Rome","days":-1,"note":"ok","tags":[true,false]}',
        '{\n  "city": "Rome",\n  "days": 0\n}',
    ]
    bad = [
        '{"days": 3}',
        '{"city": "Oslo", "days": 3}',
        '{"city": "Rome", "days": 1.5}',
        '{"city": "Rome", "days": 1, "note": "far too long"}',
        '{"city": "Rome", "days": 1, "tags": [true, true, true]}',
        '{"city": "Rome", "days": 1, "extra": 1}',
        '{"city": "Rome", "days": 1',
    ]
    assert all(g.accepts(t) for t in good)
    assert not any(g.accepts(t) for t in bad)
    anything = compile_schema({"type": "object"})
    assert anything.accepts('{"a": [1, 2.5e3, {"b": null}], "c": "\\u00e9"}') and not anything.accepts("[1]")
    linked = {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
                "required": ["next"],
            }
        },
        "$ref": "#/$defs/n",
    }
    assert compile_schema(linked).accepts('{"next": {"next": null}}')
    with pytest.raises(UnsupportedSchema, match="patternProperties"):
        compile_schema({"type": "object", "patternProperties": {"^a": {"type": "integer"}}})


def test_integer_bounds_are_enforced_digit_by_digit():
    """minimum / maximum and their exclusive forms on integers: exactly the integers within them, written as JSON
    writes them (no leading zeros, no "-0"), against Python's comparison of every integer in a window."""
    import itertools
    import random

    from leat_server.constrained import UnsupportedSchema, compile_schema

    def allows(schema: dict, low, high, numbers) -> None:
        g = compile_schema({"type": "integer", **schema})
        for n in numbers:
            assert g.accepts(str(n)) == ((low is None or n >= low) and (high is None or n <= high)), (schema, n)
        for text in ("-0", "00", "01", "-01", "+1", "1.0", "1e2", ""):
            assert not g.accepts(text), (schema, text)

    ends = [None, -101, -100, -99, -9, -1, 0, 1, 9, 10, 99, 100, 1234]
    for low, high in itertools.product(ends, ends):
        if (low is None and high is None) or (None not in (low, high) and low > high):
            continue
        bounds = {k: v for k, v in (("minimum", low), ("maximum", high)) if v is not None}
        allows(bounds, low, high, range(-1300, 1300))
    r = random.Random(0)
    wide = [r.randrange(-(10**17) + 1, 10**17) for _ in range(300)]
    for _ in range(10):
        low, high = sorted(r.randrange(-(10**16), 10**16) for _ in range(2))
        allows({"minimum": low, "maximum": high}, low, high, wide + [low - 1, low, low + 1, high - 1, high, high + 1])
    allows({"minimum": 2.5, "maximum": 7.5}, 3, 7, range(-20, 20))
    allows({"exclusiveMinimum": 2.5, "exclusiveMaximum": 7}, 3, 6, range(-20, 20))
    allows({"minimum": 2, "exclusiveMinimum": True, "maximum": 7, "exclusiveMaximum": True}, 3, 6, range(-20, 20))
    allows({"minimum": 0, "exclusiveMinimum": 4}, 5, None, range(-20, 20))
    allows({"maximum": 1e300}, None, 10**17 - 1, [10**17 - 1, 10**17, -(10**17) + 1])
    assert compile_schema({"type": ["integer", "null"], "minimum": 1}).accepts("null")
    assert compile_schema({"type": "number", "maximum": 3}).accepts("4.5")  # numbers' bounds are not enforced
    for bounds, message in (
        ({"minimum": 5, "maximum": 1}, "no integer fits the bounds"),
        ({"exclusiveMinimum": 3, "exclusiveMaximum": 4}, "no integer fits the bounds"),
        ({"minimum": 1e300}, "at most 17 digits"),
        ({"maximum": "9"}, "maximum must be a number"),
    ):
        with pytest.raises(UnsupportedSchema, match=message):
            compile_schema({"type": "integer", **bounds})


def test_additional_properties_beside_named_ones_take_only_other_keys():
    """additionalProperties with properties (pydantic's extra="allow"): after the named members, members whose keys
    are none of the names (written without escapes, so no other spelling of one), each value of its schema."""
    from leat_server.constrained import compile_schema

    names = ["ab", "a", "b", "é", 'q"']
    g = compile_schema(
        {
            "type": "object",
            "properties": {n: {"const": 0} for n in names},
            "additionalProperties": {"const": 1},
        }
    )
    for key in ["".join(t) for n in range(4) for t in itertools.product(["a", "b", "é", '"', "q"], repeat=n)]:
        assert g.accepts("{" + json.dumps(key, ensure_ascii=False) + ": 1}") == (key not in names and '"' not in key), (
            key
        )
        assert g.accepts("{" + json.dumps(key) + ": 0}") == (key in names), key  # names as json.dumps writes them
    assert g.accepts('{"a": 0, "x": 1, "y": 1}') and not g.accepts('{"x": 1, "a": 0}')  # named members first
    assert not g.accepts('{"\\u0061": 1}')  # a name spelled with an escape
    anything = compile_schema({"type": "object", "properties": {"a": {"const": 0}}, "additionalProperties": True})
    assert anything.accepts('{"a": 0, "z": [1, {"q": null}]}')


def test_prefix_items_and_item_bounds_allow_exactly_the_valid_arrays():
    """prefixItems (each element its own schema), then items (or none past the prefix with items false), within
    minItems / maxItems: every array of up to six elements from three values, against a direct check."""
    from leat_server.constrained import UnsupportedSchema, compile_schema

    one, bee, flag = {"const": 1}, {"const": "b"}, {"type": "boolean"}
    values = [1, "b", True]

    def fits(schema, value) -> bool:
        return schema is True or (value is True if schema is flag else value == schema["const"] and value is not True)

    def valid(schema: dict, array: list) -> bool:
        prefix, rest = schema.get("prefixItems", []), schema.get("items", True)
        if len(array) < schema.get("minItems", 0) or len(array) > schema.get("maxItems", len(array)):
            return False
        schemas = [prefix[i] if i < len(prefix) else rest for i in range(len(array))]
        return all(each is not False and fits(each, value) for each, value in zip(schemas, array))

    arrays = [list(a) for n in range(7) for a in itertools.product(values, repeat=n)]
    for prefix in ([], [one], [one, bee, flag]):
        for rest in (None, False, one):
            for low, high in itertools.product((None, 1, 3), (None, 0, 2, 5)):
                schema = {"type": "array", **({"prefixItems": prefix} if prefix else {})}
                schema |= {k: v for k, v in (("items", rest), ("minItems", low), ("maxItems", high)) if v is not None}
                if not any(valid(schema, a) for a in arrays):
                    with pytest.raises(UnsupportedSchema):
                        compile_schema(schema)
                    continue
                g = compile_schema(schema)
                for a in arrays:
                    assert g.accepts(json.dumps(a)) == valid(schema, a), (schema, a)


def test_date_time_and_uuid_formats_are_written_as_python_reads_them():
    """format date / time / date-time / uuid: a date is one Python's calendar has (29 February in leap years only);
    times carry an offset; a uuid is 8-4-4-4-12 hexadecimal digits. Other formats stay unenforced."""
    import datetime
    import uuid

    from leat_server.constrained import compile_schema

    date, time_, moment, ident = (
        compile_schema({"type": "string", "format": f}) for f in ("date", "time", "date-time", "uuid")
    )
    for year in (1, 4, 100, 400, 1900, 2000, 2023, 2024, 2100, 9999):
        for month, day in itertools.product(range(14), range(33)):
            text = f"{year:04d}-{month:02d}-{day:02d}"
            try:
                exists = bool(datetime.date.fromisoformat(text))
            except ValueError:
                exists = False
            assert date.accepts(f'"{text}"') == exists, text
    assert not date.accepts('"0000-01-01"')
    for text in ("12:34:56Z", "23:59:59+01:00", "00:00:00.5-12:30", "12:34:56.123456789Z"):
        assert time_.accepts(f'"{text}"') and datetime.time.fromisoformat(text.replace("Z", "+00:00"))
    for text in ("12:34:56", "24:00:00Z", "12:60:00Z", "12:34:56.Z", "1:02:03Z", "12:34:56.1234567890Z"):
        assert not time_.accepts(f'"{text}"'), text
    assert moment.accepts('"2024-02-29T07:08:09.25+02:00"') and not moment.accepts('"2023-02-29T07:08:09Z"')
    assert not moment.accepts('"2024-05-06 07:08:09Z"') and not moment.accepts('"2024-05-06"')
    for text in (str(uuid.UUID(int=7)), "ABCDEFAB-CDEF-abcd-ef01-234567890abc"):
        assert ident.accepts(f'"{text}"') and uuid.UUID(text)
    assert not ident.accepts(f'"{uuid.UUID(int=7).hex}"') and not ident.accepts('"123e4567-e89b-12d3-a456-42661417400"')
    assert compile_schema({"type": "string", "format": "email"}).accepts('"not an address"')


PATTERNS = [
    "^a$", "a", "^ab*$", "^(ab|1)+$", "^[a-b1]{2,3}$", "^[^a]*$", "^\\d+$", "^\\w*$", "^\\s?a$", "^.*$", "^a.b$",
    '^["\\\\]+$', "^(?:a|b)?1$", "^a{2}$", "^a{1,}b$", "^[\\-_]+$", "b$", "^1", "^$", "^\\D\\W$", "^[^\\d\\s]+$",
    "^a*?b+?$", "^é+$", "^[a-]$", "^\\.$", "^(a|)b$", "^\\S$",
]  # fmt: skip


def test_a_pattern_allows_exactly_the_strings_it_matches():
    """A string's pattern against Python's re (ASCII classes, as ECMA-262's; a pattern without ^ or $ searched for):
    every string of up to three characters from ten (quote, backslash, newline and a non-ASCII letter among them),
    written as JSON writes it. What the rules cannot take is a 400 naming it."""
    from leat_server.constrained import UnsupportedSchema, compile_schema

    alphabet = ["a", "b", "1", "_", '"', "\\", " ", "-", "\n", "é"]
    strings = ["".join(t) for n in range(4) for t in itertools.product(alphabet, repeat=n)]
    for pattern in PATTERNS:
        g = compile_schema({"type": "string", "pattern": pattern})
        anchored = pattern[:-1] + "\\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
        reference = re.compile(anchored, re.ASCII)
        for text in strings:
            assert g.accepts(json.dumps(text, ensure_ascii=False)) == bool(reference.search(text)), (pattern, text)
    for pattern, why in (
        ("^(?=a)$", "lookaround"),
        ("^\\1$", "\\1 is not supported"),
        ("^a\\b$", "\\b is not supported"),
        ("^a^b$", "only at the pattern's ends"),
        ("^*$", "repeats nothing"),
        ("^(a$", "ends too soon"),
        ("^[b-a]$", "reversed"),
        ("^a{999}$", "repeat count"),
        ("^\\p{L}$", "\\p is not supported"),
    ):
        with pytest.raises(UnsupportedSchema, match=re.escape(why)):
            compile_schema({"type": "string", "pattern": pattern})


def test_guided_regex_and_choice_allow_exactly_the_matching_text():
    """vLLM's guided_regex (plain text the expression matches whole; ^ and $ change nothing) against Python's
    re.fullmatch, and guided_choice (one of the strings, nothing longer)."""
    from leat_server.constrained import UnsupportedSchema, compile_text

    alphabet = ["a", "b", "1", "_", '"', "\\", " ", "-", "\n", "é"]
    strings = ["".join(t) for n in range(4) for t in itertools.product(alphabet, repeat=n)]
    for pattern in PATTERNS:
        g = compile_text("regex", pattern)
        body = pattern.removeprefix("^")
        body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
        reference = re.compile(body, re.ASCII)
        for text in strings:
            assert g.accepts(text) == bool(reference.fullmatch(text)), (pattern, text)
    choices = compile_text("choice", ["yes", "no", 'say "no"', ""])
    assert all(choices.accepts(t) for t in ("yes", "no", 'say "no"', ""))
    assert not any(choices.accepts(t) for t in ("ye", "yess", "noyes", "No"))
    for kind, value in (("choice", []), ("choice", ["a", 1]), ("regex", 5), ("regex", "(a")):
        with pytest.raises(UnsupportedSchema):
            compile_text(kind, value)


ARITHMETIC = """
# sums of numbers and groups, over several lines as llama.cpp's grammars are written
root ::= expr
expr ::= term (
    "+" term   # more terms
  )*
term ::= [0-9]+ | "(" expr ")"
"""


def sums(text: str) -> bool:
    """Whether ``text`` is a sum of numbers and parenthesized sums (ARITHMETIC's language), by recursive descent."""
    at = 0

    def expr() -> bool:
        nonlocal at
        if not term():
            return False
        while text[at : at + 1] == "+":
            at += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal at
        if text[at : at + 1].isdigit():
            while text[at : at + 1].isdigit():
                at += 1
            return True
        if text[at : at + 1] != "(":
            return False
        at += 1
        if not expr() or text[at : at + 1] != ")":
            return False
        at += 1
        return True

    return expr() and at == len(text)


def test_a_gbnf_grammar_allows_exactly_its_language():
    """llama-server's ``grammar`` (GBNF): every string of up to seven characters of "1+()" against a recursive-
    descent reader of the same language; escapes, classes and repeats; what cannot be taken is refused by line."""
    from leat_server.constrained import UnsupportedSchema, compile_text

    g = compile_text("grammar", ARITHMETIC)
    for n in range(8):
        for t in itertools.product("1+()", repeat=n):
            assert g.accepts("".join(t)) == sums("".join(t)), "".join(t)
    escapes = compile_text("grammar", 'root ::= "a\\n\\"\\x41\\u00e9" [^a-c\\]]{2,3} ws\nws ::= [ \\t]*')
    assert escapes.accepts('a\n"Aédd') and escapes.accepts('a\n"Aé!!! \t')
    assert not any(escapes.accepts(t) for t in ('a\n"Aéad', 'a\n"Aé]d', 'a\n"Aéd', 'a\n"Aédddd'))
    for grammar, why in (
        ("root ::= x", "'x' is used but not defined"),
        ('a ::= "x"', "no root rule"),
        ('root ::= "x"\nroot ::= "y"', "line 2: the rule 'root' is defined twice"),
        ("root ::= <[12]>", "token references"),
        ('root ::= ("x"', "not closed"),
        ('root ::= root "x" | "y"', "refers to itself"),
    ):
        with pytest.raises(UnsupportedSchema, match=re.escape(why)):
            compile_text("grammar", grammar)


def test_constrained_sampling_makes_a_random_model_write_valid_json(tmp_path):
    """A random-weight model, sampled at temperature 1, writes JSON that parses and matches the schema."""
    import numpy as np
    from leat.batch import Batch, Row
    from leat.model import load
    from leat.sampling import Sampler, SamplingParams
    from leat.testing import write_tiny_gguf
    from leat_arch_llama.llama import Llama
    from leat_server.constrained import JSONConstraint, TokenTrie, compile_schema

    model = load(str(write_tiny_gguf(Llama, tmp_path / "tiny.gguf")), backend="cpu")
    trie = TokenTrie(model.tokenizer, model.architecture.vocab_size)
    prompt = model.chat_prompt([{"role": "user", "content": "weather?"}])
    for schema, seed in ((SCHEMA, 0), (SCHEMA, 1), (RANGED, 0), (RANGED, 1)):
        constraint = JSONConstraint(compile_schema(schema), trie, model.tokenizer)
        sampler = Sampler.build(SamplingParams(temperature=1.0, seed=seed))
        kv = model.new_kv(len(prompt) + 120)
        row = model.architecture.forward(Batch([Row(0, 0, np.asarray(prompt))]), kv)
        out: list[int] = []
        for _ in range(120):
            logits = constraint(model.backend.to_host(row)[-1].astype(np.float64), out)
            token = sampler.sample(logits, prompt + out)
            if model.tokenizer.is_eog(token):
                break
            out.append(token)
            row = model.architecture.forward(Batch([Row(0, len(prompt) + len(out) - 1, np.asarray([token]))]), kv)
        value = json.loads(model.tokenizer.decode(out))
        if schema is RANGED:
            assert set(value) == {"n", "id"} and isinstance(value["n"], int) and -7 <= value["n"] <= 23, value
            assert re.fullmatch("[A-Z][0-9]{2}", value["id"]), value
            continue
        assert value["city"] in ("Paris", "Rome") and isinstance(value["days"], int)
        assert set(value) <= set(SCHEMA["properties"])
        assert len(value.get("note", "")) <= 8 and len(value.get("tags", [])) <= 2


STAGE_PLUGIN = """
from typing import Annotated
import msgspec
from leat import hookimpl
from leat.sampling import Stage


class HalveParams(msgspec.Struct, kw_only=True):
    halve_below: Annotated[float, msgspec.Meta(le=0, description="halves logits below this")] = -100.0


class Halve(Stage):
    name = "halve"
    Params = HalveParams
    order = 75


@hookimpl
def register_samplers(register):
    register("halve", "leat_halve_stage:Halve")
"""


def test_bodies_take_and_document_the_fields_stages_declare(tmp_path, monkeypatch):
    import importlib

    from leat.plugins import PluginHost
    from leat_server.app import request_bodies

    (tmp_path / "leat_halve_stage.py").write_text(STAGE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost(["leat-samplers"], extra={"leat-halve": importlib.import_module("leat_halve_stage")})
    bodies = request_bodies(host)
    chat = bodies["/v1/chat/completions"]
    body = msgspec.json.decode(
        b'{"messages": [{"role": "user", "content": "x"}], "halve_below": -3, "top_k": 5}', type=chat
    )
    assert (body.halve_below, body.top_k) == (-3.0, 5)
    with pytest.raises(msgspec.ValidationError, match=r"<= 0.*halve_below"):
        msgspec.json.decode(b'{"halve_below": 2}', type=bodies["/v1/completions"])
    schema = msgspec.json.schema(chat)["$defs"]["ChatCompletionRequest"]["properties"]
    assert "halves logits below this" in json.dumps(schema["halve_below"])
    assert "min_p" in schema and "repeat_last_n" in schema
    without = request_bodies(PluginHost(["leat-samplers"]))["/v1/chat/completions"]
    with pytest.raises(msgspec.ValidationError, match="halve_below"):
        msgspec.json.decode(b'{"halve_below": -3}', type=without)


def test_the_step_log_appends_each_recorded_step_once_as_a_json_line(tmp_path):
    import json
    import time
    from types import SimpleNamespace

    from leat.engine import StepProfile
    from leat_server.steplog import StepLog

    now = time.perf_counter()
    engine = SimpleNamespace(profile=[StepProfile(3, 200, 0.01, 0.02, 0.001, None, now, 197)])
    path = tmp_path / "steps.jsonl"
    log = StepLog(engine, str(path))
    log.write()
    assert engine.profile == []  # written steps leave the engine's list
    engine.profile.append(StepProfile(3, 3, 0.001, 0.004, 0.001, 0.0035, now + 0.01, 0))
    log.write()
    log.write()  # nothing new: nothing written
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["rows"], x["tokens"], x["prompt_tokens"], x["device"]) for x in lines] == [
        (3, 200, 197, None),
        (3, 3, 0, 0.0035),
    ]
    assert abs(lines[0]["time"] - time.time()) < 5 and 0.009 < lines[1]["time"] - lines[0]["time"] < 0.011


def test_a_step_log_that_cannot_be_written_fails_at_start_up(tmp_path):
    from types import SimpleNamespace

    from leat_server.steplog import StepLog

    with pytest.raises(OSError):
        StepLog(SimpleNamespace(profile=[]), str(tmp_path / "missing" / "steps.jsonl"))
