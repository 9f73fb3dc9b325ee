"""A GGUF model file: typed metadata and memory-mapped tensors, split files included.

Reading goes through ``gguf.GGUFReader`` (mmap, no copy of the weights), with every count, string, tensor
shape, type and offset checked by :mod:`leat.gguf_check` first, and each hyperparameter an architecture reads
through :meth:`ModelFile.get` checked to be in range. Every way a file can be wrong (not GGUF, truncated, garbled,
missing key) becomes a one-line :class:`ModelFileError` naming the file.
"""

from __future__ import annotations

import itertools
import re
import struct
import sys
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import gguf
import numpy as np

from leat import gguf_check
from leat.errors import ModelFileError

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MISSING = object()


@dataclass(frozen=True)
class Tensor:
    """One tensor as stored: ``shape`` in row-major (numpy) order, ``data`` the raw mmapped blocks."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def split_parts(path: Path) -> list[Path]:
    """All parts of a split GGUF given its first part (``NAME-00001-of-0000N.gguf``), else ``[path]``."""
    match = SPLIT_NAME.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise ModelFileError(f"{path}: split GGUF is missing part(s) {', '.join(missing)} in {path.parent}")
    return parts


class StringArray(Sequence[str]):
    """A GGUF array of strings where the file has it: the mapped bytes and where each string's length starts; an item
    is decoded (UTF-8, invalid bytes replaced) when asked for. A vocabulary and its merges (100k strings) take 8 bytes
    a string this way, where Python strings took 8 MB more."""

    def __init__(self, raw: memoryview, starts: array):
        self._raw, self._starts = raw, starts  # starts: count + 1 offsets, the last one the array's end

    def __len__(self) -> int:
        return len(self._starts) - 1

    def _bytes(self, index: int) -> memoryview:
        return self._raw[self._starts[index] + 8 : self._starts[index + 1]]

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"string {index} of {len(self)}")
        return str(self._bytes(index % len(self)), "utf-8", "replace")

    def __iter__(self) -> Iterator[str]:
        starts = self._starts
        base = starts[0]
        data = bytes(self._raw[base : starts[len(starts) - 1]])  # one copy: slicing bytes beats a view per string
        return (data[a - base + 8 : b - base].decode("utf-8", "replace") for a, b in itertools.pairwise(starts))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    def empty(self) -> list[int]:
        """The indices of empty strings."""
        return [i for i in range(len(self)) if self._starts[i + 1] - self._starts[i] == 8]


V = gguf.GGUFValueType
SCALARS = {V(k): np.dtype(v) for k, v in gguf.GGUFReader.gguf_scalar_to_np.items()}


class _MetadataField(gguf.ReaderField):
    """A field whose value was parsed once; ``contents()`` returns it (``data`` holds it)."""

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        value = self.data[0]
        return value[index_or_slice] if isinstance(value, list) else value


class _Reader(gguf.GGUFReader):
    """gguf-py's reader with metadata and tensor infos parsed by ``np.frombuffer`` and slicing instead of one numpy
    view per array element (gguf-py takes about 10 s on a 262k-token vocabulary, this a fraction of one), every
    count and length checked against the file's size, and every tensor checked by :mod:`leat.gguf_check` before
    gguf-py maps its data."""

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            raise ModelFileError("a big-endian GGUF file: leat reads little-endian ones only")
        buf = self.data
        gguf_check.check_count("metadata entries", int(count), gguf_check.MIN_KV_BYTES, len(buf) - offs)
        for _ in range(count):
            start = offs
            key, offs = self._string(buf, offs)
            vtype = V(int(np.frombuffer(buf, np.uint32, 1, offs)[0]))
            value, types, offs = self._value(buf, offs + 4, vtype)
            parts = [np.array([value], dtype=SCALARS[vtype])] if vtype in SCALARS else []
            self._push_field(_MetadataField(start, key, parts, [value], types), skip_sum=True)
        return offs

    @staticmethod
    def _string(buf: np.ndarray, offs: int) -> tuple[str, int]:
        length = int(np.frombuffer(buf, np.uint64, 1, offs)[0])
        end = offs + 8 + length
        if end > len(buf):
            raise ModelFileError(f"malformed or truncated: a string of {length} bytes at byte {offs} runs past the end")
        return bytes(buf[offs + 8 : end]).decode("utf-8", errors="replace"), end

    @staticmethod
    def _strings(buf: np.ndarray, offs: int, count: int) -> tuple[StringArray | list[str], int]:
        """An array of strings: a :class:`StringArray` from 1024 strings on (a vocabulary, its merges), else a list."""
        raw, size, starts = memoryview(buf), len(buf), array("q", bytes(8 * (count + 1)))
        length_at, i = struct.Struct("<Q").unpack_from, 0
        try:  # one unpack per string (a vocabulary and its merges: 400k); a string past the end stops the next one
            for i in range(count):
                starts[i] = offs
                offs += 8 + length_at(raw, offs)[0]
            i = count
        except struct.error:
            pass
        if offs > size:
            start = starts[i - 1]
            raise ModelFileError(
                f"malformed or truncated: a string of {offs - start - 8} bytes at byte {start} runs past the end"
            )
        if i < count:
            raise ModelFileError(f"malformed or truncated: a string's length at byte {offs} runs past the end")
        starts[count] = offs
        strings = StringArray(raw, starts)
        return (strings if count >= 1024 else list(strings)), offs

    def _value(self, buf: np.ndarray, offs: int, vtype: V) -> tuple[Any, list[V], int]:
        if vtype == V.STRING:
            text, offs = self._string(buf, offs)
            return text, [vtype], offs
        if vtype in SCALARS:
            dtype = SCALARS[vtype]
            return np.frombuffer(buf, dtype, 1, offs)[0].item(), [vtype], offs + dtype.itemsize
        if vtype != V.ARRAY:
            raise ValueError(f"unknown metadata value type {int(vtype)}")
        item_type = V(int(np.frombuffer(buf, np.uint32, 1, offs)[0]))
        count = int(np.frombuffer(buf, np.uint64, 1, offs + 4)[0])
        offs += 12
        gguf_check.check_count("array items", count, gguf_check.MIN_VALUE_BYTES[item_type], len(buf) - offs)
        if item_type in SCALARS:
            dtype = SCALARS[item_type]
            values = np.frombuffer(buf, dtype, count, offs).tolist()
            return values, [vtype, item_type], offs + count * dtype.itemsize
        if item_type == V.STRING:  # a vocabulary: hundreds of thousands of strings, read without numpy per item
            values, offs = self._strings(buf, offs, count)
            return values, [vtype, item_type], offs
        values, types = [], [vtype, item_type]
        for _ in range(count):
            item, item_types, offs = self._value(buf, offs, item_type)
            values.append(item)
            types = [vtype, *item_types]
        return values, types, offs

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[gguf.ReaderField]]:
        gguf_check.check_count("tensors", int(count), gguf_check.MIN_TENSOR_INFO_BYTES, len(self.data) - offs)
        alignment = self.fields.get(gguf.Keys.General.ALIGNMENT)
        if alignment is not None:
            gguf_check.check_alignment(alignment.contents(), alignment.types)
        return super()._build_tensor_info(offs, count)

    def _get_tensor_info_field(self, orig_offs: int) -> gguf.ReaderField:
        buf = self.data
        name, offs = self._string(buf, orig_offs)
        gguf_check.check_tensor_name(name)
        name_len = np.frombuffer(buf, np.uint64, 1, orig_offs)
        name_data = np.frombuffer(buf, np.uint8, offs - orig_offs - 8, orig_offs + 8)
        n_dims = np.frombuffer(buf, np.uint32, 1, offs)
        if not 1 <= n_dims[0] <= gguf_check.MAX_DIMS:
            raise ModelFileError(f"tensor {name}: {n_dims[0]} dimensions, not 1 to {gguf_check.MAX_DIMS}")
        dims = np.frombuffer(buf, np.uint64, int(n_dims[0]), offs + 4)
        offs += 4 + dims.nbytes
        raw_type, offset = np.frombuffer(buf, np.uint32, 1, offs), np.frombuffer(buf, np.uint64, 1, offs + 4)
        return gguf.ReaderField(orig_offs, name, [name_len, name_data, n_dims, dims, raw_type, offset], [1, 3, 4, 5])

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        infos = [
            gguf_check.TensorInfo(f.name, tuple(int(d) for d in f.parts[3]), int(f.parts[4][0]), int(f.parts[5][0]))
            for f in fields
        ]
        gguf_check.check_tensors(infos, int(start_offs), len(self.data), int(self.alignment))
        super()._build_tensors(start_offs, fields)


@contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Put ``path`` in front of the ModelFileErrors raised inside."""
    try:
        yield
    except ModelFileError as e:
        raise ModelFileError(f"{path}: {e}") from None


def _read(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    with _naming(path):
        try:
            return _Reader(path, "r")
        except ModelFileError:
            raise
        except Exception as e:  # noqa: BLE001 - gguf-py and numpy raise anything on a garbled file
            detail = " ".join(f"{type(e).__name__}: {e}".split())
            raise ModelFileError(f"not a valid GGUF file, malformed or truncated ({detail})") from None


class ModelFile:
    """Metadata and tensors of one model, from a single or split GGUF."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.parts = split_parts(self.path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        self._readers = []
        for part in self.parts:
            reader = _read(part)
            self._readers.append(reader)
            for name, field in reader.fields.items():
                if name.startswith("GGUF.") or (name in self.metadata and name.startswith("split.")):
                    continue
                try:  # a parsed value as it is (contents() copies lists)
                    self.metadata.setdefault(
                        name, field.data[0] if isinstance(field, _MetadataField) else field.contents()
                    )
                except Exception as e:  # noqa: BLE001 - a garbled value can fail in any way
                    raise ModelFileError(f"{part}: metadata key {name} is unreadable ({e})") from None
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise ModelFileError(f"{part}: tensor {t.name} appears twice")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self.tensors[t.name] = Tensor(t.name, gguf.GGMLQuantizationType(t.tensor_type), shape, t.data)
        if "general.architecture" not in self.metadata:
            raise ModelFileError(f"{self.path}: missing metadata key general.architecture")

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """A metadata value; ``{arch}`` in the key is the file's architecture. Missing without a default: error."""
        key = key.format(arch=self.architecture)
        if key in self.metadata:
            with _naming(self.path):
                gguf_check.check_value(self.architecture, key, self.metadata[key])
            return self.metadata[key]
        if default is _MISSING:
            raise ModelFileError(f"{self.path}: missing metadata key {key}")
        return default

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: missing tensor {name}") from None

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def sha256(self) -> str:
        import hashlib  # here: its import loads OpenSSL (leat.sha256)

        digest = hashlib.sha256()
        for part in self.parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
        return digest.hexdigest()
