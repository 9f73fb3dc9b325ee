"""Tiny random-weight GGUF models for tests, written with ``gguf.GGUFWriter``.

The files carry an architecture's real tensor names and metadata keys (from the architecture's
``tiny``, ``tensor_shapes`` and ``write_metadata``) and a small byte-level BPE vocabulary, so
llama.cpp loads them too and can serve as the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from leat.blocks import random_tensor

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = (
    "the quick brown fox jumps over the lazy dog. the sky is blue because of rayleigh scattering "
    "of sunlight in the atmosphere. hello world, this is a tiny test model for leat and llama.cpp. "
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE token text)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tiny_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of a byte-level BPE vocabulary of exactly ``size`` tokens."""
    if size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a tiny vocabulary needs at least {256 + len(SPECIAL_TOKENS)} tokens, not {size}")
    mapping = byte_to_unicode()
    tokens = [mapping[b] for b in range(256)]
    words = [[mapping[b] for b in (" " + w).encode()] for w in TRAINING_TEXT.split()]
    merges: list[str] = []
    while len(tokens) < size - len(SPECIAL_TOKENS):
        pairs = Counter((a, b) for w in words for a, b in itertools.pairwise(w))
        if not pairs:
            tokens.append(f"<unused{len(tokens)}>")
            continue
        (a, b), _ = pairs.most_common(1)[0]
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        words = [_merge(w, a, b) for w in words]
    types = [gguf.TokenType.NORMAL] * len(tokens) + [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
    return tokens + SPECIAL_TOKENS, merges, [int(t) for t in types]


def _merge(word: list[str], a: str, b: str) -> list[str]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def add_tiny_tokenizer(writer: gguf.GGUFWriter, vocab_size: int, pre: str = "llama-bpe") -> None:
    tokens, merges, types = tiny_vocab(vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)


# Matrices llama.cpp's converter and llama-quantize always keep in F32 (MoE routers, state-space convolutions); the
# converter also keeps every tensor not named ``*.weight`` (biases, including 2-D expert biases) in F32.
F32_MATRICES = tuple(
    gguf.TENSOR_NAMES[t].split(".")[-1] + ".weight"
    for t in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.SSM_CONV1D)
)


def quantizable(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> bool:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return len(shape) >= 2 and shape[-1] % block == 0


def write_tiny_gguf(
    architecture: Any,
    path: str | Path,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    seed: int = 0,
    params: Any = None,
    types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
    dequantized: bool = False,
) -> Path:
    """Write a random-weight model of ``architecture`` (an Architecture class) to ``path``.

    Matrices are stored as ``qtype`` where their rows fit its block size; vectors (norms, biases)
    and MoE routers stay F32 as llama.cpp's converter leaves them. ``types`` overrides the type of
    the tensors it names (e.g. MXFP4 experts in an otherwise F32 file). ``dequantized`` stores each
    quantized tensor's exact values as F32 instead: the same weights with no quantized arithmetic,
    which measures how far a reference's quantized kernels are from exact float.
    """
    path = Path(path)
    params = params if params is not None else architecture.tiny()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, architecture.names[0])
    writer.add_name(f"tiny-{architecture.names[0]}")
    architecture.write_metadata(writer, params)
    add_tiny_tokenizer(writer, params.vocab)
    for name, shape in architecture.tensor_shapes(params).items():
        values = random_tensor(rng, shape, name)
        keep_f32 = name.endswith(F32_MATRICES) or not name.endswith(".weight")
        kind = gguf.GGMLQuantizationType.F32 if keep_f32 else qtype
        kind = (types or {}).get(name, kind)
        if kind != gguf.GGMLQuantizationType.F32 and quantizable(shape, kind):
            packed = gguf.quants.quantize(values, kind)
            if dequantized:
                writer.add_tensor(name, gguf.quants.dequantize(packed, kind).reshape(shape).astype(np.float32))
            else:
                writer.add_tensor(name, packed, raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class TinyModels:
    """The tiny random-weight files a plugin's llama.cpp references were recorded on, and how to rebuild them.

    ``configs`` maps a name to a configuration: ``qtype`` (a ``GGMLQuantizationType`` name), ``seed``, ``params``
    (overrides of the architecture's ``tiny()``), ``tokens`` (the prompt's length) and whatever else the plugin
    keeps there; ``architecture(config)`` is the Architecture class a configuration writes. Files are written by
    :func:`write_tiny_gguf`, deterministically: the same configuration gives the same bytes. A plugin's
    ``tests/references/tiny_models.py`` declares one as ``models`` and runs :meth:`main` as a script, which
    ``scripts/record_llamacpp_tiny.py`` does; :class:`leat.conformance.llamacpp.LlamaCppAgreement` rebuilds the
    files through it. Subclass to store some tensors in other types (:meth:`types`) or to finish a written file.
    """

    def __init__(self, configs: dict[str, dict[str, Any]], architecture: Callable[[dict[str, Any]], Any]):
        self.configs = configs
        self.architecture = architecture

    def params(self, name: str) -> Any:
        config = self.configs[name]
        return self.architecture(config).tiny(**config["params"])

    def tokens(self, name: str) -> np.ndarray:
        """The prompt fed to configuration ``name``: seeded random token ids (no tokenizer involved)."""
        config = self.configs[name]
        rng = np.random.default_rng(1000 + config["seed"])
        return rng.integers(0, self.params(name).vocab, config["tokens"]).astype(np.int32)

    def types(self, name: str) -> dict[str, gguf.GGMLQuantizationType]:
        """Tensors stored in another type than the configuration's ``qtype``; a configuration with any also gets a
        ``dequantized`` copy (see :func:`write_tiny_gguf`)."""
        return {}

    def build(self, name: str, path: str | Path, dequantized: bool = False) -> Path:
        """Write the tiny file of configuration ``name`` to ``path`` (the same bytes every time)."""
        config = self.configs[name]
        qtype = gguf.GGMLQuantizationType[config["qtype"]]
        architecture, params = self.architecture(config), self.params(name)
        return write_tiny_gguf(architecture, path, qtype, config["seed"], params, self.types(name), dequantized)

    def main(self, argv: list[str]) -> None:
        """``tiny_models.py OUTDIR``: build every file into OUTDIR and print one JSON line, per name its
        configuration, ``path``, ``sha256``, ``token_ids`` and ``hyperparameters`` (and ``dequantized_path`` and
        ``dequantized_sha256`` for a dequantized copy)."""
        if len(argv) != 1:
            sys.exit("usage: tiny_models.py OUTDIR")
        out = Path(argv[0])
        out.mkdir(parents=True, exist_ok=True)
        built = {}
        for name, config in self.configs.items():
            path = self.build(name, out / f"tiny-{name}.gguf")
            info = {**config, "path": str(path), "sha256": sha256(path), "token_ids": self.tokens(name).tolist()}
            if self.types(name):
                copy = self.build(name, out / f"tiny-{name}-dequantized.gguf", dequantized=True)
                info |= {"dequantized_path": str(copy), "dequantized_sha256": sha256(copy)}
            built[name] = info | {"hyperparameters": dataclasses.asdict(self.params(name))}
        print(json.dumps(built))


def relative_error(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| in float64, after checking that the shapes match and every value of ``got`` is
    finite (an element a kernel never wrote stays NaN in a poisoned output)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), "non-finite values (an element not written?)"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def leat_cli(*args: str, plugins: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m leat ARGS`` in a subprocess, its output as text; ``plugins`` is ``LEAT_PLUGINS`` there (None: as
    here)."""
    env = dict(os.environ) if plugins is None else dict(os.environ, LEAT_PLUGINS=plugins)
    command = [sys.executable, "-m", "leat", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def assert_plugin_provides(distribution: str, kind: str, names: list[str], plugins: str | None = None) -> None:
    """``leat plugins`` lists the installed ``distribution`` as loaded, providing exactly ``names`` of ``kind``."""
    result = leat_cli("plugins", plugins=plugins)
    assert result.returncode == 0, result.stderr
    (row,) = [row for row in json.loads(result.stdout) if row["name"] == distribution]
    assert row["status"] == "loaded", row
    assert sorted(row["provides"][kind]) == sorted(names), row


def assert_generate_is_greedy(path: str | Path, logits: Any, plugins: str | None = None, min_gap: float = 1e-3) -> None:
    """``leat generate`` of 8 tokens at temperature 0 on the CPU backend succeeds, and each token it gives is the
    argmax that ``logits`` (a function of token ids giving every position's logits, e.g. the float64 oracle's) gives
    after the prompt and the tokens before it, wherever the top-2 gap is at least ``min_gap`` (a near-tie may go
    either way)."""
    from leat.compare import top2_gap

    command = ("generate", "-m", str(path), "-p", "hi", "-n", "8", "--backend", "cpu", "--temp", "0", "--json")
    result = leat_cli(*command, plugins=plugins)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["ids"]) == 8 and out["timings"]["finish_reason"] == "length", out
    prompt, generated = out["prompt_ids"], np.array(out["ids"])
    steps = np.asarray(logits(np.array(prompt + out["ids"])))[len(prompt) - 1 : -1]
    decided = top2_gap(steps) >= min_gap
    assert np.array_equal(np.argmax(steps, axis=-1)[decided], generated[decided])


class FailsOnCall:
    """A logits processor that leaves the logits alone, and raises on its ``n``-th call (a request's own part
    failing, for fault-isolation tests)."""

    label = "test constraint"

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, logits: np.ndarray, generated: Any) -> np.ndarray:
        self.calls += 1
        if self.calls == self.n:
            raise ValueError("poisoned")
        return logits


def parse_in_pieces(parser: Any, text: str, step: int) -> list[tuple[str, str]]:
    """A chat format's parser fed ``text`` in pieces of ``step`` characters, then finished: ``(kind, text)`` with
    neighbouring content or reasoning merged, a tool call as ``("tool_call", json [name, arguments])``."""
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i : i + step])
    deltas += parser.finish()
    out: list[tuple[str, str]] = []
    for d in deltas:
        value = d.text if d.kind != "tool_call" else json.dumps([d.call.name, json.loads(d.call.arguments)])
        if out and out[-1][0] == d.kind and d.kind != "tool_call":
            out[-1] = (d.kind, out[-1][1] + value)
        elif value or d.kind == "tool_call":
            out.append((d.kind, value))
    return out


def tool_call(name: str, **arguments: Any) -> tuple[str, str]:
    """What :func:`parse_in_pieces` gives for one call."""
    return ("tool_call", json.dumps([name, arguments]))


def parse_with(plugin: str, name: str, text: str, step: int) -> list[tuple[str, str]]:
    """:func:`parse_in_pieces` with the chat format ``name`` that the installed distribution ``plugin`` registers."""
    from leat.chatformat import build_parser

    return parse_in_pieces(build_parser(_formats_of(plugin)[name], reasoning=False), text, step)


@functools.cache
def _formats_of(plugin: str) -> dict[str, Any]:
    from leat.chatformat import formats
    from leat.plugins import PluginHost

    return formats(PluginHost([plugin]))


def write_tiny_mmproj(
    path: str | Path, text_width: int, projector: str, seed: int = 0, vit: str = "siglip", **shape: int
) -> Path:
    """Write a random-weight vision projector of type ``projector`` for a text model of ``text_width``, as llama.cpp's
    mtmd loads it, with the tensors of ``vit``: ``siglip``, a SigLIP ViT and the average-pool projector (Gemma 3's);
    ``rope2d``, Gemma 4's ViT (RMSNorms, per-head q/k norms, 2-D RoPE tables, GeGLU, post-norms, layer scales), its
    pooler (3 x 3, the default) with ``std_bias`` and ``std_scale``, and Gemma4ClippableLinear clamps on three
    products. ``shape`` overrides the defaults: 4-pixel patches, width 32, 4 heads, MLP 64, 2 layers, GELU (``gelu=0``:
    gelu_quick); siglip: a 32-pixel image pooled 2 x 2 (16 image tokens)."""
    s = {"image": 32, "patch": 4, "width": 32, "heads": 4, "ffn": 64, "layers": 2, "merge": 2, "gelu": 1} | shape
    V, w, rng = gguf.Keys.ClipVision, s["width"], np.random.default_rng(seed)
    rope2d = vit == "rope2d"
    writer = gguf.GGUFWriter(Path(path), "clip")
    writer.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, projector)
    writer.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    writer.add_bool(V.USE_GELU, bool(s["gelu"]))  # false: llama.cpp's gelu_quick
    for key, value in ((V.IMAGE_SIZE, "image"), (V.PATCH_SIZE, "patch"), (V.EMBEDDING_LENGTH, "width")):
        writer.add_uint32(key, s[value])
    for key, value in ((V.FEED_FORWARD_LENGTH, "ffn"), (V.BLOCK_COUNT, "layers"), (V.Attention.HEAD_COUNT, "heads")):
        writer.add_uint32(key, s[value])
    writer.add_uint32(V.PROJECTION_DIM, text_width)
    if not rope2d:
        writer.add_uint32(V.Projector.SCALE_FACTOR, s["merge"])
    writer.add_float32(V.Attention.LAYERNORM_EPS, 1e-6)
    writer.add_array(V.IMAGE_MEAN, [0.5, 0.5, 0.5] if not rope2d else [0.0, 0.0, 0.0])
    writer.add_array(V.IMAGE_STD, [0.5, 0.5, 0.5] if not rope2d else [1.0, 1.0, 1.0])

    def add(name: str, *dims: int, around: float = 0.0) -> None:
        scale = 0.2 if len(dims) == 1 else dims[-1] ** -0.5
        writer.add_tensor(name, (around + scale * rng.standard_normal(dims)).astype(np.float32))

    add("v.patch_embd.weight", w, 3, s["patch"], s["patch"])
    bias = [] if rope2d else ["bias"]
    if rope2d:  # a column table and a row table, 64 positions each
        add("v.position_embd.weight", 2, 64, w)
    else:
        add("v.patch_embd.bias", w)
        add("v.position_embd.weight", (s["image"] // s["patch"]) ** 2, w)
    head, parts = w // s["heads"], [("attn_q", w, w), ("attn_k", w, w), ("attn_v", w, w), ("attn_out", w, w)]
    parts += [("ffn_up", s["ffn"], w), ("ffn_down", w, s["ffn"])] + [("ffn_gate", s["ffn"], w)] * rope2d
    norms = ["ln1", "ln2"] + ["attn_post_norm", "ffn_post_norm"] * rope2d
    for i in range(s["layers"]):
        for part, rows, cols in parts:
            add(f"v.blk.{i}.{part}.weight", rows, cols)
            for b in bias:
                add(f"v.blk.{i}.{part}.{b}", rows)
        for norm in norms:
            add(f"v.blk.{i}.{norm}.weight", w, around=1.0)
            for b in bias:
                add(f"v.blk.{i}.{norm}.{b}", w)
        if rope2d:
            add(f"v.blk.{i}.attn_q_norm.weight", head, around=1.0)
            add(f"v.blk.{i}.attn_k_norm.weight", head, around=1.0)
            add(f"v.blk.{i}.out_scale.weight", 1, around=1.0)
    if rope2d:
        add("v.std_bias", w)
        add("v.std_scale", w, around=1.0)
        add("mm.input_projection.weight", text_width, w)
        for stem, limit in (("v.blk.0.attn_q", 1.0), ("v.blk.0.ffn_down", 0.5), ("mm.input_projection", 1.5)):
            for end, sign in zip(("input_min", "input_max", "output_min", "output_max"), (-1, 1, -1, 1)):
                writer.add_tensor(f"{stem}.{end}", np.array([sign * limit], np.float32))
    else:
        add("v.post_ln.weight", w, around=1.0)
        add("v.post_ln.bias", w)
        add("mm.soft_emb_norm.weight", w, around=1.0)
        add("mm.input_projection.weight", w, text_width)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def vision_files(prompt: str, **paths: Path) -> dict[str, Any]:
    """What a references folder's ``tiny_vision.py`` prints (:mod:`leat.conformance.vision`): each file's path and
    SHA-256, and the prompt."""
    return {
        **{k: str(v) for k, v in paths.items()},
        "sha256": {k: sha256(v) for k, v in paths.items()},
        "prompt": prompt,
    }


def encode_png(rgb: np.ndarray) -> bytes:
    """``rgb`` [h, w, 3] bytes as a PNG (no filtering), for tests that send images."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    h, w = rgb.shape[:2]
    rows = b"".join(b"\0" + np.ascontiguousarray(rgb[y], np.uint8).tobytes() for y in range(h))
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
