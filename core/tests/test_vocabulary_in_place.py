"""A vocabulary stays where the GGUF file has it (leat.modelfile.StringArray) and the tokenizer indexes it without a
Python string or dict entry per token: read back against gguf-py's own reader, and the memory the tokenizer keeps
measured. Tokenization itself is checked against llama.cpp in test_tokenizer.py (real models read by ModelFile)."""

import tracemalloc

import gguf
import pytest
from leat.modelfile import ModelFile, StringArray
from leat.tokenizer import Tokenizer

KEYS = gguf.Keys.Tokenizer


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet (bytes_to_unicode): printable bytes stand for themselves, the rest from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = iter(range(0x100, 0x200))
    return [chr(b) if b in printable else chr(next(rest)) for b in range(256)]


def _vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of ~5k tokens: the 256 byte symbols, merges of letters into pairs and triples,
    a non-ASCII text, a control token and one text twice (its last id answers, as a dict built in order would)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens, merges = _byte_symbols(), []
    pairs = [first + second for first in letters for second in letters]
    for pair in pairs:
        merges.append(f"{pair[0]} {pair[1]}")
        tokens.append(pair)
    for i, pair in enumerate(pairs * 6):
        merges.append(f"{pair} {letters[i // len(pairs)]}")
        tokens.append(pair + letters[i // len(pairs)])
    tokens += ["é中文", "<|end|>", "ab"]  # "ab" again
    return tokens, merges


@pytest.fixture(scope="module")
def vocabulary_file(tmp_path_factory):
    tokens, merges = _vocabulary()
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2)
    writer.add_array("general.tags", ["short", "list"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_string_arrays_are_read_in_place_and_equal_gguf_py(vocabulary_file):
    metadata = ModelFile(vocabulary_file).metadata
    upstream = gguf.GGUFReader(vocabulary_file).fields
    for key in (KEYS.LIST, KEYS.MERGES):
        strings, expected = metadata[key], upstream[key].contents()
        assert isinstance(strings, StringArray) and len(strings) == len(expected) > 1024
        assert strings == expected and list(strings) == expected
        assert strings[-1] == expected[-1] and strings[5:9] == expected[5:9]
        with pytest.raises(IndexError):
            strings[len(expected)]
    assert metadata["general.tags"] == ["short", "list"] and isinstance(metadata["general.tags"], list)
    assert metadata[KEYS.LIST].empty() == []


def test_file_and_tokenizer_keep_no_string_per_token(vocabulary_file):
    tokens, merges = _vocabulary()
    tracemalloc.start()
    try:
        file = ModelFile(vocabulary_file)
        tokenizer = Tokenizer.from_metadata(file.metadata)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # a Python string per token and merge (~60 bytes) and dicts of them (~60 bytes an entry) kept ~130 bytes each
    assert kept < 40 * (len(tokens) + len(merges)), kept
    last = {text: token for token, text in enumerate(tokens)}
    assert all(tokenizer.token_id(text) == token for text, token in last.items())
    assert tokenizer.token_id("ab") == len(tokens) - 1 and tokenizer.token_text(257) == "ab"
    assert tokenizer.token_id("no such token") is None
    # "a b" is the lowest-ranked pair of "abz" and no merge joins "ab" and "z"; "ab c" does join "ab" and "c"
    assert tokenizer.encode("abz", add_special=False) == [tokenizer.token_id("ab"), tokenizer.token_id("z")]
    assert tokenizer.encode("abc", add_special=False) == [tokenizer.token_id("abc")]
