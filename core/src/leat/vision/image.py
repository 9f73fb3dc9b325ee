"""Images in: decoding to RGB bytes, and resizing as llama.cpp's mtmd does before a projector sees them.

PNG (8-bit, not interlaced) is read here; other formats (JPEG, WebP, ...) through Pillow when it is installed. As
llama.cpp's stb_image loads with three channels, an alpha channel is dropped, not composited.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np

from leat.errors import LeatError

PNG = b"\x89PNG\r\n\x1a\n"
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # PNG colour type -> samples per pixel
MAX_PIXELS = 1 << 24  # 4096 x 4096: a larger PNG is refused before its pixel data is inflated


class ImageError(LeatError):
    """An image that cannot be read."""


def decode(data: bytes) -> np.ndarray:
    """The image in ``data`` as RGB bytes [height, width, 3]."""
    if data.startswith(PNG):
        return _png(data)
    try:
        from PIL import Image
    except ImportError:
        raise ImageError("this image is not a PNG: other formats (JPEG, WebP, ...) need Pillow (pip install pillow)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 (Pillow raises many kinds for a bad file)
        raise ImageError(f"cannot read this image: {e}") from None


def _png(data: bytes) -> np.ndarray:
    pos, idat, palette, header = 8, [], None, None
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body, pos = data[pos + 8 : pos + 8 + length], pos + 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            palette = np.frombuffer(body, np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if header is None:
        raise ImageError("this PNG has no header")
    width, height, depth, color, _, _, interlace = header
    if depth != 8 or interlace or color not in CHANNELS:
        raise ImageError("only 8-bit, non-interlaced PNGs are read without Pillow (pip install pillow)")
    if width * height > MAX_PIXELS:
        raise ImageError(f"this PNG is {width} x {height}: more than {MAX_PIXELS:,} pixels")
    bpp = CHANNELS[color]
    size = height * (width * bpp + 1)
    try:  # inflated no further than the header's size, so a small file cannot expand without bound
        rows = np.frombuffer(zlib.decompressobj().decompress(b"".join(idat), size), np.uint8)
        rows = rows.reshape(height, width * bpp + 1)
    except (zlib.error, ValueError):
        raise ImageError("this PNG's pixel data is damaged") from None
    pixels = _unfilter(rows, bpp).reshape(height, width, bpp)
    if color == 3:
        if palette is None:
            raise ImageError("this palette PNG has no palette")
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


def _bilinear_weights(size: int, target: int) -> np.ndarray:
    """Pillow's bilinear (triangle) filter as a [target, size] matrix: support widened by the downscale factor,
    pixel centres at +0.5, each row normalized to sum 1 (llama.cpp's resize_pillow; it then rounds the weights to
    22-bit fixed point, so its pixels may differ from these by one level)."""
    scale = size / target
    support = max(scale, 1.0)
    weights = np.zeros((target, size))
    for i in range(target):
        centre = (i + 0.5) * scale
        lo, hi = max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), size)
        taps = np.maximum(0.0, 1.0 - np.abs((np.arange(lo, hi) - centre + 0.5) / support))
        weights[i, lo:hi] = taps / taps.sum() if taps.sum() else 0.0
    return weights


def resize(rgb: np.ndarray, width: int, height: int) -> np.ndarray:
    """``rgb`` resized to ``width`` x ``height`` with Pillow's bilinear filter: horizontally, then vertically, each
    pass rounded to bytes as Pillow and llama.cpp do."""
    if rgb.shape[:2] == (height, width):
        return rgb
    wide = np.einsum("ow,hwc->hoc", _bilinear_weights(rgb.shape[1], width), rgb.astype(np.float64))
    wide = np.clip(np.floor(wide + 0.5), 0, 255)
    tall = np.einsum("oh,hwc->owc", _bilinear_weights(rgb.shape[0], height), wide)
    return np.clip(np.floor(tall + 0.5), 0, 255).astype(np.uint8)


def letterbox(rgb: np.ndarray, size: int) -> np.ndarray:
    """``rgb`` scaled to fit a ``size`` square keeping its aspect ratio, centred on black (llama.cpp's PAD_CEIL)."""
    height, width = rgb.shape[:2]
    if (height, width) == (size, size):
        return rgb
    scale = min(size / width, size / height)
    w, h = min(int(np.ceil(width * scale)), size), min(int(np.ceil(height * scale)), size)
    out = np.zeros((size, size, 3), np.uint8)
    top, left = (size - h) // 2, (size - w) // 2
    out[top : top + h, left : left + w] = resize(rgb, w, h)
    return out


def normalize(rgb: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Bytes to floats in [0, 1], then (x - mean) / std per channel: [3, height, width] float32, as the encoder
    reads them."""
    x = rgb.astype(np.float32) / np.float32(255.0)
    return ((x - mean.astype(np.float32)) / std.astype(np.float32)).transpose(2, 0, 1)
