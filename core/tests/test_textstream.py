"""TextStream: token ids to released text, cut at the first stop string, never releasing what may become one."""

import pytest
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
from leat.textstream import TextStream, find_first, held_prefix
from leat.tokenizer import Tokenizer
from leat_arch_llama.llama import Llama


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_tiny_gguf(Llama, tmp_path_factory.mktemp("textstream") / "tiny.gguf", params=Llama.tiny())
    return Tokenizer.from_metadata(ModelFile(path).metadata)


def byte_ids(text: str) -> list[int]:
    """The tiny vocabulary's first 256 ids are its bytes: one id per byte of ``text``."""
    return list(text.encode())


def one_at_a_time(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.feed([token]) for token in ids]


def test_without_stops_the_text_is_the_decoded_ids(tokenizer):
    ids = tokenizer.encode("Hello there, wide world", add_special=False) + byte_ids(" caf\u00e9 \u65e5\u672c")
    stream = TextStream(tokenizer)
    pieces = one_at_a_time(stream, ids)
    assert "".join(pieces) + stream.flush() == tokenizer.decode(ids, skip_special=True)
    assert stream.ids_read == len(ids) and not stream.stopped and stream.matched is None


def test_incomplete_utf8_is_held_until_complete_or_the_end(tokenizer):
    stream = TextStream(tokenizer)
    assert one_at_a_time(stream, byte_ids("\u65e5")) == ["", "", "\u65e5"]  # three bytes, one character
    assert stream.feed(byte_ids("\u65e5")[:2]) == ""
    assert stream.flush() == "\ufffd"  # cut short: the replacement character, as decode() gives


def test_a_possible_stop_is_held_back_and_the_first_stop_cuts(tokenizer):
    stream = TextStream(tokenizer, ["STOP", "\n\n"])
    ids = byte_ids("abc STOX more\n\nafter STOP")
    pieces = one_at_a_time(stream, ids)
    assert "S" not in "".join(pieces[: len("abc STO")])  # "STO" may begin "STOP"
    assert "".join(pieces[: len("abc STOX")]) == "abc STOX"
    assert "".join(pieces) == "abc STOX more"
    assert stream.stopped and stream.matched == "\n\n"
    assert stream.ids_read == len("abc STOX more\n\n")  # the id that completed the stop is the last one read
    assert stream.feed(byte_ids("more")) == "" and stream.flush() == ""


def test_one_feed_of_many_ids_equals_one_at_a_time(tokenizer):
    text = "the stop word ends it here; not here"
    ids = tokenizer.encode(text, add_special=False)
    single = TextStream(tokenizer, ["ends it", "zzz"])
    batched = TextStream(tokenizer, ["ends it", "zzz"])
    assert "".join(one_at_a_time(single, ids)) == batched.feed(ids) == "the stop word "
    assert batched.ids_read == single.ids_read < len(ids) and batched.matched == "ends it"


def test_a_held_tail_comes_out_at_the_end_and_a_stop_in_it_still_cuts(tokenizer):
    stream = TextStream(tokenizer, ["STOP"])
    assert stream.feed(byte_ids("done ST")) == "done"  # " ST": the decoder holds a space, the stream "ST"
    assert stream.flush() == " ST" and not stream.stopped
    stream = TextStream(tokenizer, ["ST"])
    assert stream.feed(byte_ids("done ST")) + stream.flush() == "done " and stream.matched == "ST"


def test_special_tokens_are_text_only_when_asked(tokenizer):
    ids = byte_ids("hi") + [tokenizer.eos_id] + byte_ids("yo")
    assert TextStream(tokenizer).feed(ids) == "hiyo"
    kept = TextStream(tokenizer, ["<|im_end|>"], skip_special=False)
    assert kept.feed(ids) == "hi" and kept.matched == "<|im_end|>"


def test_markers_helpers():
    assert held_prefix("xx<tool_ca", ["<tool_call>"]) == len("<tool_ca")
    assert held_prefix("aaa", ["aab"]) == 2
    assert find_first("a STOP b \n\n", ["\n\n", "STOP"]) == (2, "STOP")
    assert find_first("nothing", ["STOP"]) == (-1, "")
