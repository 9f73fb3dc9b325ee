"""Images in prompts through an mmproj GGUF: its encoder, by projector type, and where its embeddings go.

A prompt names its images with :data:`MARKER` (llama.cpp's ``mtmd_default_marker``): :meth:`Vision.prompt` replaces
each with the projector's begin text, one placeholder position per image embedding, and its end text, as llama.cpp's
mtmd does, and returns the :class:`ImageSpan` of each. The engine runs an image's span as a row of its own whose
inputs are the encoder's output (:meth:`Vision.embeddings`, kept by image digest), attending bidirectionally
within it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from leat.backend import Backend
from leat.errors import BackendUnavailable, LeatError, ModelFileError
from leat.modelfile import ModelFile
from leat.sha256 import sha256
from leat.vision import image

MARKER = "<__media__>"
CACHED_IMAGES = 16  # encoder outputs kept, by image digest


@dataclass(frozen=True)
class Projector:
    """What a projector type needs: its encoder class and the text around an image's embeddings."""

    encoder: str  # "module:Class", built with (ModelFile, Backend)
    begin: str
    end: str


@dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its ``length`` positions from ``start``, its pixels as the encoder reads them, and the
    digest of its bytes, which keys the encoder's cache and the prefix cache's pages."""

    start: int
    length: int
    digest: bytes
    pixels: np.ndarray

    def key_ids(self) -> list[int]:
        """Stand-ins for the span's placeholder ids in prefix keys: derived from the digest, so that two images'
        spans never share a cached page."""
        seed = sha256(self.digest)
        return [int.from_bytes(seed.copy().digest()[:4], "little") ^ i for i in range(self.length)]


def keyed(tokens: Sequence[int], images: Sequence[ImageSpan]) -> list[int]:
    """``tokens`` with each image's positions replaced by its :meth:`ImageSpan.key_ids` (for prefix keys)."""
    out = list(tokens)
    for span in images:
        end = min(span.start + span.length, len(out))
        out[span.start : end] = span.key_ids()[: max(end - span.start, 0)]
    return out


def next_chunk(filled: int, end: int, images: Sequence[ImageSpan]) -> tuple[int, ImageSpan | None]:
    """Where a prefill chunk from ``filled`` that would end at ``end`` ends: at the end of the image whose span holds
    ``filled`` (that image is the chunk, returned too), else before the next image's span."""
    for span in images:
        if span.start <= filled < span.start + span.length:
            return span.start + span.length, span
        if filled < span.start < end:
            end = span.start
    return end, None


def place(
    tokenizer: Any, text: str, count: int, begin: str, end: str, tokens: int | Sequence[int], add_special=True
) -> tuple[list[int], list[int]]:
    """``text`` with ``count`` :data:`MARKER` -> token ids (``tokens`` placeholders, or each image's own count,
    between ``begin`` and ``end`` for each image, as llama.cpp's mtmd places them) and each image's first position."""
    pieces = text.replace(MARKER, begin + MARKER + end).split(MARKER)
    if len(pieces) - 1 != count:
        raise LeatError(f"the prompt has {len(pieces) - 1} image markers for {count} images")
    counts = [tokens] * count if isinstance(tokens, int) else tokens
    ids: list[int] = []
    starts = []
    for i, piece in enumerate(pieces):
        ids += tokenizer.encode(piece, add_special=add_special and i == 0, parse_special=True)
        if i < count:
            starts.append(len(ids))
            ids += [0] * counts[i]  # placeholders: the span's inputs are the image's embeddings
    return ids, starts


def image_tokens(layout: Mapping[str, Any], data: bytes) -> int:
    """The positions the image ``data`` (encoded bytes) takes by ``layout`` (:meth:`Vision.layout`): the one count,
    else ``function(width, height, **arguments)`` of its ``sizing``, the sides read from the image's header."""
    if layout["tokens"] is not None:
        return int(layout["tokens"])
    function, arguments = layout["sizing"]
    return int(_attribute(function)(*image.size(data), **arguments))


def _attribute(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


class Vision:
    """An mmproj loaded on a backend: images to embeddings for a text model of ``width`` whose architecture takes
    ``projectors`` (:attr:`leat.architecture.Architecture.projectors`)."""

    def __init__(self, path: str | Path, backend: Backend, width: int, projectors: Mapping[str, Projector]):
        file = ModelFile(path)
        kind = file.get(gguf.Keys.Clip.PROJECTOR_TYPE, None) or file.get(gguf.Keys.ClipVision.PROJECTOR_TYPE, None)
        if not isinstance(kind, str) or kind not in projectors:
            known = ", ".join(sorted(projectors)) or "none"
            raise ModelFileError(f"{file.path.name}: projector type {kind!r} is not one this model takes ({known})")
        if not backend.bidirectional:
            raise BackendUnavailable(
                f"the {backend.name} backend cannot run images yet (no bidirectional attention): use --backend cpu"
            )
        self.projector = projectors[kind]
        try:  # a reshape, a division, a type or an index that its hyperparameters make impossible
            self.encoder: Any = _attribute(self.projector.encoder)(file, backend)
            (self.encoder.mean * self.encoder.std).reshape(3)  # one of each per channel
        except (ValueError, ArithmeticError, TypeError, IndexError) as e:
            raise ModelFileError(f"{file.path.name}: its hyperparameters do not fit its tensors ({e})") from None
        if self.encoder.text_width != width:
            raise ModelFileError(
                f"{file.path.name}: its embeddings are {self.encoder.text_width} wide, the model's {width}: "
                "this projector belongs to another model"
            )
        self.path = file.path
        self._cache: OrderedDict[bytes, Any] = OrderedDict()

    def layout(self) -> dict[str, Any]:
        """What :func:`place` and :func:`image_tokens` need to lay out images without the encoder (in an API frontend
        process); an encoder without one ``tokens`` count has ``sizing``: ``("module:function", keyword arguments)``."""
        layout = {"begin": self.projector.begin, "end": self.projector.end, "tokens": self.encoder.tokens}
        return layout | {"sizing": getattr(self.encoder, "sizing", None)}

    def span(self, start: int, data: bytes, length: int | None = None) -> ImageSpan:
        """The span from position ``start`` of the image ``data`` (encoded bytes): decoded and preprocessed here;
        ``length``, when given, is the count a frontend laid the prompt out with (:func:`image_tokens`)."""
        pixels = self.encoder.preprocess(image.decode(data))
        count = self.encoder.tokens_of(pixels)
        if length is not None and length != count:
            raise LeatError(f"an image laid out at {length} positions makes {count} embeddings: the prompt is wrong")
        return ImageSpan(start, count, sha256(data).digest(), pixels)

    def prompt(
        self, tokenizer: Any, text: str, images: Sequence[bytes], add_special: bool = True
    ) -> tuple[list[int], list[ImageSpan]]:
        """``text`` with one :data:`MARKER` per image of ``images`` (encoded bytes) -> token ids and image spans."""
        spans = [self.span(0, data) for data in images]
        begin, end, counts = self.projector.begin, self.projector.end, [span.length for span in spans]
        ids, starts = place(tokenizer, text, len(images), begin, end, counts, add_special)
        return ids, [dataclasses.replace(span, start=start) for span, start in zip(spans, starts)]

    def embeddings(self, span: ImageSpan, start: int | None = None) -> Any:
        """The encoder's output for the span's image (a backend array [length, width]; from prompt position
        ``start`` on when given), from the cache when the same image came lately."""
        hit = self._cache.get(span.digest)
        if hit is None:
            hit = self._cache[span.digest] = self.encoder.encode(span.pixels)
            while len(self._cache) > CACHED_IMAGES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(span.digest)
        skip = 0 if start is None else start - span.start
        return hit if not skip else self.encoder.backend.take_rows(hit, np.arange(skip, span.length))
