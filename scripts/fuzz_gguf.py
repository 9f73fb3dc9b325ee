"""Mutation fuzzing of GGUF loading: how many damaged files load into garbage or fail with an untyped exception.

    uv run python scripts/fuzz_gguf.py --mutants 500 --seed 0

Writes a tiny random-weight llama GGUF, computes its logits on the CPU backend, then loads mutants of it (truncations,
byte flips in the header, metadata and tensor infos, huge counts, tensor offset and type rewrites, out-of-range
hyperparameters, and in-range ones at odds with the tensor shapes or with each other; one to three per mutant) and
counts how each load ends:

* clean error: a LeatError with a one-line message
* same logits: it loads and gives the unmutated file's logits bit for bit (e.g. a flip in a key nobody reads)
* other model: it loads with finite logits after a metadata value changed: a valid file of another model
* garbage: it loads, but its logits are not finite, or differ although no metadata value changed
* untyped: any other exception, or a LeatError whose message is not one line

core/tests/test_gguf_validation.py drives the same mutations with Hypothesis.
"""

from __future__ import annotations

import argparse
import math
import random
import resource
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import leat
import numpy as np
from leat.errors import LeatError
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

TOKENS = [1, 2, 3, 200]
K = gguf.Keys
V = gguf.GGUFValueType
HEADER_BYTES = 24  # magic, version, tensor count, metadata count
COUNT_VALUES = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 - 1]
TYPE_VALUES = [*range(42), 1000, 2**31, 2**32 - 1]
# Hyperparameters the llama architecture reads, and values to set them to: out of range (zero, negative, huge, not
# finite), or in range but at odds with the tensor shapes.
HYPERPARAMETERS = [
    K.LLM.BLOCK_COUNT,
    K.LLM.EMBEDDING_LENGTH,
    K.LLM.FEED_FORWARD_LENGTH,
    K.LLM.CONTEXT_LENGTH,
    K.Attention.HEAD_COUNT,
    K.Attention.HEAD_COUNT_KV,
    K.Attention.KEY_LENGTH,
    K.Attention.LAYERNORM_RMS_EPS,
    K.Rope.FREQ_BASE,
    K.Rope.DIMENSION_COUNT,
]
INT_VALUES = [0, 2**31 - 1, 2**32 - 1]
IN_RANGE_INT_VALUES = [1, 3, 2**16]
FLOAT_VALUES = [0.0, -1.0, -1e-5, math.nan, math.inf, -math.inf, 1e-30, 1e30]

# ``below(n)`` picks an int in [0, n): random.Random.randrange here, a Hypothesis draw in the test.
Below = Callable[[int], int]


@dataclass(frozen=True)
class Mutation:
    kind: str
    at: int  # where ``data`` is written; for "truncate" the new length
    data: bytes = b""
    semantic: bool = False  # it changes a metadata value, so a file that still loads may be another valid model

    def __str__(self) -> str:
        return f"{self.kind} at {self.at}" + (f" <- {self.data.hex()}" if self.data else "")


@dataclass(frozen=True)
class TensorSpot:
    name: str
    type_at: int  # where its type code is
    offset_at: int  # where its data offset is
    offset: int


@dataclass(frozen=True)
class Layout:
    """Where things are in the unmutated file."""

    size: int
    infos_end: int  # the end of the last tensor info: header, metadata and tensor infos lie before it
    alignment: int
    data_start: int
    tensors: list[TensorSpot]
    hyperparameters: dict[str, tuple[int, V]]  # key of HYPERPARAMETERS -> where its scalar value is, its type
    value_bytes: frozenset[int]  # where metadata values are (not keys, types or lengths)


def tiny_model(folder: Path) -> Path:
    params = Llama.tiny(layers=1, width=32, ffn=64, heads=2, kv_heads=1, head_dim=16, vocab=272, context=64)
    return write_tiny_gguf(Llama, folder / "tiny.gguf", params=params)


def layout(path: Path) -> Layout:
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data

    def position(part: np.ndarray) -> int:
        return part.ctypes.data - base

    value_bytes, hyperparameters = set(), {}
    keys = {key.format(arch="llama") for key in HYPERPARAMETERS}
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        for i in field.data:
            start = position(field.parts[i])
            value_bytes.update(range(start, start + field.parts[i].nbytes))
        if field.name in keys:
            hyperparameters[field.name] = (position(field.parts[-1]), field.types[0])
    tensors = [
        TensorSpot(t.name, position(t.field.parts[4]), position(t.field.parts[5]), int(t.field.parts[5][0]))
        for t in reader.tensors
    ]
    return Layout(
        path.stat().st_size,
        tensors[-1].offset_at + 8,
        int(reader.alignment),
        int(reader.data_offset),
        tensors,
        hyperparameters,
        frozenset(value_bytes),
    )


def mutations(where: Layout, below: Below) -> list[Mutation]:
    """One to three mutations of a file laid out as ``where``."""
    return [mutation(where, below) for _ in range(1 + below(3))]


def mutation(where: Layout, below: Below) -> Mutation:
    kinds = [_truncate, _flip, _count, _offset, _type_code, _hyperparameter]
    return kinds[below(len(kinds))](where, below)


def set_u64(kind: str, at: int, value: int) -> Mutation:
    return Mutation(kind, at, struct.pack("<Q", value % 2**64))


def set_u32(kind: str, at: int, value: int) -> Mutation:
    return Mutation(kind, at, struct.pack("<I", value % 2**32), semantic=kind == "hyperparameter")


def set_f32(kind: str, at: int, value: float) -> Mutation:
    return Mutation(kind, at, struct.pack("<f", value), semantic=kind == "hyperparameter")


def _pick(below: Below, values: Sequence):
    return values[below(len(values))]


def _truncate(where: Layout, below: Below) -> Mutation:
    end = where.infos_end if below(2) else where.size
    return Mutation("truncate", below(end))


def _flip(where: Layout, below: Below) -> Mutation:
    at = below(where.infos_end)
    mask = 1 << below(8) if below(2) else 1 + below(255)
    return Mutation("flip", at, bytes([mask]), semantic=at in where.value_bytes)


def _count(where: Layout, below: Below) -> Mutation:
    return set_u64("count", _pick(below, [8, 16]), _pick(below, COUNT_VALUES))


def _offset(where: Layout, below: Below) -> Mutation:
    spot, other = _pick(below, where.tensors), _pick(below, where.tensors).offset
    at, offset = spot.offset_at, spot.offset
    choices = [
        2**64 - where.data_start,  # wraps to the start of the file: the header read as weights
        2**64 - where.data_start + HEADER_BYTES + 8 * below(64),
        other,  # aliases another tensor
        offset + 1 + below(where.alignment - 1),  # misaligned
        offset + where.alignment,
        offset - where.alignment,
        offset + 2**32,
        below(2**64),
    ]
    return set_u64("offset", at, _pick(below, choices))


def _type_code(where: Layout, below: Below) -> Mutation:
    at = _pick(below, where.tensors).type_at
    return set_u32("type", at, _pick(below, TYPE_VALUES))


def _hyperparameter(where: Layout, below: Below) -> Mutation:
    at, vtype = _pick(below, list(where.hyperparameters.values()))
    if vtype == V.FLOAT32:
        return set_f32("hyperparameter", at, _pick(below, FLOAT_VALUES))
    return set_u32("hyperparameter", at, _pick(below, INT_VALUES + IN_RANGE_INT_VALUES))


def apply(blob: bytes, changes: Sequence[Mutation]) -> bytes:
    for m in changes:
        if m.kind == "truncate":
            blob = blob[: m.at]
        elif m.kind == "flip":
            if m.at < len(blob):
                blob = blob[: m.at] + bytes([blob[m.at] ^ m.data[0]]) + blob[m.at + 1 :]
        else:
            blob = blob[: m.at] + m.data + blob[m.at + len(m.data) :]
    return blob


def logits(path: Path) -> np.ndarray:
    model = leat.load(str(path), backend="cpu")
    return model.logits(TOKENS)


def outcome(path: Path, reference: np.ndarray, semantic: bool) -> tuple[str, str]:
    """How loading ``path`` ends: a category of the module docstring, and what happened."""
    try:
        got = logits(path)
    except LeatError as e:
        if "\n" in str(e):
            return "untyped", f"{type(e).__name__} of several lines: {e!r}"
        return "clean error", str(e)
    except Exception as e:  # noqa: BLE001 - what the fuzzer is looking for
        return "untyped", f"{type(e).__name__}: {e}"
    if got.shape == reference.shape and np.array_equal(got, reference):
        return "same logits", ""
    if semantic and np.isfinite(got).all():
        return "other model", ""
    return "garbage", f"logits {got.shape}, finite: {bool(np.isfinite(got).all())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--show", type=int, default=10, help="print this many garbage and untyped cases")
    args = parser.parse_args()
    # A mutant that asks for a huge allocation must fail with MemoryError, not swap the machine.
    resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, resource.RLIM_INFINITY))
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="fuzz_gguf-"))
    original = tiny_model(folder)
    reference, where, blob = logits(original), layout(original), original.read_bytes()
    counts, shown = Counter(), 0
    for i in range(args.mutants):
        changes = mutations(where, rng.randrange)
        path = folder / f"mutant-{i}.gguf"
        path.write_bytes(apply(blob, changes))
        category, detail = outcome(path, reference, any(m.semantic for m in changes))
        path.unlink()
        counts[category] += 1
        if category in ("garbage", "untyped") and shown < args.show:
            shown += 1
            print(f"{category}: {', '.join(map(str, changes))}: {detail}")
    print(f"mutants run: {args.mutants}")
    for category in ("clean error", "same logits", "other model", "garbage", "untyped"):
        print(f"  {category}: {counts[category]}")


if __name__ == "__main__":
    main()
