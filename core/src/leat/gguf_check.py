"""Checks that a GGUF file is sound before any of its bytes is used as a count, a weight or a hyperparameter.

gguf-py trusts the file it reads: a tensor offset near 2**64 wraps around in its numpy arithmetic and maps the
header as weights, and a count of 2**64 - 1 loops until memory runs out. These checks do their arithmetic on Python
ints and raise a one-line :class:`ModelFileError` naming the tensor or metadata key at fault; callers put the file's
path in front. :class:`leat.modelfile.ModelFile` runs the structural ones while it reads a file, and
:func:`check_value` on each hyperparameter an architecture reads; :class:`leat.architecture.Architecture` runs
:func:`check_consistency` before it reads the hyperparameters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import gguf

from leat.errors import ModelFileError

K = gguf.Keys
V = gguf.GGUFValueType

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME less the terminating zero: llama.cpp refuses longer tensor names
SCALAR_BYTES = {V(k): v().itemsize for k, v in gguf.GGUFReader.gguf_scalar_to_np.items()}
# The fewest bytes an encoded item takes: a string is its 8-byte length, an array its item type and count.
MIN_VALUE_BYTES = {**SCALAR_BYTES, V.STRING: 8, V.ARRAY: 12}
MIN_KV_BYTES = 8 + 4 + 1  # an empty key, the value type, a one-byte value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # an empty name, the dimension count, one dimension, the type, the offset

# Hyperparameters an architecture reads, as gguf.Keys templates, and the integer range each must lie in.
INT_RANGES = {
    K.LLM.BLOCK_COUNT: (1, 4096),
    K.LLM.EMBEDDING_LENGTH: (1, 1 << 20),
    K.LLM.FEED_FORWARD_LENGTH: (0, 1 << 20),  # 0: no dense FFN (leat's qwen3 reads a missing one so)
    K.LLM.CONTEXT_LENGTH: (1, 1 << 32),
    K.Attention.HEAD_COUNT: (1, 1 << 16),
    K.Attention.HEAD_COUNT_KV: (1, 1 << 16),
    K.Attention.KEY_LENGTH: (1, 1 << 16),
    K.Attention.VALUE_LENGTH: (1, 1 << 16),
    K.Rope.DIMENSION_COUNT: (0, 1 << 16),
}
# Floats that must be finite and above 0 (epsilons also below 1).
# keys llama.cpp also reads as one value per layer (get_key_or_arr): Gemma 4's MLP widths and KV heads
PER_LAYER = {
    key.split(".", 1)[1] for key in (K.LLM.FEED_FORWARD_LENGTH, K.Attention.HEAD_COUNT, K.Attention.HEAD_COUNT_KV)
}
FLOAT_LIMITS = {
    K.Rope.FREQ_BASE: math.inf,
    K.Rope.FREQ_BASE_SWA: math.inf,
    K.Attention.LAYERNORM_EPS: 1.0,
    K.Attention.LAYERNORM_RMS_EPS: 1.0,
}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as its entry in the header describes it; ``dims`` in GGUF order (``dims[0]`` is the row length)."""

    name: str
    dims: tuple[int, ...]
    type_code: int
    offset: int  # from the start of the data section


def check_count(what: str, count: int, min_bytes: int, available: int) -> None:
    """A count read from the file must fit in the ``available`` bytes that follow, at ``min_bytes`` per item."""
    if count * min_bytes > available:
        raise ModelFileError(
            f"malformed or truncated: {count} {what} declared, but only {available} bytes follow to hold them"
        )


def check_alignment(value: Any, types: list[V]) -> int:
    """``general.alignment``: a uint32 power of two."""
    if types != [V.UINT32]:
        raise ModelFileError(f"metadata key {K.General.ALIGNMENT} must be a uint32, not {_type_names(types)}")
    if value < 1 or value & (value - 1):
        raise ModelFileError(f"metadata key {K.General.ALIGNMENT} is {value}, not a power of two")
    return value


def check_tensor_name(name: str) -> None:
    if len(name.encode()) > MAX_NAME_BYTES or not name.isprintable():
        raise ModelFileError(f"tensor name {name[:80]!r} is not a printable name of at most {MAX_NAME_BYTES} bytes")


def tensor_nbytes(info: TensorInfo) -> int:
    """The bytes of the tensor's data as its type and shape say."""
    try:
        qtype = gguf.GGMLQuantizationType(info.type_code)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ModelFileError(f"tensor {info.name}: unknown type code {info.type_code}") from None
    if not 1 <= len(info.dims) <= MAX_DIMS:
        raise ModelFileError(f"tensor {info.name}: {len(info.dims)} dimensions, not 1 to {MAX_DIMS}")
    if min(info.dims) < 1:
        raise ModelFileError(f"tensor {info.name}: shape {list(info.dims)} has an empty dimension")
    if info.dims[0] % block:
        raise ModelFileError(
            f"tensor {info.name}: rows of {info.dims[0]} values do not fill whole {qtype.name} blocks of {block}"
        )
    return math.prod(info.dims) // block * block_bytes


def check_tensors(infos: Sequence[TensorInfo], data_start: int, file_size: int, alignment: int) -> None:
    """Every tensor's data lies in the file, aligned, apart from the others and, as llama.cpp requires, right after
    the previous tensor's (padded) data: a gap means a type or shape in the header does not match the bytes."""
    spans, names = [], set()
    for info in infos:
        if info.name in names:
            raise ModelFileError(f"tensor {info.name} appears twice")
        names.add(info.name)
        nbytes = tensor_nbytes(info)
        if info.offset % alignment:
            raise ModelFileError(
                f"tensor {info.name}: data offset {info.offset} is not a multiple of {K.General.ALIGNMENT} {alignment}"
            )
        end = data_start + info.offset + nbytes
        if end > file_size:
            raise ModelFileError(
                f"tensor {info.name}: its {nbytes} bytes at data offset {info.offset} end at byte {end}, past the end "
                f"of the file ({file_size} bytes): truncated, or a wrong offset, type or shape"
            )
        spans.append((info.offset, info.offset + nbytes, info.name))
    _check_disjoint(spans)
    data_end = data_start + _check_back_to_back(spans, alignment)
    if spans and file_size > data_end:
        raise ModelFileError(
            f"{file_size - data_end} bytes after the data of the last tensor, {spans[-1][2]}, belong to no tensor: "
            f"a type or shape in the header does not match the data"
        )


def _check_disjoint(spans: list[tuple[int, int, str]]) -> None:
    ordered = sorted(spans, key=lambda span: span[0])
    for (start, end, name), (next_start, _, next_name) in itertools.pairwise(ordered):
        if next_start == start:
            raise ModelFileError(f"tensors {name} and {next_name} have the same data offset {start}")
        if next_start < end:
            raise ModelFileError(f"tensor {next_name} at data offset {next_start} overlaps tensor {name}")


def _check_back_to_back(spans: list[tuple[int, int, str]], alignment: int) -> int:
    """The padded end of the data; raises where a tensor does not start where the previous one's data ends."""
    expected, previous = 0, None
    for start, end, name in spans:
        if start != expected:
            after = f"the padded end of {previous}" if previous else "the start of the data section"
            raise ModelFileError(
                f"tensor {name}: data offset {start}, but {after} is at {expected}: the tensors are out of order, "
                f"or a type or shape in the header does not match the data"
            )
        expected, previous = -(-end // alignment) * alignment, name
    return expected


def check_value(architecture: str, key: str, value: Any) -> None:
    """A hyperparameter ``key`` (with the architecture filled in) that an architecture reads must be in range."""
    if key in _int_ranges(architecture):
        low, high = _int_ranges(architecture)[key]
        per_layer = isinstance(value, list) and value and key.split(".", 1)[1] in PER_LAYER
        for item in value if per_layer else [value]:
            if not isinstance(item, int) or isinstance(item, bool):
                raise ModelFileError(f"metadata key {key} must be an integer, not {_show(value)}")
            if not low <= item <= high:
                raise ModelFileError(f"metadata key {key} is {value}, outside {low} to {high}")
    elif key in _float_limits(architecture):
        high = _float_limits(architecture)[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ModelFileError(f"metadata key {key} must be a number, not {_show(value)}")
        if not (math.isfinite(value) and 0 < value < high):
            bound = "" if math.isinf(high) else f" and below {high:g}"
            raise ModelFileError(f"metadata key {key} is {value:g}; it must be finite, above 0{bound}")


def check_consistency(architecture: str, metadata: Mapping[str, Any]) -> None:
    """Relations between hyperparameters that hold in every architecture (llama.cpp asserts most of them), checked
    where the file states both sides as integers (a per-layer array is the architecture's own to check): query heads
    shared evenly among the KV heads, RoPE on an even number of dimensions within a head, 1 to ``expert_count``
    experts used per token, and expert groups of whole experts."""

    def integer(template: str) -> tuple[str, int | None]:
        key = template.format(arch=architecture)
        value = metadata.get(key)
        if not isinstance(value, int) or isinstance(value, bool):
            return key, None
        check_value(architecture, key, value)
        return key, value

    (heads_key, heads), (kv_key, kv) = integer(K.Attention.HEAD_COUNT), integer(K.Attention.HEAD_COUNT_KV)
    if heads is not None and kv is not None and heads % kv:
        raise ModelFileError(f"metadata key {kv_key} is {kv}, which does not divide {heads_key} {heads}")
    rope_key, rope = integer(K.Rope.DIMENSION_COUNT)
    if rope is not None:
        if rope % 2:
            raise ModelFileError(f"metadata key {rope_key} is {rope}, an odd number: RoPE turns pairs of dimensions")
        head_key, head = integer(K.Attention.KEY_LENGTH)
        width_key, width = integer(K.LLM.EMBEDDING_LENGTH)
        if head is None and width is not None and heads is not None:
            head_key, head = f"{width_key} / {heads_key}", width // heads
        if head is not None and rope > head:
            raise ModelFileError(f"metadata key {rope_key} is {rope}, more than the head size {head} ({head_key})")
    (experts_key, experts), (used_key, used) = integer(K.LLM.EXPERT_COUNT), integer(K.LLM.EXPERT_USED_COUNT)
    if experts is not None and used is not None and (used > experts or (experts and not used)):
        allowed = f"1 to {experts}" if experts else "0"
        raise ModelFileError(f"metadata key {used_key} is {used}; with {experts_key} {experts} it must be {allowed}")
    (groups_key, groups), (groups_used_key, groups_used) = (
        integer(K.LLM.EXPERT_GROUP_COUNT),
        integer(K.LLM.EXPERT_GROUP_USED_COUNT),
    )
    if groups is not None and groups > 1:
        if experts is not None and experts % groups:
            raise ModelFileError(
                f"metadata key {groups_key} is {groups}, which does not divide {experts_key} {experts}"
            )
        if groups_used is not None and not 0 < groups_used <= groups:
            raise ModelFileError(
                f"metadata key {groups_used_key} is {groups_used}; with {groups_key} {groups} it must be 1 to {groups}"
            )


@cache
def _int_ranges(architecture: str) -> dict[str, tuple[int, int]]:
    return {key.format(arch=architecture): limits for key, limits in INT_RANGES.items()}


@cache
def _float_limits(architecture: str) -> dict[str, float]:
    return {key.format(arch=architecture): limit for key, limit in FLOAT_LIMITS.items()}


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _type_names(types: list[V]) -> str:
    return "/".join(t.name.lower() for t in types) or "nothing"
