"""The tiny random-weight llama files the llama.cpp references were recorded on, and how to rebuild them.

Shared by ``record_llamacpp.py`` (which records llama.cpp's logits on them) and
``tests/test_llamacpp_agreement.py`` (which rebuilds them, checks their SHA-256 against the recording and
compares leat's float64 oracle with the recorded logits). Files are rebuilt bit for bit from a
configuration: :func:`leat.testing.write_tiny_gguf` for the types gguf-py can quantize (F32, F16, Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1), and :func:`write_tiny_kquant_gguf` for K-quants, which gguf-py can dequantize
but not quantize: the small round-to-nearest K-quant quantizers below pack blocks in exactly the layout
gguf-py (and llama.cpp) reads, and check themselves against gguf-py's dequantizer.

Run as a script (in the environment leat is installed in) to build every file into a folder and print a
JSON object ``{name: {"path": ..., "sha256": ...}}``, plus the path of the pulled default model::

    uv run python tests/references/tiny_models.py OUTDIR
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256

# name -> (quant type, seed, overrides of Llama.tiny(), how many tokens of the prompt text to use)
# Llama.tiny(): 2 layers, width 64, ffn 128, 4 heads of 16, 2 kv heads (GQA 2), vocab 300, tied output.
CONFIGS: dict[str, dict[str, Any]] = {
    "f32": {"qtype": "F32", "seed": 0, "params": {}, "tokens": 64},
    "f32-mha-untied": {"qtype": "F32", "seed": 1, "params": {"kv_heads": 4, "tied": False}, "tokens": 64},
    "f32-gqa4-llama3": {
        "qtype": "F32",
        "seed": 2,
        "params": {"heads": 8, "kv_heads": 2, "head_dim": 8, "rope_freqs": True, "rope_base": 500000.0},
        "tokens": 100,
    },
    "f32-odd-heads": {"qtype": "F32", "seed": 3, "params": {"layers": 3, "heads": 3, "kv_heads": 1}, "tokens": 64},
    "f16": {"qtype": "F16", "seed": 4, "params": {}, "tokens": 64},
    "f16-untied-gqa4": {"qtype": "F16", "seed": 5, "params": {"kv_heads": 1, "tied": False}, "tokens": 64},
    "q8_0": {"qtype": "Q8_0", "seed": 6, "params": {}, "tokens": 64},
    "q8_0-untied-odd-heads": {
        "qtype": "Q8_0",
        "seed": 7,
        "params": {"heads": 3, "kv_heads": 1, "head_dim": 32, "tied": False},
        "tokens": 64,
    },
    "q4_0": {"qtype": "Q4_0", "seed": 8, "params": {"tied": False}, "tokens": 64},
    "q4_1": {"qtype": "Q4_1", "seed": 9, "params": {"heads": 8, "kv_heads": 2, "head_dim": 8}, "tokens": 64},
    "q5_0": {"qtype": "Q5_0", "seed": 10, "params": {}, "tokens": 64},
    "q5_1": {"qtype": "Q5_1", "seed": 11, "params": {"kv_heads": 4}, "tokens": 64},
    "q6_k": {
        "qtype": "Q6_K",
        "seed": 12,
        "params": {"width": 256, "ffn": 512, "heads": 4, "kv_heads": 1, "head_dim": 64},
        "tokens": 64,
    },
    "q5_k": {
        "qtype": "Q5_K",
        "seed": 13,
        "params": {"width": 256, "ffn": 256, "heads": 4, "kv_heads": 4, "head_dim": 64, "tied": False},
        "tokens": 64,
    },
    "q4_k-llama3": {
        "qtype": "Q4_K",
        "seed": 14,
        "params": {
            "width": 256,
            "ffn": 256,
            "heads": 8,
            "kv_heads": 2,
            "head_dim": 32,
            "tied": False,
            "rope_freqs": True,
            "rope_base": 500000.0,
        },
        "tokens": 100,
    },
}

# The text each tiny file is fed (tokenized by llama.cpp with its BOS; the first ``tokens`` ids are used).
PROMPT_TEXT = (
    "the quick brown fox jumps over the lazy dog. hello world, this is a tiny test model for leat and "
    "llama.cpp. the sky is blue because of rayleigh scattering of sunlight in the atmosphere, and sunsets "
    "are red for the same reason: 1 + 2 = 3, def f(x): return x * 2 # Ünïcödé ✓ 漢字 🙂 tabs\tand\nnewlines."
)


def sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def params_for(config: dict[str, Any]) -> Any:
    from leat_arch_llama.llama import Llama

    return Llama.tiny(**config["params"])


def build(name: str, path: str | Path) -> Path:
    """Write the tiny file of configuration ``name`` to ``path`` (deterministic: same bytes every time)."""
    from leat.testing import write_tiny_gguf
    from leat_arch_llama.llama import Llama

    config = CONFIGS[name]
    qtype = Q[config["qtype"]]
    params = params_for(config)
    if qtype in KQUANTIZERS:
        return write_tiny_kquant_gguf(Llama, path, qtype, config["seed"], params)
    return write_tiny_gguf(Llama, path, qtype, config["seed"], params)


# -- K-quants ----------------------------------------------------------------------------------------
# Round-to-nearest: not llama.cpp's error-minimizing search, but any valid block is a fine test of a
# dequantizer and of the matmuls that consume it. Each packer is the inverse of gguf-py's unpacking.


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0.0)


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins into 12 bytes (the Q4_K/Q5_K layout)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=1)


def _scales_mins(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block: x ~ d*sc*q - dmin*m with q in [0, levels], sc and m 6-bit; returns packed parts."""
    sub = x.reshape(len(x), 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / levels
    mins = -lo
    d = _f16(scale.max(axis=-1) / 63)
    dmin = _f16(mins.max(axis=-1) / 63)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[:, None])), 0, 63)
    m = np.clip(np.round(_divide(mins, dmin.astype(np.float32)[:, None])), 0, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round(_divide(sub + offset[..., None], step[..., None])), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, q


def _meant_k4(d, dmin, sc, m, q) -> np.ndarray:
    """The values Q4_K/Q5_K blocks decode to: d*sc*q - dmin*m per 32-value sub-block."""
    step = (d.astype(np.float32)[:, None] * sc.astype(np.float32))[..., None]
    offset = (dmin.astype(np.float32)[:, None] * m.astype(np.float32))[..., None]
    return (step * q.astype(np.float32) - offset).reshape(len(q), QK_K)


def quantize_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 256 float32 values -> (Q4_K blocks of 144 bytes, the values they decode to)."""
    d, dmin, sc, m, q = _scales_mins(x, 15)
    meant = _meant_k4(d, dmin, sc, m, q)
    q = q.reshape(len(x), 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(x), 128)
    packed = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scale_min_k4(sc, m), qs], axis=1
    )
    return packed, meant


def quantize_q5_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 256 float32 values -> (Q5_K blocks of 176 bytes, the values they decode to)."""
    d, dmin, sc, m, q = _scales_mins(x, 31)
    meant = _meant_k4(d, dmin, sc, m, q)
    low = (q & 0x0F).reshape(len(x), 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(len(x), 128)
    high = (q >> 4).reshape(len(x), 8, 32)
    qh = np.zeros((len(x), 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    packed = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), _pack_scale_min_k4(sc, m), qh, qs],
        axis=1,
    )
    return packed, meant


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 256 float32 values -> (Q6_K blocks of 210 bytes, the values they decode to).

    x ~ d*sc*(q-32) with 16 int8 scales of 16 values each and q 6-bit.
    """
    n = len(x)
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = _f16(scale.max(axis=-1) / 127)
    sc = np.clip(np.round(_divide(scale, d.astype(np.float32)[:, None])), -128, 127)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(_divide(sub, step[..., None])), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    meant = (step[..., None].astype(np.float32) * (q.reshape(n, 16, 16).astype(np.float32) - 32)).reshape(n, 256)
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    packed = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return packed, meant


KQUANTIZERS = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k}


def quantize_k(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """A K-quant tensor of ``values`` ([..., n*256] float32) as gguf stores it: uint8 [..., bytes per row].

    The result is checked against gguf-py's dequantizer: what it decodes must be the quantized values
    this packer meant (so a packing slip cannot silently produce a different, still valid, file).
    """
    values = np.asarray(values, dtype=np.float32)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rows = values.reshape(-1, QK_K)
    packed, meant = KQUANTIZERS[qtype](rows)
    assert packed.shape == (len(rows), block_bytes), (packed.shape, block_bytes)
    decoded = gguf.quants.dequantize(packed, qtype).reshape(rows.shape)
    if not np.allclose(decoded, meant, rtol=1e-6, atol=1e-7):
        raise AssertionError(f"{qtype.name} packer disagrees with gguf-py's unpacking")
    if not np.all(np.abs(decoded - rows).max(axis=-1) <= np.abs(rows).max(axis=-1) * 0.2 + 1e-6):
        raise AssertionError(f"{qtype.name} quantization error is implausibly large")
    return packed.reshape(*values.shape[:-1], values.shape[-1] // QK_K * block_bytes)


def write_tiny_kquant_gguf(
    architecture: Any, path: str | Path, qtype: gguf.GGMLQuantizationType, seed: int, params: Any
):
    """:func:`leat.testing.write_tiny_gguf` for K-quants (same tensors, values, metadata and vocabulary)."""
    from leat.blocks import random_tensor
    from leat.testing import add_tiny_tokenizer, quantizable

    path = Path(path)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, architecture.names[0])
    writer.add_name(f"tiny-{architecture.names[0]}")
    architecture.write_metadata(writer, params)
    add_tiny_tokenizer(writer, params.vocab)
    for name, shape in architecture.tensor_shapes(params).items():
        values = random_tensor(rng, shape, name)
        if quantizable(shape, qtype):
            writer.add_tensor(name, quantize_k(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def describe(name: str) -> dict[str, Any]:
    """A configuration as stored in the manifest: quant type, seed and the full hyperparameters."""
    config = CONFIGS[name]
    return {**config, "hyperparameters": dataclasses.asdict(params_for(config))}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: tiny_models.py OUTDIR")
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name in CONFIGS:
        path = build(name, out / f"tiny-{name}.gguf")
        built[name] = {"path": str(path), "sha256": sha256(path), **describe(name)}
    from leat.pull import resolve

    default = resolve("default")
    versions = {"gguf": metadata.version("gguf"), "numpy": np.__version__}
    print(json.dumps({"tiny": built, "default_model": str(default), "generator_versions": versions}))


if __name__ == "__main__":
    main(sys.argv[1:])
