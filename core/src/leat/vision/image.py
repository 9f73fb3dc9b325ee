"""Images in: decoding to RGB bytes, and resizing as llama.cpp's mtmd does before a projector sees them.

PNG (8-bit, not interlaced) is read here; other formats (JPEG, WebP, ...) through Pillow when it is installed. As
llama.cpp's stb_image loads with three channels, an alpha channel is dropped, not composited.
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Any

import numpy as np

from leat.errors import LeatError

PNG = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # PNG colour type -> samples per pixel
MAX_PIXELS = 1 << 24  # 4096 x 4096: a larger image is refused before its pixel data is decoded


class ImageError(LeatError):
    """An image that cannot be read."""


def decode(data: bytes) -> np.ndarray:
    """The image in ``data`` as RGB bytes [height, width, 3]."""
    if data.startswith(PNG):
        return _png(data)
    return _pillow(data, lambda image: np.asarray(image.convert("RGB"), dtype=np.uint8))


def size(data: bytes) -> tuple[int, int]:
    """The width and height of the image in ``data``, from its header: nothing is decoded (nor a PNG too large)."""
    if data.startswith(PNG):
        if data[12:16] != b"IHDR" or len(data) < 24:
            raise ImageError("this PNG has no header")
        return _allowed(*struct.unpack(">II", data[16:24]), "PNG")
    return _pillow(data, lambda image: image.size)


def _allowed(width: int, height: int, kind: str) -> tuple[int, int]:
    if not 0 < width * height <= MAX_PIXELS:
        raise ImageError(f"this {kind} is {width} x {height}: no pixels, or more than {MAX_PIXELS:,}")
    return width, height


def _pillow(data: bytes, read: Any) -> Any:
    """``read(image)`` of the image in ``data`` opened by Pillow (which reads the header first, pixels when asked)."""
    try:
        from PIL import Image
    except ImportError:
        raise ImageError("this image is not a PNG: other formats (JPEG, WebP, ...) need Pillow (pip install pillow)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            _allowed(*image.size, "image")  # from its header: refused before a pixel is decoded, as a PNG is
            return read(image)
    except Exception as e:  # noqa: BLE001 (Pillow raises many kinds for a bad file)
        raise ImageError(f"cannot read this image: {e}") from None


def _png(data: bytes) -> np.ndarray:
    size(data)  # its header first, and its sides
    pos, idat, palette, header = 8, [], None, None
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body, pos = data[pos + 8 : pos + 8 + length], pos + 12 + length
        if kind == b"IHDR" and len(body) == 13:
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            palette = np.frombuffer(body[: len(body) // 3 * 3], np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if header is None:
        raise ImageError("this PNG has no header")
    width, height, depth, color, _, _, interlace = header
    if depth != 8 or interlace or color not in CHANNELS:
        raise ImageError("only 8-bit, non-interlaced PNGs are read without Pillow (pip install pillow)")
    bpp = CHANNELS[color]
    inflated = height * (width * bpp + 1)
    try:  # inflated no further than the header's size, so a small file cannot expand without bound
        rows = np.frombuffer(zlib.decompressobj().decompress(b"".join(idat), inflated), np.uint8)
        rows = rows.reshape(height, width * bpp + 1)
    except (zlib.error, ValueError):
        raise ImageError("this PNG's pixel data is damaged") from None
    pixels = _unfilter(rows, bpp).reshape(height, width, bpp)
    if color == 3:
        if palette is None or pixels.max() >= len(palette):
            raise ImageError("this palette PNG has no palette, or pixels past its end")
        return palette[pixels[..., 0]]
    return np.repeat(pixels[..., :1], 3, axis=-1) if bpp < 3 else pixels[..., :3].copy()


def _unfilter(rows: np.ndarray, bpp: int) -> np.ndarray:
    """Undo PNG's per-row filters (none, sub, up, average, Paeth): bytes [height, stride]."""
    out = np.zeros((rows.shape[0], rows.shape[1] - 1), np.int32)
    above = np.zeros(rows.shape[1] - 1, np.int32)
    for y, (kind, line) in enumerate(zip(rows[:, 0], rows[:, 1:].astype(np.int32))):
        if kind in (0, 2):
            out[y] = (line + (above if kind == 2 else 0)) & 255
        else:
            row = out[y]
            for x in range(0, len(line), bpp):
                left = row[x - bpp : x] if x else np.zeros(bpp, np.int32)
                up, corner = above[x : x + bpp], above[x - bpp : x] if x else np.zeros(bpp, np.int32)
                if kind == 1:
                    guess = left
                elif kind == 3:
                    guess = (left + up) >> 1
                else:
                    p = left + up - corner
                    pa, pb, pc = np.abs(p - left), np.abs(p - up), np.abs(p - corner)
                    guess = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, corner))
                row[x : x + bpp] = (line[x : x + bpp] + guess) & 255
        above = out[y]
    return out.astype(np.uint8)


FILTERS = {  # Pillow's filters by name: support, weight at distance x (bicubic with a = -0.5, as Pillow)
    "bilinear": (1.0, lambda x: np.maximum(0.0, 1.0 - x)),
    "bicubic": (
        2.0,
        lambda x: np.where(
            x < 1, (1.5 * x - 2.5) * x * x + 1, np.where(x < 2, ((-0.5 * x + 2.5) * x - 4) * x + 2, 0.0)
        ),
    ),
}
PRECISION = 22  # Pillow's (and llama.cpp's resize_pillow's) fixed-point bits for the filter weights


def _weights(size: int, target: int, kind: str) -> np.ndarray:
    """Pillow's resampling filter as a [target, size] matrix of fixed-point weights: support widened by the downscale
    factor, pixel centres at +0.5, each row normalized to sum 1, then times 2^22 rounded half away from zero."""
    scale = size / target
    support, weight = FILTERS[kind]
    wide = max(scale, 1.0)
    weights = np.zeros((target, size))
    for i in range(target):
        centre = (i + 0.5) * scale
        lo, hi = max(int(centre - support * wide + 0.5), 0), min(int(centre + support * wide + 0.5), size)
        taps = weight(np.abs((np.arange(lo, hi) - centre + 0.5) / wide))
        weights[i, lo:hi] = taps / taps.sum() if taps.sum() else 0.0
    return np.trunc(weights * (1 << PRECISION) + np.where(weights < 0, -0.5, 0.5))


def _pass(weights: np.ndarray, rgb: np.ndarray, axis: str) -> np.ndarray:
    sums = np.einsum(f"o{axis},{'hwc'}->{'hwc'.replace(axis, 'o')}", weights, rgb.astype(np.float64))
    return np.clip(np.floor((sums + (1 << (PRECISION - 1))) / (1 << PRECISION)), 0, 255)


def resize(rgb: np.ndarray, width: int, height: int, kind: str = "bilinear") -> np.ndarray:
    """``rgb`` resized to ``width`` x ``height`` with Pillow's ``kind`` filter in its fixed-point arithmetic (as
    llama.cpp's resize_pillow): horizontally, then vertically, each pass rounded to bytes."""
    if rgb.shape[:2] == (height, width):
        return rgb
    wide = _pass(_weights(rgb.shape[1], width, kind), rgb, "w")
    return _pass(_weights(rgb.shape[0], height, kind), wide, "h").astype(np.uint8)


def letterbox(rgb: np.ndarray, width: int, height: int, kind: str = "bilinear") -> np.ndarray:
    """``rgb`` scaled to fit ``width`` x ``height`` keeping its aspect ratio (``kind`` of filter), centred on black
    (llama.cpp's PAD_CEIL, in its float32 arithmetic)."""
    if rgb.shape[:2] == (height, width):
        return rgb
    s = np.float32
    scale = min(s(width) / s(rgb.shape[1]), s(height) / s(rgb.shape[0]))
    w, h = min(int(np.ceil(s(rgb.shape[1]) * scale)), width), min(int(np.ceil(s(rgb.shape[0]) * scale)), height)
    out = np.zeros((height, width, 3), np.uint8)
    top, left = (height - h) // 2, (width - w) // 2
    out[top : top + h, left : left + w] = resize(rgb, w, h, kind)
    return out


def normalize(rgb: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Bytes to floats in [0, 1], then (x - mean) / std per channel: [3, height, width] float32, as the encoder
    reads them."""
    x = rgb.astype(np.float32) / np.float32(255.0)
    return ((x - mean.astype(np.float32)) / std.astype(np.float32)).transpose(2, 0, 1)
