"""Hyperparameters declared once: each field of an architecture's hyperparameter dataclass says where its value
lives in a GGUF file, and reading a file (:func:`read`) and writing a test file's metadata (:func:`write`) follow
from the declarations, in field order::

    @dataclass(frozen=True, kw_only=True)
    class LlamaParams:
        layers: int = key(K.LLM.BLOCK_COUNT)
        heads: int = key(K.Attention.HEAD_COUNT)
        kv_heads: int = key(K.Attention.HEAD_COUNT_KV, missing=lambda v: v["heads"])
        norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-5)
        tied: bool = derived(lambda file, v: "output.weight" not in file.tensors, True)

Keys are ``gguf.Keys`` names (``{arch}`` is the file's architecture). Values are written with gguf-py's types for
them: an int as uint32, a float as float32, a bool, a str, a list or tuple as an array; a field whose value is None
is not written (the key is absent).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

import gguf

from leat.errors import ModelFileError
from leat.modelfile import ModelFile

K = gguf.Keys

REQUIRED: Any = object()  # missing=REQUIRED: a file must have the key, whatever the dataclass default
_UNSET: Any = object()


def key(
    gguf_key: str,
    default: Any = dataclasses.MISSING,
    *,
    missing: Any = _UNSET,
    also: tuple[str, ...] = (),
    read: Callable[[ModelFile, dict[str, Any]], Any] | None = None,
) -> Any:
    """A field stored under ``gguf_key``.

    ``default`` is the dataclass default (what ``tiny()`` leaves unset). ``missing`` is the value when a file lacks
    the key, or a function of the fields read before it; without it a missing key is an error naming the key (with a
    ``default`` and no ``missing``, the default is the missing value). ``also``: more keys written with the same
    value (llama.cpp's value_length beside key_length). ``read(file, values)`` reads the field some other way than
    the key (a tensor's shape), where files in use may lack the key; it is still written under the key.
    """
    if missing is _UNSET:
        missing = REQUIRED if default is dataclasses.MISSING else default
    meta = {"gguf": gguf_key, "missing": missing, "also": also, "read": read}
    return dataclasses.field(default=default, metadata=meta)


def derived(read: Callable[[ModelFile, dict[str, Any]], Any], default: Any = dataclasses.MISSING) -> Any:
    """A field read from the file some other way than a key (a tensor's shape or presence) and never written as
    metadata: a test file gets it through its tensors."""
    return dataclasses.field(default=default, metadata={"read": read})


def tensor_rows(name: str) -> Callable[[ModelFile, dict[str, Any]], int]:
    """A reader: the first dimension of tensor ``name`` (a vocabulary from the embedding)."""
    return lambda file, values: int(file.tensor(name).shape[0])


def has_tensor(name: str) -> Callable[[ModelFile, dict[str, Any]], bool]:
    """A reader: whether the file has tensor ``name`` (an untied output, optional biases)."""
    return lambda file, values: name in file.tensors


def with_tensor(tensor_name: str, gguf_key: str) -> Callable[[ModelFile, dict[str, Any]], Any]:
    """A reader: ``gguf_key`` (a missing key is an error naming it) when the file has tensor ``tensor_name``, else
    None (a mixture of experts' keys, required when its tensors are there)."""
    return lambda file, values: file.get(gguf_key) if tensor_name in file.tensors else None


def read(cls: type, file: ModelFile) -> Any:
    """An instance of the hyperparameter dataclass ``cls`` from ``file``, field by field in declaration order."""
    values: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if meta.get("read") is not None:
            value = meta["read"](file, values)
            values[field.name] = _convert(value, hints[field.name]) if "gguf" in meta else value
        elif "gguf" in meta:
            value = file.get(meta["gguf"], REQUIRED)
            if value is REQUIRED:
                missing = meta["missing"]
                value = file.get(meta["gguf"]) if missing is REQUIRED else missing
                value = value(values) if callable(value) else value
            values[field.name] = _convert(value, hints[field.name])
            # one number (int, int | None) or numbers (tuple[int, ...], int | tuple[int, ...]): the hint's members
            kinds = () if typing.get_origin(h := hints[field.name]) in (list, tuple) else typing.get_args(h) or (h,)
            if isinstance(value, list) and int in kinds and not {list, tuple} & {typing.get_origin(k) for k in kinds}:
                key = meta["gguf"].format(arch=file.architecture)
                raise ModelFileError(f"{file.path}: metadata key {key} is an array, where this family takes one number")
    return cls(**values)


def write(writer: gguf.GGUFWriter, params: Any) -> None:
    """The metadata keys of ``params``, as :func:`read` reads them back."""
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if "gguf" not in field.metadata or value is None:
            continue
        for name in (field.metadata["gguf"], *field.metadata["also"]):
            _add(writer, name.format(arch=writer.arch), value)


def _add(writer: gguf.GGUFWriter, name: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(name, value)
    elif isinstance(value, int):
        writer.add_uint32(name, value)
    elif isinstance(value, float):
        writer.add_float32(name, value)
    elif isinstance(value, str):
        writer.add_string(name, value)
    else:
        writer.add_array(name, list(value))


def _convert(value: Any, hint: Any) -> Any:
    """A metadata value as the field's type: a list as a tuple, a scalar as the first of int, float, bool, str the
    hint names (``int | None`` -> int)."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(value)
    kinds = typing.get_args(hint) or (hint,)
    for kind in kinds:
        if kind in (int, float, bool, str):
            return kind(value)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderParams:
    """What decoder-only families state alike, in the order llama.cpp's converters write it. A family subclasses it
    and adds its own fields; redeclaring one of these changes its default or reading and keeps its place."""

    layers: int = key(K.LLM.BLOCK_COUNT)
    context: int = key(K.LLM.CONTEXT_LENGTH, 4096)
    width: int = key(K.LLM.EMBEDDING_LENGTH)
    ffn: int = key(K.LLM.FEED_FORWARD_LENGTH)
    heads: int = key(K.Attention.HEAD_COUNT)
    kv_heads: int = key(K.Attention.HEAD_COUNT_KV, missing=lambda v: v["heads"])
    head_dim: int = key(
        K.Attention.KEY_LENGTH, missing=lambda v: v["width"] // v["heads"], also=(K.Attention.VALUE_LENGTH,)
    )
    norm_eps: float = key(K.Attention.LAYERNORM_RMS_EPS, 1e-5, missing=REQUIRED)
