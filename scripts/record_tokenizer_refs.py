"""Record llama.cpp's tokenization as reference data for core/tests/test_tokenizer.py.

Runs llama.cpp through llama-cpp-python 0.3.36 (whose vendored llama.cpp is the reference), so it needs a Python
with ``llama_cpp`` and ``gguf`` installed, not the leat environment::

    python scripts/record_tokenizer_refs.py \\
        --llama-cpp PATH/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --smollm PATH/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --gemma PATH/gemma-3-270m-q4_k_m.gguf

It writes into core/tests/tokenizer_refs/:

* ``<model>.json`` for SmolLM2 135M Instruct and Gemma 3 270M: token ids of ``TEXTS`` for several
  add_special / parse_special settings, their detokenization, and the vocabulary facts leat mirrors
  (BOS/EOS, add_bos/add_eos, end-of-generation set, hashes of every token's piece and attributes).
* ``ggml-vocabs.json``: for the vocabularies of llama.cpp's own test vectors (models/ggml-vocab-*.gguf), the
  same facts and ``TEXTS`` cases (add_special and parse_special on), and llama_detokenize of the expected ids of
  each test vector (.inp/.out).
* ``pre-tokenizers.json``: tokenization of the test-vector texts and ``TEXTS`` with the GPT-2 vocabulary under
  every ``tokenizer.ggml.pre`` value leat supports (a copy of ggml-vocab-gpt-2.gguf with the key changed).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

import gguf
import llama_cpp

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
REFS_DIR = Path(__file__).resolve().parent.parent / "core" / "tests" / "tokenizer_refs"

# Test-vector vocabularies (models/ggml-vocab-NAME.gguf) leat's tokenizer supports.
VOCABS = (
    "gpt-2", "llama-bpe", "qwen2", "llama-spm", "deepseek-coder", "deepseek-llm", "falcon", "mpt", "starcoder",
    "refact", "command-r", "qwen35", "phi-3",
)  # fmt: skip

# Every tokenizer.ggml.pre value leat supports (leat.tokenizer._PRE_TOKENIZERS).
PRE_NAMES = (
    "default", "minicpm5", "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "deepseek-llm", "deepseek-coder", "deepseek-v3", "spark2_5", "youtu", "falcon", "mpt",
    "starcoder", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
    "modern-bert", "jais-2", "jina-v1-en", "jina-v2-code", "roberta-bpe", "refact", "command-r", "qwen2",
    "deepseek-r1-qwen", "kormo", "f2llmv2", "qwen35", "stablelm2", "olmo", "dbrx", "smaug-bpe", "poro-chat",
    "chatglm-bpe", "glm4", "glm5", "viking", "jais", "tekken", "smollm", "codeshell", "bloom", "gpt3-finnish",
    "exaone", "exaone4", "exaone-moe", "chameleon", "minerva-7b", "megrez", "gpt-4o", "llama4", "kanana2", "talkie",
    "minimax-m2", "granite-embed-multi-97m", "superbpe", "trillion", "granite-docling", "bailingmoe", "bailingmoe2",
    "llada-moe", "seed-coder", "hunyuan", "solar-open", "hunyuan-dense", "hy_v4", "joyai-llm", "ufakzeka", "grok-2",
    "laguna", "mellum2",
)  # fmt: skip

TEXTS = (
    "Hello world",
    " Hello world",
    "Hello, world! How's it going? I'm fine; you're great , isn 't it ?",
    "   multiple    spaces\t\ttabs\n\n\nnewlines  \n  \r\n trailing   ",
    "Numbers: 1234567890 3.14159 -42 1,000,000 0x1F \u0663\u0664\u0665 \u00bd \u2167",
    (
        "Emoji: \U0001f600\U0001f44d\U0001f3fd\U0001f1fa\U0001f1f8 \U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f"
        " \U0001f999\U0001fae8"
    ),
    "CJK: \u4f60\u597d\uff0c\u4e16\u754c\uff01\u3053\u3093\u306b\u3061\u306f \uc548\ub155\ud558\uc138\uc694",
    "Accents: caf\u00e9 na\u00efve \u00c6r\u00f8sk\u00f8bing Z\u00fcrich fa\u00e7ade e\u0301 a\u0308",
    "def foo(x):\n    return x ** 2  # square\n\nif __name__ == '__main__':\n\tprint(foo(3))\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "text<|endoftext|>more text</s><s> <bos><eos><pad><unk> <mask>",
    (
        "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440! \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645"
        " \u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e \u05e9\u05dc\u05d5\u05dd"
    ),
    (
        "\u2200x\u2208\u211d: x\u00b2 \u2265 0 \u2192 \u221ax \u2208 \u211d\u207a \u00b1\u221e \u2260 \u2248 \u20ac\u00a3\u00a5"
        " \u00a9\u00ae\u2122"
    ),
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}, "s": "tab\\tquote\\""}',
    "https://example.com/path?query=1&x=y#frag user@mail.org C:\\Users\\me",
    "",
    " ",
    "\n",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!........--------========",
    "DON'T WON'T I'LL WE'VE THEY'RE SHE'D it'S y'all 'quoted' ' ' ",
    "zero\u200bwidth\u00a0nbsp\u2028line\u3000ideographic\u0085nel\x1cfs",
    "\u2581\u2581 literal sentencepiece marker and <0x41> byte-like text",
    (
        "Thai \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22 Hindi \u0915\u094d\u0937\u0924\u094d\u0930\u093f\u092f"
        " Khmer \u1780\u17b6\u1793\u17cb\u178f\u17c2"
    ),
    "<start_of_image><end_of_image>[multimodal]<unused5> <fim_prefix>x<fim_suffix>y<fim_middle>",
)

MODEL_SETTINGS = ((True, False), (False, False), (True, True), (False, True))  # (add_special, parse_special)


def _silence_llama_logs() -> None:
    @llama_cpp.llama_log_callback
    def _ignore(level, text, user_data):
        pass

    _silence_llama_logs.callback = _ignore  # keep a reference for ctypes
    llama_cpp.llama_log_set(_ignore, ctypes.c_void_p())


class Vocab:
    """llama.cpp's vocabulary of one GGUF file, loaded with vocab_only."""

    def __init__(self, path: Path):
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_tokens = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def close(self) -> None:
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        tokens = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, capacity, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"tokenize needs {-n} tokens")
        return list(tokens[:n])

    def detokenize(self, ids: list[int], unparse_special: bool) -> bytes:
        array = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 64 * len(ids)
        buffer = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_detokenize(self.vocab, array, len(ids), buffer, size, False, unparse_special)
        if n < 0:
            raise RuntimeError(f"detokenize needs {-n} bytes")
        return buffer.raw[:n]

    def piece(self, token: int, special: bool) -> bytes:
        buffer = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, 256, 0, special)
        if n < 0:
            buffer = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, -n, 0, special)
        return buffer.raw[:n]

    def facts(self) -> dict:
        """BOS/EOS, add_bos/add_eos, the end-of-generation set and hashes of all pieces and attributes."""

        def token_or_none(token: int) -> int | None:
            return None if token == llama_cpp.LLAMA_TOKEN_NULL else token

        pieces = {True: hashlib.sha256(), False: hashlib.sha256()}
        attrs = hashlib.sha256()
        eog = []
        for token in range(self.n_tokens):
            for special, digest in pieces.items():
                piece = self.piece(token, special)
                digest.update(len(piece).to_bytes(4, "little") + piece)
            attrs.update(int(llama_cpp.llama_vocab_get_attr(self.vocab, token)).to_bytes(4, "little"))
            if llama_cpp.llama_vocab_is_eog(self.vocab, token):
                eog.append(token)
        return {
            "vocab_size": self.n_tokens,
            "bos_id": token_or_none(llama_cpp.llama_vocab_bos(self.vocab)),
            "eos_id": token_or_none(llama_cpp.llama_vocab_eos(self.vocab)),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(self.vocab)),
            "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(self.vocab)),
            "eog_ids": eog,
            "pieces_sha256": pieces[True].hexdigest(),
            "pieces_no_special_sha256": pieces[False].hexdigest(),
            "attrs_sha256": attrs.hexdigest(),
        }


def _text(data: bytes) -> str:
    """Bytes as JSON-safe text; invalid UTF-8 survives as lone surrogates (decode with surrogateescape)."""
    return data.decode("utf-8", "surrogateescape")


def read_test_vectors(models_dir: Path, name: str) -> list[tuple[str, list[int]]]:
    """Parse models/ggml-vocab-NAME.gguf.inp/.out the way llama.cpp's tests/test-tokenizer-0.cpp does."""
    raw = (models_dir / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    lines = (models_dir / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    separator = "\n__ggml_vocab_test__\n"
    texts, pos = [], 0
    while pos < len(raw):
        found = raw.find(separator, pos)
        if found < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:found])
        pos = found + len(separator)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines, strict=False)]


def _cases(vocab: Vocab, settings: tuple[tuple[bool, bool], ...]) -> list[dict]:
    """Token ids of each of TEXTS per (add_special, parse_special), and llama_detokenize of the ids that
    add_special and parse_special give, with and without rendering control tokens."""
    cases = []
    for text in TEXTS:
        case: dict = {"text": text}
        for add_special, parse_special in settings:
            ids = vocab.tokenize(text, add_special, parse_special)
            case[f"ids add_special={add_special} parse_special={parse_special}"] = ids
            if add_special and parse_special:
                case["decode"] = _text(vocab.detokenize(ids, unparse_special=True))
                case["decode skip_special"] = _text(vocab.detokenize(ids, unparse_special=False))
        cases.append(case)
    return cases


def record_model(path: Path, name: str) -> None:
    vocab = Vocab(path)
    data = {
        "model": path.name,
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        **vocab.facts(),
        "cases": _cases(vocab, MODEL_SETTINGS),
    }
    vocab.close()
    _write(f"{name}.json", data)


def record_vocabs(models_dir: Path) -> None:
    data = {}
    for name in VOCABS:
        vocab = Vocab(models_dir / f"ggml-vocab-{name}.gguf")
        data[name] = {
            **vocab.facts(),
            "cases": _cases(vocab, ((True, True),)),
            # llama_detokenize of the expected ids of each test vector
            "test_vectors_decode": [
                _text(vocab.detokenize(ids, unparse_special=True)) for _, ids in read_test_vectors(models_dir, name)
            ],
        }
        vocab.close()
    _write("ggml-vocabs.json", {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "vocabs": data})


def _copy_with_pre(reader: gguf.GGUFReader, dest: Path, pre: str) -> None:
    writer = gguf.GGUFWriter(dest, arch=str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == gguf.Keys.General.ARCHITECTURE:
            continue
        value = pre if key == gguf.Keys.Tokenizer.PRE else field.contents()
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if gguf.Keys.Tokenizer.PRE not in reader.fields:
        writer.add_key_value(gguf.Keys.Tokenizer.PRE, pre, gguf.GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def record_pre_tokenizers(models_dir: Path) -> None:
    texts = [text for text, _ in read_test_vectors(models_dir, "llama-bpe")] + list(TEXTS)
    results: dict[str, dict] = {}
    seen: dict[str, str] = {}
    reader = gguf.GGUFReader(models_dir / "ggml-vocab-gpt-2.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRE_NAMES:
            path = Path(tmp) / f"{pre}.gguf"
            _copy_with_pre(reader, path, pre)
            vocab = Vocab(path)
            ids = [vocab.tokenize(text, False, False) for text in texts]
            result = {
                "ids": ids,
                # llama_detokenize of ids; None where that is the input text
                "decode": [
                    None if decoded == text else decoded
                    for text, decoded in zip(texts, (_text(vocab.detokenize(i, unparse_special=True)) for i in ids))
                ],
                "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab.vocab)),
            }
            bos = llama_cpp.llama_vocab_bos(vocab.vocab)
            result["bos_id"] = None if bos == llama_cpp.LLAMA_TOKEN_NULL else bos
            vocab.close()
            key = json.dumps(result, sort_keys=True)
            if key in seen:
                results[pre] = {"same_as": seen[key]}
            else:
                seen[key] = pre
                results[pre] = result
    _write("pre-tokenizers.json", {"llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "texts": texts, "results": results})


def _dumps(data: dict) -> str:
    """Indented JSON with each list of token ids on one line."""
    text = json.dumps(data, ensure_ascii=True, indent=1)
    # JSON strings hold no raw newlines, so a bracket followed by a newline is layout, not text
    ids = re.compile(r"\[\n\s*(-?\d+(?:,\n\s*-?\d+)*)\n\s*\]")
    return ids.sub(lambda m: "[" + ",".join(n.strip() for n in m[1].split(",")) + "]", text)


def _write(name: str, data: dict) -> None:
    REFS_DIR.mkdir(parents=True, exist_ok=True)
    path = REFS_DIR / name
    path.write_text(_dumps(data) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama-cpp-python sdist's vendor/llama.cpp")
    parser.add_argument("--smollm", type=Path, required=True, help="SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--gemma", type=Path, required=True, help="Gemma 3 270M GGUF")
    args = parser.parse_args()
    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        print(f"need llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, found {llama_cpp.__version__}", file=sys.stderr)
        return 1
    _silence_llama_logs()
    llama_cpp.llama_backend_init()
    models_dir = args.llama_cpp / "models"
    record_vocabs(models_dir)
    record_model(args.smollm, "smollm2-135m-instruct")
    record_model(args.gemma, "gemma3-270m")
    record_pre_tokenizers(models_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
