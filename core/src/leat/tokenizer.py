"""Tokenizer built from GGUF ``tokenizer.ggml.*`` metadata that tokenizes exactly as llama.cpp does.

Two vocabulary types are supported, mirroring llama.cpp's ``src/llama-vocab.cpp``:

* ``gpt2``: byte-level BPE. Text is split by the pre-tokenizer that ``tokenizer.ggml.pre`` names (llama.cpp's
  hand-written splitters for the GPT-2, Llama 3, Qwen 2 and Qwen 3.5 patterns, and an emulation of its
  ``std::regex`` fallback for the rest), each piece is byte-encoded and then merged by BPE rank.
* ``llama``: SentencePiece (llm_tokenizer_spm): score-driven bigram merging over the whole text with
  ``<0xAB>`` byte fallback.

Special tokens are split out first (llama.cpp's ``tokenizer_st_partition``), token attributes and the
end-of-generation set follow llama.cpp's load-time rules, and decoding follows ``llama_detokenize``.
"""

from __future__ import annotations

import bisect
import codecs
import heapq
import re
import unicodedata
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from leat.errors import ModelFileError
from leat.modelfile import StringArray

_KEYS = gguf.Keys.Tokenizer
_GENERAL_NAME = gguf.Keys.General.NAME
_GENERAL_ARCHITECTURE = gguf.Keys.General.ARCHITECTURE

# llama_token_type, as stored in tokenizer.ggml.token_type
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_UNUSED, _TYPE_BYTE = 1, 2, 3, 4, 5, 6

# llama_token_attr bits
_ATTR_UNKNOWN = 1 << 0
_ATTR_UNUSED = 1 << 1
_ATTR_NORMAL = 1 << 2
_ATTR_CONTROL = 1 << 3
_ATTR_USER_DEFINED = 1 << 4
_ATTR_BYTE = 1 << 5
_ATTR_LSTRIP = 1 << 7
_ATTR_RSTRIP = 1 << 8

_ATTR_OF_TYPE = {
    _TYPE_NORMAL: _ATTR_NORMAL,
    _TYPE_UNKNOWN: _ATTR_UNKNOWN,
    _TYPE_CONTROL: _ATTR_CONTROL,
    _TYPE_USER_DEFINED: _ATTR_USER_DEFINED,
    _TYPE_UNUSED: _ATTR_UNUSED,
    _TYPE_BYTE: _ATTR_BYTE,
}

_SPACE_MARKER = "\u2581"  # SentencePiece's "▁"
_C_ISSPACE = " \t\n\v\f\r"

# ---------------------------------------------------------------------------------------------------------
# Unicode code point flags, as llama.cpp's unicode_cpt_flags (src/unicode.h, unicode-data.cpp)
# ---------------------------------------------------------------------------------------------------------

_UNDEFINED, _NUMBER, _LETTER, _SEPARATOR, _MARK, _PUNCTUATION, _SYMBOL, _CONTROL = 1, 2, 4, 8, 16, 32, 64, 128
_WHITESPACE = 0x100

_CATEGORY_FLAGS = {
    "Cn": _UNDEFINED,
    "Cc": _CONTROL,
    "Cf": _CONTROL,
    "Co": _CONTROL,
    "Cs": _CONTROL,
    "L": _LETTER,
    "M": _MARK,
    "N": _NUMBER,
    "P": _PUNCTUATION,
    "S": _SYMBOL,
    "Z": _SEPARATOR,
}

# llama.cpp's unicode_set_whitespace (not Python's str.isspace: 0x1C-0x1F are not whitespace there).
_WHITESPACE_CODEPOINTS = frozenset(
    [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F]
    + [0x205F, 0x3000]
)

# llama.cpp's tables are generated from Unicode 15.1; Python 3.11's unicodedata is Unicode 14.0. These are the
# code points whose category differs (all assigned in 15.0/15.1), with llama.cpp's flag.
_NEWER_UNICODE_RANGES = (
    (0x00CF3, 0x00CF3, _MARK),
    (0x00ECE, 0x00ECE, _MARK),
    (0x02FFC, 0x02FFF, _SYMBOL),
    (0x031EF, 0x031EF, _SYMBOL),
    (0x10EFD, 0x10EFF, _MARK),
    (0x1123F, 0x11240, _LETTER),
    (0x11241, 0x11241, _MARK),
    (0x11B00, 0x11B09, _PUNCTUATION),
    (0x11F00, 0x11F01, _MARK),
    (0x11F02, 0x11F02, _LETTER),
    (0x11F03, 0x11F03, _MARK),
    (0x11F04, 0x11F10, _LETTER),
    (0x11F12, 0x11F33, _LETTER),
    (0x11F34, 0x11F3A, _MARK),
    (0x11F3E, 0x11F42, _MARK),
    (0x11F43, 0x11F4F, _PUNCTUATION),
    (0x11F50, 0x11F59, _NUMBER),
    (0x1342F, 0x1342F, _LETTER),
    (0x13439, 0x1343F, _CONTROL),
    (0x13440, 0x13440, _MARK),
    (0x13441, 0x13446, _LETTER),
    (0x13447, 0x13455, _MARK),
    (0x1B132, 0x1B132, _LETTER),
    (0x1B155, 0x1B155, _LETTER),
    (0x1D2C0, 0x1D2D3, _NUMBER),
    (0x1DF25, 0x1DF2A, _LETTER),
    (0x1E030, 0x1E06D, _LETTER),
    (0x1E08F, 0x1E08F, _MARK),
    (0x1E4D0, 0x1E4EB, _LETTER),
    (0x1E4EC, 0x1E4EF, _MARK),
    (0x1E4F0, 0x1E4F9, _NUMBER),
    (0x1F6DC, 0x1F6DC, _SYMBOL),
    (0x1F774, 0x1F776, _SYMBOL),
    (0x1F77B, 0x1F77F, _SYMBOL),
    (0x1F7D9, 0x1F7D9, _SYMBOL),
    (0x1FA75, 0x1FA77, _SYMBOL),
    (0x1FA87, 0x1FA88, _SYMBOL),
    (0x1FAAD, 0x1FAAF, _SYMBOL),
    (0x1FABB, 0x1FABD, _SYMBOL),
    (0x1FABF, 0x1FABF, _SYMBOL),
    (0x1FACE, 0x1FACF, _SYMBOL),
    (0x1FADA, 0x1FADB, _SYMBOL),
    (0x1FAE8, 0x1FAE8, _SYMBOL),
    (0x1FAF7, 0x1FAF8, _SYMBOL),
    (0x2B739, 0x2B739, _LETTER),
    (0x2EBF0, 0x2EE5D, _LETTER),
    (0x31350, 0x323AF, _LETTER),
)
_NEWER_UNICODE_STARTS = [start for start, _, _ in _NEWER_UNICODE_RANGES]
_flags_cache: dict[str, int] = {}


def _codepoint_flags(char: str) -> int:
    flags = _flags_cache.get(char)
    if flags is None:
        cpt = ord(char)
        index = bisect.bisect_right(_NEWER_UNICODE_STARTS, cpt) - 1
        if index >= 0 and cpt <= _NEWER_UNICODE_RANGES[index][1]:
            flags = _NEWER_UNICODE_RANGES[index][2]
        else:
            category = unicodedata.category(char)
            flags = _CATEGORY_FLAGS.get(category) or _CATEGORY_FLAGS[category[0]]
        if cpt in _WHITESPACE_CODEPOINTS:
            flags |= _WHITESPACE
        _flags_cache[char] = flags
    return flags


# ---------------------------------------------------------------------------------------------------------
# GPT-2 byte <-> unicode mapping (unicode_byte_to_utf8_map)
# ---------------------------------------------------------------------------------------------------------


def _gpt2_byte_map() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


_BYTE_TO_CHAR = _gpt2_byte_map()
_CHAR_TO_BYTE = {char: byte for byte, char in enumerate(_BYTE_TO_CHAR)}
_LATIN1_TO_BYTE_CHAR = {byte: char for byte, char in enumerate(_BYTE_TO_CHAR)}  # for str.translate


def _byte_encode(word: str) -> str:
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_BYTE_CHAR)


# ---------------------------------------------------------------------------------------------------------
# Pre-tokenizer: llama.cpp's unicode_regex_split
# ---------------------------------------------------------------------------------------------------------

_REGEX_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_REGEX_LLAMA3 = (
    _CONTRACTIONS
    + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_REGEX_QWEN2 = (
    _CONTRACTIONS
    + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_REGEX_QWEN35 = (
    _CONTRACTIONS
    + "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_REGEX_GPT4O = (
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+"
    + _CONTRACTIONS
    + "?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*"
    + _CONTRACTIONS
    + "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_REGEX_DEEPSEEK3 = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
    ),
)
_REGEX_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

# The regex lists of llama.cpp's llm_tokenizer_bpe, by LLAMA_VOCAB_PRE_TYPE.
_PRE_TYPE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (
        "[\\p{P}\\$\\+<=>\\^~\\|]+",
        _REGEX_GPT2,
        "\\p{N}+",
        "[0-9][0-9][0-9]",
    ),
    "llama3": (_REGEX_LLAMA3,),
    "jais2": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
        "|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)"
        "|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    ),
    "deepseek-llm": (
        "[\r\n]",
        (
            "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
            "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
            "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
            "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
            "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
            "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
            "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
            "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
            "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-"
            "\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
            "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
        ),
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        "\\s+$",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}+",
    ),
    "deepseek3-llm": _REGEX_DEEPSEEK3,
    "spark2_5": (
        "\\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        (
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
            "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+"
        ),
        "\\p{N}",
    ),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
        + _CONTRACTIONS
        + "?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
        + _CONTRACTIONS
        + "?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        "\\s?\\p{L}+",
        "\\s?\\p{P}+",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        "\\p{N}",
    ),
    "falcon": (
        "[\\p{P}\\$\\+<=>\\^~\\|`]+",
        _REGEX_GPT2,
        "[0-9][0-9][0-9]",
    ),
    "starcoder": ("\\p{N}", _REGEX_GPT2),
    "gpt2": (_REGEX_GPT2,),
    "qwen2": (_REGEX_QWEN2,),
    "qwen35": (_REGEX_QWEN35,),
    "bloom": (_REGEX_BLOOM,),
    "viking": (_REGEX_BLOOM, "\\p{N}"),
    "tekken": (
        (
            "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?"
            "((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+"
            "|\\s+(?!\\S)|\\s+"
        ),
    ),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        "([\\t\\n]|    |  )",
        "\\p{N}",
        "[\\p{P}!-/:-@\\[-`{-~]",
        _REGEX_GPT2,
    ),
    "gpt4o": (_REGEX_GPT4O,),
    "granite-emb-multi": (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+"
        + _CONTRACTIONS
        + "?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*"
        + _CONTRACTIONS
        + "?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "superbpe": ("\\p{N}+", "(?=(\\d{3})+(?!\\d))"),
    "bailingmoe": (
        (
            "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
            "|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"
        ),
    ),
    "seed-coder": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+"
        "|\\s+(?!\\S)|\\s+",
    ),
    "ufakzeka": ("[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",),
    "laguna": ("[^\\n]+|[\\n]+", _REGEX_QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}"
        "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    ),
    "minicpm5": (
        "\\p{N}{1,3}",
        _CONTRACTIONS + "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
        "|\\s+(?!\\S)|\\s+",
    ),
}


@dataclass(frozen=True)
class _PreTokenizer:
    """One ``tokenizer.ggml.pre`` value: its regex list and the vocab flags llama.cpp sets for it."""

    regexes: str  # key of _PRE_TYPE_REGEXES
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    no_bos: bool = False  # llama.cpp sets special_bos_id = LLAMA_TOKEN_NULL
    add_sep: bool = False


def _pre_table() -> dict[str, _PreTokenizer]:
    # The tokenizer_pre -> pre_type branches of llama_vocab::impl::load.
    table: dict[str, _PreTokenizer] = {}

    def add(names: str, pre: _PreTokenizer) -> None:
        for name in names.split():
            table[name] = pre

    add("default", _PreTokenizer("default"))
    add("minicpm5", _PreTokenizer("minicpm5", ignore_merges=True))
    add(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        _PreTokenizer("llama3", ignore_merges=True, add_bos=True),
    )
    add("deepseek-llm", _PreTokenizer("deepseek-llm", clean_spaces=False))
    add("deepseek-coder", _PreTokenizer("deepseek-coder", clean_spaces=False))
    add("deepseek-v3", _PreTokenizer("deepseek3-llm", clean_spaces=False))
    add("spark2_5", _PreTokenizer("spark2_5", clean_spaces=False))
    add("youtu", _PreTokenizer("youtu", clean_spaces=False, ignore_merges=True))
    add("falcon", _PreTokenizer("falcon"))
    add("mpt", _PreTokenizer("gpt2"))
    add("starcoder", _PreTokenizer("starcoder"))
    add(
        "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert",
        _PreTokenizer("gpt2"),
    )
    add("jais-2", _PreTokenizer("jais2"))
    add("jina-v1-en jina-v2-code roberta-bpe", _PreTokenizer("gpt2", add_sep=True))
    add("refact", _PreTokenizer("starcoder"))
    add("command-r", _PreTokenizer("starcoder", clean_spaces=False))
    add("qwen2 deepseek-r1-qwen kormo f2llmv2", _PreTokenizer("qwen2", clean_spaces=False))
    add("qwen35", _PreTokenizer("qwen35", clean_spaces=False))
    add("stablelm2", _PreTokenizer("qwen2"))
    add("olmo", _PreTokenizer("gpt2"))
    add("dbrx smaug-bpe", _PreTokenizer("llama3"))
    add("poro-chat", _PreTokenizer("bloom", clean_spaces=False))
    add("chatglm-bpe", _PreTokenizer("llama3", no_bos=True))
    add("glm4 glm5", _PreTokenizer("llama3", no_bos=True, ignore_merges=True))
    add("viking", _PreTokenizer("viking", clean_spaces=False))
    add("jais", _PreTokenizer("gpt2"))
    add("tekken", _PreTokenizer("tekken", clean_spaces=False, ignore_merges=True, add_bos=True))
    add("smollm", _PreTokenizer("starcoder", clean_spaces=False))
    add("codeshell", _PreTokenizer("starcoder"))
    add("bloom gpt3-finnish", _PreTokenizer("bloom"))
    add("exaone", _PreTokenizer("starcoder"))
    add("exaone4", _PreTokenizer("gpt2"))
    add("exaone-moe", _PreTokenizer("exaone-moe"))
    add("chameleon", _PreTokenizer("chameleon", add_bos=True, clean_spaces=False))
    add("minerva-7b", _PreTokenizer("starcoder"))
    add("megrez", _PreTokenizer("qwen2"))
    add("gpt-4o llama4 kanana2 talkie minimax-m2", _PreTokenizer("gpt4o", clean_spaces=False))
    add("granite-embed-multi-97m", _PreTokenizer("granite-emb-multi", clean_spaces=False, ignore_merges=True))
    add("superbpe", _PreTokenizer("superbpe", clean_spaces=False))
    add("trillion granite-docling", _PreTokenizer("gpt2", clean_spaces=False))
    add("bailingmoe bailingmoe2 llada-moe", _PreTokenizer("bailingmoe", clean_spaces=False))
    add("seed-coder", _PreTokenizer("seed-coder", clean_spaces=False))
    add("hunyuan solar-open", _PreTokenizer("qwen2", clean_spaces=False))
    add("hunyuan-dense hy_v4 joyai-llm", _PreTokenizer("deepseek3-llm", clean_spaces=False))
    add("ufakzeka", _PreTokenizer("ufakzeka", clean_spaces=False))
    add("grok-2", _PreTokenizer("qwen2", clean_spaces=False))
    add("laguna", _PreTokenizer("laguna", clean_spaces=False))
    add("mellum2", _PreTokenizer("starcoder"))
    return table


_PRE_TOKENIZERS = _pre_table()
# Pre-tokenizers llama.cpp implements with custom code or a non-byte-level pipeline that leat does not mirror.
_UNSUPPORTED_PRE = frozenset(
    ["gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace", "tiny_aya", "cohere2moe", "kimi-k2", "afmoe"]
)


def _split_gpt2(text: str, flags: list[int], offsets: list[int]) -> list[int]:
    """llama.cpp's unicode_regex_split_custom_gpt2: returns the new piece lengths."""
    out: list[int] = []
    start = 0
    for length in offsets:
        end = start + length
        pos = start
        start = end
        while pos < end:
            char = text[pos]
            if char == "'" and pos + 1 < end:
                next1 = text[pos + 1]
                if next1 in "stmd":
                    out.append(2)
                    pos += 2
                    continue
                if pos + 2 < end and next1 + text[pos + 2] in ("re", "ve", "ll"):
                    out.append(3)
                    pos += 3
                    continue
            optional_space = char == " "
            flags2 = (flags[pos + 1] if pos + 1 < end else 0) if optional_space else flags[pos]
            stop = -1
            if flags2 & (_LETTER | _NUMBER):  # <space>?\p{L}+ and <space>?\p{N}+
                category = flags2 & (_LETTER | _NUMBER)
                stop = pos + optional_space
                while stop < end and flags[stop] & category:
                    stop += 1
            elif flags2 and not flags2 & (_WHITESPACE | _LETTER | _NUMBER):  # <space>?[^\s\p{L}\p{N}]+
                stop = pos + optional_space
                while stop < end and not flags[stop] & (_WHITESPACE | _LETTER | _NUMBER):
                    stop += 1
            if stop >= 0:
                out.append(stop - pos)
                pos = stop
                continue
            n_ws = 0
            while pos + n_ws < end and flags[pos + n_ws] & _WHITESPACE:
                n_ws += 1
            if n_ws > 1 and pos + n_ws < end:  # \s+(?!\S)
                n_ws -= 1
            n_ws = max(n_ws, 1)
            out.append(n_ws)
            pos += n_ws
    return out


def _split_llama3_like(text: str, flags: list[int], offsets: list[int], max_digits: int, letter_mask: int) -> list[int]:
    """llama.cpp's unicode_regex_split_custom_llama3 (max_digits 3), _qwen2 (1) and _qwen35 (marks as letters)."""
    not_other = _WHITESPACE | _NUMBER | letter_mask
    out: list[int] = []
    start = 0
    for length in offsets:
        end = start + length
        pos = start
        start = end
        while pos < end:
            char = text[pos]
            char_flags = flags[pos]
            if char == "'" and pos + 1 < end:  # (?i:'s|'t|'re|'ve|'m|'ll|'d)
                next1 = text[pos + 1]
                next1 = next1.lower() if next1 < "\x80" else next1
                if next1 in "stmd":
                    out.append(2)
                    pos += 2
                    continue
                if pos + 2 < end:
                    next2 = text[pos + 2]
                    next2 = next2.lower() if next2 < "\x80" else next2
                    if next1 + next2 in ("re", "ve", "ll"):
                        out.append(3)
                        pos += 3
                        continue
            # [^\r\n\p{L}\p{N}]?\p{L}+
            if not (char == "\r" or char == "\n" or char_flags & _NUMBER) and (
                char_flags & letter_mask or (pos + 1 < end and flags[pos + 1] & letter_mask)
            ):
                stop = pos + 1
                while stop < end and flags[stop] & letter_mask:
                    stop += 1
                out.append(stop - pos)
                pos = stop
                continue
            if char_flags & _NUMBER:  # \p{N}{1,max_digits}
                stop = pos
                while stop < end and flags[stop] & _NUMBER and stop - pos < max_digits:
                    stop += 1
                out.append(stop - pos)
                pos = stop
                continue
            # <space>?[^\s\p{L}\p{N}]+[\r\n]*
            flags2 = (flags[pos + 1] if pos + 1 < end else 0) if char == " " else char_flags
            if not flags2 & not_other and char_flags:
                stop = pos + (char == " ")
                while stop < end and not flags[stop] & not_other:
                    stop += 1
                while stop < end and text[stop] in "\r\n":
                    stop += 1
                out.append(stop - pos)
                pos = stop
                continue
            n_ws = 0
            last_newline_end = 0
            while pos + n_ws < end and flags[pos + n_ws] & _WHITESPACE:
                if text[pos + n_ws] in "\r\n":
                    last_newline_end = pos + n_ws + 1
                n_ws += 1
            if last_newline_end > 0:  # \s*[\r\n]+
                n_ws = last_newline_end - pos
            elif n_ws > 1 and pos + n_ws < end:  # \s+(?!\S)
                n_ws -= 1
            n_ws = max(n_ws, 1)
            out.append(n_ws)
            pos += n_ws
    return out


_CUSTOM_SPLITTERS: dict[str, Callable[[str, list[int], list[int]], list[int]]] = {
    _REGEX_GPT2: _split_gpt2,
    _REGEX_LLAMA3: lambda text, flags, offsets: _split_llama3_like(text, flags, offsets, 3, _LETTER),
    _REGEX_QWEN2: lambda text, flags, offsets: _split_llama3_like(text, flags, offsets, 1, _LETTER),
    _REGEX_QWEN35: lambda text, flags, offsets: _split_llama3_like(text, flags, offsets, 1, _LETTER | _MARK),
}

# unicode_regex_split's "collapsed" std::regex fallback: each code point >= 128 becomes one byte standing for
# its category, and \p{..} in the regex becomes that byte plus the ASCII members of the category.
_CATEGORY_OF_PROPERTY = {
    "\\p{N}": _NUMBER,
    "\\p{L}": _LETTER,
    "\\p{P}": _PUNCTUATION,
    "\\p{M}": _MARK,
    "\\p{S}": _SYMBOL,
    "\\p{Lu}": _LETTER,
    "\\p{Ll}": _LETTER,
    "\\p{Lt}": _LETTER,
    "\\p{Lm}": _LETTER,
    "\\p{Lo}": _LETTER,
}
_COLLAPSED_BYTE = {_NUMBER: 0xD1, _LETTER: 0xD2, _PUNCTUATION: 0xD3, _MARK: 0xD4, _SYMBOL: 0xD5}
_COLLAPSED_ASCII_MEMBERS = {
    _NUMBER: "0-9",
    _LETTER: "A-Za-z",
    _PUNCTUATION: "!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    _MARK: "",
    _SYMBOL: "\\$\\+<->^`\\|\\~",
}


def _collapse_regex(expr: str) -> str:
    """unicode_regex_split's rewrite of \\p{..} classes for the collapsed text (quirks included)."""
    out = []
    inside = False
    i = 0
    while i < len(expr):
        char = expr[i]
        if char == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
        elif inside and char == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
        elif char == "\\" and i + 3 < len(expr) and expr[i + 1] == "p" and expr[i + 2] == "{":
            closing = expr.find("}", i + 3)
            category = _CATEGORY_OF_PROPERTY.get(expr[i : closing + 1]) if 0 <= closing <= i + 10 else None
            if category is None:
                out.append(char)
            else:
                members = chr(_COLLAPSED_BYTE[category]) + _COLLAPSED_ASCII_MEMBERS[category]
                out.append(members if inside else f"[{members}]")
                i = closing
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _ecmascript_to_python(expr: str) -> str:
    """ECMAScript '$' is end of input; Python's also matches before a final newline, so use \\Z."""
    out = []
    inside = escaped = False
    for char in expr:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[":
            inside = True
        elif char == "]":
            inside = False
        elif char == "$" and not inside:
            out.append("\\Z")
            continue
        out.append(char)
    return "".join(out)


def _collapsed_text(text: str) -> bytes:
    """One byte per code point: ASCII as is, whitespace as \\v, others as their category's stand-in byte."""
    out = bytearray(len(text))
    for i, char in enumerate(text):
        cpt = ord(char)
        if cpt < 128:
            out[i] = cpt
            continue
        flags = _codepoint_flags(char)
        out[i] = 0x0B if flags & _WHITESPACE else _COLLAPSED_BYTE.get(flags & 0xFF, 0xD0)
    return bytes(out)


def _wide_text(text: str) -> str:
    """The std::wregex input: non-ASCII whitespace becomes \\v because std::wregex's \\s would not match it."""
    if text.isascii():
        return text
    return "".join("\v" if char >= "\x80" and _codepoint_flags(char) & _WHITESPACE else char for char in text)


def _split_with_regex(text: str | bytes, pattern: re.Pattern, offsets: list[int]) -> list[int]:
    out: list[int] = []
    start = 0
    for length in offsets:
        chunk = text[start : start + length]
        done = 0
        for match in pattern.finditer(chunk):
            if match.start() > done:
                out.append(match.start() - done)
            if match.end() > match.start():
                out.append(match.end() - match.start())
            done = match.end()
        if done < length:
            out.append(length - done)
        start += length
    return out


@dataclass(frozen=True)
class _SplitStep:
    custom: Callable[[str, list[int], list[int]], list[int]] | None = None
    collapsed: re.Pattern | None = None  # bytes pattern on _collapsed_text
    wide: re.Pattern | None = None  # str pattern on _wide_text


def _compile_steps(regexes: Sequence[str]) -> list[_SplitStep]:
    steps = []
    for expr in regexes:
        if expr in _CUSTOM_SPLITTERS:
            steps.append(_SplitStep(custom=_CUSTOM_SPLITTERS[expr]))
        elif any(prop in expr for prop in _CATEGORY_OF_PROPERTY):
            collapsed = _ecmascript_to_python(_collapse_regex(expr)).encode("latin-1")
            steps.append(_SplitStep(collapsed=re.compile(collapsed)))
        else:
            steps.append(_SplitStep(wide=re.compile(_ecmascript_to_python(expr), re.ASCII)))
    return steps


def _regex_split(text: str, steps: Sequence[_SplitStep]) -> list[str]:
    offsets = [len(text)]
    flags = collapsed = wide = None
    for step in steps:
        if step.custom is not None:
            if flags is None:
                flags = [_codepoint_flags(char) for char in text]
            offsets = step.custom(text, flags, offsets)
        elif step.collapsed is not None:
            if collapsed is None:
                collapsed = _collapsed_text(text)
            offsets = _split_with_regex(collapsed, step.collapsed, offsets)
        else:
            if wide is None:
                wide = _wide_text(text)
            offsets = _split_with_regex(wide, step.wide, offsets)
    words = []
    start = 0
    for length in offsets:
        words.append(text[start : start + length])
        start += length
    return words


# ---------------------------------------------------------------------------------------------------------
# Detokenization helpers
# ---------------------------------------------------------------------------------------------------------

# llama_vocab::impl::detokenize's clean_spaces passes, each as one substitution (they run in this order).
_CLEAN_SPACES = (
    (re.compile(rb" (?=[?!.,])"), b""),
    (re.compile(rb" ' "), b"'"),
    (re.compile(rb" (?='[sm]|'[rv]e)"), b""),
)


def _clean_spaces(text: bytes) -> bytes:
    for pattern, replacement in _CLEAN_SPACES:
        text = pattern.sub(replacement, text)
    return text


def _clean_spaces_safe_cut(text: bytes) -> int:
    """The largest n with no space in text[n-3:n]: no clean-up pattern (all start with a space and look at most
    three bytes ahead) can span position n, so _clean_spaces(text[:n]) is final whatever follows."""
    cut = len(text)
    while cut > 0 and b" " in text[max(0, cut - 3) : cut]:
        cut = text.rfind(b" ", 0, cut)
    return cut


def _hex_prefix(text: str) -> int:
    """strtol(text, NULL, 16) as llama.cpp's token_to_byte uses it on "<0xAB>"[3:5]."""
    match = re.match(r"\s*([+-]?)(?:0[xX])?([0-9a-fA-F]*)", text)
    value = int(match[2], 16) if match and match[2] else 0
    return (-value if match and match[1] == "-" else value) & 0xFF


def _bpe_decode_text(text: str) -> bytes:
    """llama_decode_text: undo the GPT-2 byte mapping, with llama.cpp's marker for characters outside it."""
    out = bytearray()
    for char in text:
        byte = _CHAR_TO_BYTE.get(char)
        if byte is not None:
            out.append(byte)
        else:
            utf8 = char.encode("utf-8", "surrogatepass")
            out += b"[UNK_BYTE_0x" + utf8.hex().encode() + text.encode("utf-8", "surrogatepass") + b"]"
    return bytes(out)


# ---------------------------------------------------------------------------------------------------------
# Metadata access
# ---------------------------------------------------------------------------------------------------------

_MISSING = object()


def _get(metadata: dict[str, Any], key: str, kind: type, default: Any = _MISSING) -> Any:
    if key not in metadata:
        if default is _MISSING:
            raise ModelFileError(f"missing metadata key {key}")
        return default
    value = metadata[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ModelFileError(f"metadata key {key} should be {kind.__name__}, got {type(value).__name__}")
    return value


class _TextIndex:
    """The ids of texts, found through a sorted array of the texts' hashes; the texts stay where they are (a
    vocabulary: the GGUF file's strings, :class:`leat.modelfile.StringArray`). 12 bytes a text, where a dict of
    them took about 70 and a Python string each: 15 MB for a 49k-token vocabulary and its merges. ``ids``: the
    indices of ``texts`` to find (all by default); of texts that repeat, the last one answers, or the first with
    ``first`` (as a dict built in order would, or with setdefault)."""

    def __init__(self, texts: Sequence[str], ids: np.ndarray | None = None, first: bool = False):
        found = np.arange(len(texts)) if ids is None else ids
        # every text hashed in order (iterating a StringArray decodes without per-item indexing), then the ids kept
        hashes = np.fromiter((hash(text) for text in texts), np.int64, len(texts))[found]
        order = np.lexsort((found if first else -found, hashes))  # by hash, then the id that wins first
        self._hashes, self._ids = (
            array("q", hashes[order].tobytes()),
            array("i", found[order].astype(np.int32).tobytes()),
        )
        self._texts = texts

    def get(self, text: str, default: int | None = None) -> int | None:
        key, hashes = hash(text), self._hashes
        i = bisect.bisect_left(hashes, key)
        while i < len(hashes) and hashes[i] == key:
            if self._texts[self._ids[i]] == text:
                return self._ids[i]
            i += 1
        return default

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    def __getitem__(self, text: str) -> int:
        found = self.get(text)
        if found is None:
            raise KeyError(text)
        return found


def _get_list(metadata: dict[str, Any], key: str, kind: type, min_len: int = 0) -> Sequence | None:
    if key not in metadata:
        return None
    value = metadata[key]
    if isinstance(value, StringArray) and kind is str:
        return value
    allowed = {kind, int} if kind is float else {kind}
    if not isinstance(value, list) or not set(map(type, value)) <= allowed:
        raise ModelFileError(f"metadata key {key} should be a list of {kind.__name__}")
    if len(value) < min_len:
        raise ModelFileError(f"metadata key {key} has {len(value)} entries, fewer than the {min_len} tokens")
    return value


# Token texts llama.cpp recognises when the ids are not in the metadata (llama_vocab::impl::load).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = (
    "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
    "<|prefix|>",
)  # fmt: skip
_FIM_SUF_TEXTS = (
    "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
    "<|suffix|>",
)  # fmt: skip
_FIM_MID_TEXTS = (
    "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
    "<|middle|>",
)  # fmt: skip
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))  # fmt: skip
_ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode and decode text with a GGUF model's vocabulary, exactly as llama.cpp does."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_sep: bool  # after a reranker's query (leat.model.rerank_prompt)
    sep_id: int | None
    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre (BPE only)

    def __init__(self) -> None:
        raise TypeError("use Tokenizer.from_metadata(metadata)")

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (key -> python value, as :class:`leat.modelfile.ModelFile` gives it)."""
        self = object.__new__(cls)
        self._load(metadata)
        return self

    # -- loading (llama_vocab::impl::load) -------------------------------------------------------------------

    def _load(self, metadata: dict[str, Any]) -> None:
        model = _get(metadata, _KEYS.MODEL, str)
        if model not in ("gpt2", "llama"):
            raise ModelFileError(
                f"unsupported tokenizer model {model!r} in {_KEYS.MODEL} (leat supports 'gpt2' and 'llama')"
            )
        self.model = model
        self._is_spm = model == "llama"
        tokens = _get_list(metadata, _KEYS.LIST, str)
        if tokens is None:
            raise ModelFileError(f"missing metadata key {_KEYS.LIST}")
        n_tokens = len(tokens)
        if n_tokens == 0:
            raise ModelFileError(f"metadata key {_KEYS.LIST} is empty")
        self.vocab_size = n_tokens
        scores = _get_list(metadata, _KEYS.SCORES, float, n_tokens)
        token_types = _get_list(metadata, _KEYS.TOKEN_TYPE, int, n_tokens)

        self.pre = None
        self._pre: _PreTokenizer | None = None
        if self._is_spm:
            bos, eos, unk = 1, 2, 0
            self._add_space_prefix = True
            self._clean_spaces = False
            add_bos = True
        else:
            pre_name = _get(metadata, _KEYS.PRE, str, "") or "default"
            if pre_name in _UNSUPPORTED_PRE:
                raise ModelFileError(f"pre-tokenizer {pre_name!r} in {_KEYS.PRE} is not supported by leat yet")
            if pre_name not in _PRE_TOKENIZERS:
                raise ModelFileError(f"unknown pre-tokenizer type {pre_name!r} in {_KEYS.PRE}")
            self.pre = pre_name
            self._pre = _PRE_TOKENIZERS[pre_name]
            bos, eos, unk = (None if self._pre.no_bos else 11), 11, None
            self._add_space_prefix = False
            self._clean_spaces = self._pre.clean_spaces
            add_bos = self._pre.add_bos
        add_eos = False
        self._add_space_prefix = _get(metadata, _KEYS.ADD_PREFIX, bool, self._add_space_prefix)

        # token texts and attributes
        empty = tokens.empty() if isinstance(tokens, StringArray) else [i for i, text in enumerate(tokens) if not text]
        self._texts: Sequence[str] = tokens  # the file's strings where it has no empty ones
        if empty:
            self._texts = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
        self._text_to_id = _TextIndex(self._texts)  # a repeated text: last id
        self._scores = [float(s) for s in scores] if scores is not None else [0.0] * n_tokens
        if token_types is None:
            self._attrs = [_ATTR_NORMAL] * n_tokens
        else:
            self._attrs = [_ATTR_OF_TYPE.get(t, 0) for t in token_types[:n_tokens]]

        if self._is_spm:
            self._init_spm()
        else:
            self._init_bpe(metadata)

        # special token ids: defaults out of range are disabled; metadata ids out of range are ignored
        def special_id(key: str, default: int | None) -> int | None:
            if default is not None and default >= n_tokens:
                default = None
            value = _get(metadata, key, int, None)
            return value if value is not None and 0 <= value < n_tokens else default

        self.bos_id = special_id(_KEYS.BOS_ID, bos)
        self.eos_id = special_id(_KEYS.EOS_ID, eos)
        self.eot_id = special_id(_KEYS.EOT_ID, None)
        self.eom_id = special_id(_KEYS.EOM_ID, None)
        self.unk_id = special_id(_KEYS.UNK_ID, unk)
        fim_pre = special_id(_KEYS.FIM_PRE_ID, None)
        fim_suf = special_id(_KEYS.FIM_SUF_ID, None)
        fim_mid = special_id(_KEYS.FIM_MID_ID, None)
        fim_pad = special_id(_KEYS.FIM_PAD_ID, None)
        fim_rep = special_id(_KEYS.FIM_REP_ID, None)
        fim_sep = special_id(_KEYS.FIM_SEP_ID, None)
        # deprecated keys, read after the new ones as llama.cpp does
        fim_pre = special_id(_KEYS.PREFIX_ID, fim_pre)
        fim_suf = special_id(_KEYS.SUFFIX_ID, fim_suf)
        fim_mid = special_id(_KEYS.MIDDLE_ID, fim_mid)

        self.add_bos = _get(metadata, _KEYS.ADD_BOS, bool, add_bos)
        self.add_eos = _get(metadata, _KEYS.ADD_EOS, bool, add_eos)
        self.sep_id = special_id(_KEYS.SEP_ID, None)
        self.add_sep = _get(metadata, _KEYS.ADD_SEP, bool, self._pre is not None and self._pre.add_sep)

        # ids found by token text when the metadata does not name them; each found token becomes CONTROL
        def find(current: int | None, texts: Sequence[str]) -> int | None:
            if current is not None:
                return current
            for text in texts:
                token = self._text_to_id.get(text)
                if token is not None:
                    self._attrs[token] |= _ATTR_CONTROL
                    return token
            return None

        self.eot_id = find(self.eot_id, _EOT_TEXTS)
        self.eom_id = find(self.eom_id, _EOM_TEXTS)
        self.fim_pre_id = find(fim_pre, _FIM_PRE_TEXTS)  # fill-in-the-middle's tokens (None: the model has none)
        self.fim_suf_id = find(fim_suf, _FIM_SUF_TEXTS)
        self.fim_mid_id = find(fim_mid, _FIM_MID_TEXTS)
        fim_pad = find(fim_pad, _FIM_PAD_TEXTS)
        self.fim_rep_id = fim_rep = find(fim_rep, _FIM_REP_TEXTS)
        self.fim_sep_id = fim_sep = find(fim_sep, _FIM_SEP_TEXTS)

        for token in range(n_tokens):  # of a repeated text, the id its lookup gives
            text = self._texts[token] if self._attrs[token] & _ATTR_CONTROL else ""
            if "unused" in text and self._text_to_id.get(text) == token:
                self._attrs[token] |= _ATTR_UNUSED

        eog = {t for t in (fim_pad, fim_rep, fim_sep) if t is not None}
        for text in _EOG_TEXTS:
            token = self._text_to_id.get(text)
            if token is not None:
                eog.add(token)
                self._attrs[token] |= _ATTR_CONTROL
        for text in _ALWAYS_RENDERED_TEXTS:
            token = self._text_to_id.get(text)
            if token is not None:
                self._attrs[token] = _ATTR_USER_DEFINED
        eog.update(t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None)
        eog_texts = {self._texts[t]: t for t in eog}
        # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in eog_texts and (
            ("<|return|>" in eog_texts and ("<|call|>" in eog_texts or "<|calls|>" in eog_texts))
            or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts) and "<|flush|>" in eog_texts)
        ):
            eog.discard(eog_texts["<|end|>"])
            self._attrs[eog_texts["<|end|>"]] = _ATTR_USER_DEFINED
        # gemma4 and plamo2 have a normal "</s>"
        if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
            eog.discard(eog_texts["</s>"])
            self._attrs[eog_texts["</s>"]] = _ATTR_NORMAL
        self.eog_ids = frozenset(eog)

        # tokenizer_st_partition's candidates: longest text (in bytes) first
        special = [t for t in range(n_tokens) if self._attrs[t] & (_ATTR_CONTROL | _ATTR_USER_DEFINED | _ATTR_UNKNOWN)]
        special.sort(key=lambda t: -len(self._texts[t].encode("utf-8", "surrogatepass")))

        # per-model attributes (set after the special-token cache, as in llama.cpp)
        model_name = str(metadata.get(_GENERAL_NAME, "")).lower()
        raw_pre = str(metadata.get(_KEYS.PRE, ""))
        architecture = str(metadata.get(_GENERAL_ARCHITECTURE, ""))

        def set_attr(text: str, attr: int, value: bool) -> None:
            token = self._text_to_id.get(text)
            if token is not None:
                self._attrs[token] = (self._attrs[token] | attr) if value else (self._attrs[token] & ~attr)

        if any(p in raw_pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            a in architecture for a in ("nomic-bert-moe", "jina-bert-v3")
        ):
            set_attr("<mask>", _ATTR_LSTRIP, True)
        elif "phi-3" in model_name or "phi3" in model_name:
            for t in special:
                self._attrs[t] |= _ATTR_RSTRIP
            set_attr("</s>", _ATTR_RSTRIP, True)
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                set_attr(text, _ATTR_RSTRIP, False)
        elif "modern-bert" in model_name:
            set_attr("[MASK]", _ATTR_LSTRIP, True)
        self._special_tokens = [(t, self._texts[t]) for t in special]
        self._always_split_tokens = [
            (t, text) for t, text in self._special_tokens if not self._attrs[t] & (_ATTR_CONTROL | _ATTR_UNKNOWN)
        ]
        self._pieces: dict[int, bytes] = {}

    def _init_spm(self) -> None:
        self._byte_tokens: list[int | None] = []
        for byte in range(256):
            token = self._text_to_id.get(f"<0x{byte:02X}>")
            if token is None and byte < 0x80:
                token = self._text_to_id.get(chr(byte))
            self._byte_tokens.append(token)

    def _init_bpe(self, metadata: dict[str, Any]) -> None:
        merges = _get_list(metadata, _KEYS.MERGES, str)
        if merges is None:
            raise ModelFileError(f"missing metadata key {_KEYS.MERGES}")
        # "left right", split at the first space after the first byte; the first occurrence of a pair wins. Keyed by
        # the merge's own text, not a new pair of strings per merge (8 MB for 50k merges): the pair (left, right) is
        # the key left + " " + right, found only when left has no space after its first character
        pairs = np.fromiter((merge.find(" ", 1) >= 0 for merge in merges), bool, len(merges))
        self._ranks = _TextIndex(merges, np.flatnonzero(pairs), first=True)
        self._ignore_merges = self._pre.ignore_merges
        self._split_steps = _compile_steps(_PRE_TYPE_REGEXES[self._pre.regexes])
        self._word_cache: dict[str, tuple[int, ...]] = {}

    # -- encoding ----------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``, as ``llama_tokenize(text, add_special, parse_special)``.

        add_special: add BOS / EOS where the model's add_bos / add_eos say so.
        parse_special: match control tokens such as ``<|im_start|>`` in the text (user-defined tokens always are).
        """
        fragments = self._partition(text, parse_special)
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise ModelFileError(f"{_KEYS.ADD_BOS} is true but the model has no BOS token ({_KEYS.BOS_ID})")
            out.append(self.bos_id)
        if self._is_spm:
            previous_special = True
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    previous_special = True
                    continue
                if self._add_space_prefix and previous_special:
                    fragment = " " + fragment
                self._spm_tokenize(fragment.replace(" ", _SPACE_MARKER), out)
                previous_special = False
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    self._bpe_tokenize(fragment, out)
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise ModelFileError(f"{_KEYS.ADD_EOS} is true but the model has no EOS token ({_KEYS.EOS_ID})")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """llama.cpp's tokenizer_st_partition: split out special tokens, longest first, as text or token id."""
        if not text:
            return []
        fragments: list[tuple[int, int] | int] = [(0, len(text))]
        candidates = self._special_tokens if parse_special else self._always_split_tokens
        for token, token_text in candidates:
            if token_text not in text:
                continue
            lstrip = self._attrs[token] & _ATTR_LSTRIP
            rstrip = self._attrs[token] & _ATTR_RSTRIP
            split: list[tuple[int, int] | int] = []
            for fragment in fragments:
                if isinstance(fragment, int):
                    split.append(fragment)
                    continue
                pos, end = fragment
                while True:
                    match = text.find(token_text, pos, end)
                    if match < 0:
                        if pos < end:
                            split.append((pos, end))
                        break
                    left_end = match
                    if lstrip:
                        while left_end > pos and text[left_end - 1] in _C_ISSPACE:
                            left_end -= 1
                    if left_end > pos:
                        split.append((pos, left_end))
                    split.append(token)
                    pos = match + len(token_text)
                    if rstrip:
                        while pos < end and text[pos] in _C_ISSPACE:
                            pos += 1
            fragments = split
        return [f if isinstance(f, int) else text[f[0] : f[1]] for f in fragments]

    def _spm_tokenize(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_spm_session::tokenize: merge the best-scoring adjacent pair until none is a token."""
        n = len(text)
        if n == 0:
            return
        vocab = self._text_to_id
        scores = self._scores
        start = list(range(n))
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = [*range(1, n), -1]
        queue: list[tuple[float, int, int, int]] = []

        def try_add(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            token = vocab.get(text[start[left] : start[left] + size[left] + size[right]])
            if token is not None:
                # highest score first, then leftmost (llm_bigram_spm::comparator)
                heapq.heappush(queue, (-scores[token], left, right, size[left] + size[right]))

        for i in range(1, n):
            try_add(i - 1, i)
        while queue:
            _, left, right, pair_size = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != pair_size:
                continue
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])
        i = 0
        while i != -1:
            piece = text[start[i] : start[i] + size[i]]
            token = vocab.get(piece)
            if token is not None:
                out.append(token)
            else:
                for byte in piece.encode("utf-8", "surrogatepass"):
                    byte_token = self._byte_tokens[byte]
                    # llama.cpp throws here (vocab without byte tokens); fall back to the unknown token
                    out.append(byte_token if byte_token is not None else self._unk_or_fail(byte))
            i = nxt[i]

    def _unk_or_fail(self, byte: int) -> int:
        if self.unk_id is None:
            raise ModelFileError(f"vocabulary has no token for byte 0x{byte:02X} and no unknown token")
        return self.unk_id

    def _bpe_tokenize(self, text: str, out: list[int]) -> None:
        """llm_tokenizer_bpe_session::tokenize: pre-tokenize, byte-encode, merge each word."""
        cache = self._word_cache
        for word in _regex_split(text, self._split_steps):
            word = _byte_encode(word)
            ids = cache.get(word)
            if ids is None:
                ids = tuple(self._merge_word(word))
                if len(cache) < 100_000:
                    cache[word] = ids
            out.extend(ids)

    def _merge_word(self, word: str) -> list[int]:
        """BPE merges of one byte-encoded word, as llama.cpp does them (lowest rank, then leftmost, first)."""
        vocab = self._text_to_id
        if self._ignore_merges and word in vocab:
            return [vocab[word]]
        symbols = list(word)
        nxt = [*range(1, len(symbols)), -1]
        prev = list(range(-1, len(symbols) - 1))
        queue: list[tuple[int, int, int, str]] = []

        def add_pair(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            first = symbols[left]
            rank = None if " " in first[1:] else self._ranks.get(f"{first} {symbols[right]}")
            if rank is not None:
                heapq.heappush(queue, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(1, len(symbols)):
            add_pair(i - 1, i)
        while queue:
            _, left, right, merged = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue
            symbols[left] = merged
            symbols[right] = ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_pair(prev[left], left)
            add_pair(left, nxt[left])
        ids = []
        for symbol in symbols:
            if not symbol:
                continue
            token = vocab.get(symbol)
            if token is not None:
                ids.append(token)
                continue
            for byte in symbol.encode("utf-8"):  # llama.cpp looks up each byte as a one-byte token text
                token = vocab.get(chr(byte)) if byte < 0x80 else None
                if token is not None:
                    ids.append(token)
        return ids

    # -- decoding ----------------------------------------------------------------------------------------------

    def piece(self, token_id: int) -> bytes:
        """The bytes a token stands for (control tokens as their text), as ``llama_token_to_piece(special=True)``."""
        return self._piece(token_id, True)

    def _piece(self, token_id: int, special: bool) -> bytes:
        self._check_id(token_id)
        attr = self._attrs[token_id]
        if not special and attr & (_ATTR_UNKNOWN | _ATTR_CONTROL):
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self._texts[token_id]
            if attr & (_ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED):
                piece = text.encode("utf-8", "surrogatepass")
            elif attr & _ATTR_NORMAL:
                if self._is_spm:
                    piece = text.replace(_SPACE_MARKER, " ").encode("utf-8", "surrogatepass")
                else:
                    piece = _bpe_decode_text(text)
            elif attr & _ATTR_BYTE:
                piece = bytes([_hex_prefix(text[3:5])])
            else:  # unused and undefined tokens have no text
                piece = b""
            self._pieces[token_id] = piece
        return piece

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        """``llama_detokenize(ids, remove_special=False, unparse_special=not skip_special)`` as raw bytes."""
        pieces = [self._piece(t, not skip_special) for t in ids]
        if self._add_space_prefix and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        return _clean_spaces(text) if self._clean_spaces else text

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. skip_special drops control tokens' text."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    # -- lookups -----------------------------------------------------------------------------------------------

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """The id of the token whose text is exactly ``text`` (the last one, if several share it)."""
        return self._text_to_id.get(text)

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (byte-level BPE mapping not undone)."""
        self._check_id(token_id)
        return self._texts[token_id]

    def is_control(self, token_id: int) -> bool:
        """Whether the token is a control token (rendered by decode only when skip_special is false)."""
        self._check_id(token_id)
        return bool(self._attrs[token_id] & _ATTR_CONTROL)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is out of range (vocabulary size {self.vocab_size})")


class IncrementalDecoder:
    """Streaming detokenization: the concatenation of all :meth:`feed` results and :meth:`flush` equals
    ``tokenizer.decode(ids, skip_special)``. Incomplete UTF-8 sequences are held back until completed."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tokenizer = tokenizer
        self._special = not skip_special
        self._first = True
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._unclean = b""  # bytes whose clean_spaces result may still change

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        piece = self._tokenizer._piece(token_id, self._special)
        if self._first:
            self._first = False
            if self._tokenizer._add_space_prefix and piece.startswith(b" "):
                piece = piece[1:]
        if not self._tokenizer._clean_spaces:
            return self._utf8.decode(piece)
        self._unclean += piece
        cut = _clean_spaces_safe_cut(self._unclean)
        ready, self._unclean = self._unclean[:cut], self._unclean[cut:]
        return self._utf8.decode(_clean_spaces(ready))

    def flush(self) -> str:
        """Return whatever is held back (invalid or incomplete UTF-8 as U+FFFD) and reset the UTF-8 state."""
        rest, self._unclean = _clean_spaces(self._unclean), b""
        return self._utf8.decode(rest, final=True)
