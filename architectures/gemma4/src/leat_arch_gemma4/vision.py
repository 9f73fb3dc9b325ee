"""Gemma 4's vision encoder and projector (mmproj projector type ``gemma4v``), as llama.cpp's tools/mtmd computes it
(models/gemma4v.cpp, clip.cpp's ``build_vit``, mtmd-image.cpp's ``dyn_size`` preprocessor), against Backend ops.

* Images keep their aspect ratio: resized (Pillow's bicubic, letterboxed on black) to sides that are multiples of
  ``patch * merge``, between 70 and 1120 image tokens, each ``merge`` x ``merge`` square of patches one token.
* Pixels are normalized by the file's mean and std, then mapped to ``2x - 1``; the patch convolution has no bias;
  each patch adds a learned embedding of its column and one of its row (``v.position_embd`` holds both tables).
* Each layer: ``x += post_norm(out(attn(rms_norm(x))))``, ``x += post_norm(down(gelu(gate) * up))`` (RMSNorms with
  weights, no biases), then times the layer's ``out_scale``. q and k are RMS-normed per head, then rotated in 2-D:
  a head's first half by the patch's column, its second half by its row (NEOX pairs within each half, base 100);
  v is RMS-normed per head without a weight; scores are not scaled; every patch sees every other.
* A product whose weight has ``.input_min/max`` or ``.output_min/max`` scalars clamps its input and output to them
  (Gemma4ClippableLinear): on the host, since no Backend op clamps.
* The projector: ``merge`` x ``merge`` average pooling, times sqrt(width), ``(x - std_bias) * std_scale`` where the
  file has them, an RMSNorm without weight and ``mm.input_projection`` ([text, vision], as any product's weight).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from leat.backend import Backend, KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat.vision import image
from leat.vision.siglip import dequantized, f32, pool, required

V = gguf.Keys.ClipVision
ROPE_BASE = 100.0  # llama.cpp's hparams.rope_theta for this projector (not in the file)
MERGE = 3  # pooling_kernel_size, unless clip.vision.projector.scale_factor says
TOKENS = (70, 1120)  # the fewest and most image tokens an image is resized to (llama.cpp's set_limit_image_tokens)
CLAMPS = ("input_min", "input_max", "output_min", "output_max")


def sides(width: int, height: int, patch: int, merge: int) -> tuple[int, int]:
    """The sides an image of ``width`` x ``height`` is resized to (llama.cpp's calc_size_preserved_ratio, in its
    float32 arithmetic): each a multiple of patch * merge, the tokens within :data:`TOKENS`."""
    f, s = patch * merge, np.float32
    fewest, most = (t * f * f for t in TOKENS)

    def by(x: Any, rounding: Any) -> int:  # llama.cpp's round/floor/ceil_by_factor: x / f in float32
        return int(rounding(float(s(x) / s(f)))) * f

    w, h = (max(f, by(side, lambda v: math.floor(v + 0.5))) for side in (width, height))
    if w * h > most:
        beta = np.sqrt(s(height) * s(width) / s(most))
        w, h = (max(f, by(s(side) / beta, math.floor)) for side in (width, height))
    elif w * h < fewest:
        beta = np.sqrt(s(fewest) / (s(height) * s(width)))
        w, h = (by(s(side) * beta, math.ceil) for side in (width, height))
    return w, h


def image_tokens(width: int, height: int, patch: int, merge: int) -> int:
    """How many embeddings an image of ``width`` x ``height`` becomes: what :meth:`Gemma4Vision.tokens_of` counts
    after :meth:`Gemma4Vision.preprocess`, from the image's size alone (``leat.vision.image_tokens``)."""
    w, h = sides(width, height, patch, merge)
    return (w // (patch * merge)) * (h // (patch * merge))


@dataclass
class Linear:
    weight: Any
    clamps: tuple[float, float, float, float] | None  # input min, max, output min, max


@dataclass
class Layer:
    ln1: Any
    q: Linear
    k: Linear
    v: Linear
    q_norm: Any
    k_norm: Any
    out: Linear
    attn_post_norm: Any
    ln2: Any
    gate: Linear
    up: Linear
    down: Linear
    ffn_post_norm: Any
    out_scale: float | None


class Gemma4Vision:
    """The encoder of one ``gemma4v`` mmproj on one backend: ``encode`` pixels into image embeddings."""

    def __init__(self, file: ModelFile, backend: Backend):
        self.file, self.backend = file, backend
        need = functools.partial(required, file)
        self.patch, self.width = int(need(V.PATCH_SIZE)), int(need(V.EMBEDDING_LENGTH))
        self.heads, self.eps = int(need(V.Attention.HEAD_COUNT)), float(need(V.Attention.LAYERNORM_EPS))
        self.mean = np.asarray(need(V.IMAGE_MEAN), np.float32)[:3]
        self.std = np.asarray(need(V.IMAGE_STD), np.float32)[:3]
        self.merge = int(file.get(V.Projector.SCALE_FACTOR, MERGE))
        if not (0 < self.merge and TOKENS[1] * (self.patch * self.merge) ** 2 <= image.MAX_PIXELS):
            raise ModelFileError(
                f"{file.path.name}: {self.patch}-pixel patches pooled by {self.merge} make images too large"
            )
        self.gelu = bool(file.get(V.USE_GELU, False))  # else llama.cpp's gelu_quick, x * sigmoid(1.702 x)
        self.tokens = None  # each image's own count: tokens_of, or image_tokens from its size alone (a frontend's)
        self.sizing = (f"{__name__}:{image_tokens.__name__}", {"patch": self.patch, "merge": self.merge})
        self.head_dim = self.width // self.heads
        kernel = dequantized(file, "v.patch_embd.weight")
        self.patch_kernel = backend.upload(f32("v.patch_embd.weight", kernel.reshape(self.width, -1)))
        tables = dequantized(file, "v.position_embd.weight")  # [2, positions, width]: columns, then rows
        self.columns, self.rows = (backend.upload(f32("v.position_embd.weight", t)) for t in tables)
        self.layers = [self._layer(i) for i in range(int(need(V.BLOCK_COUNT)))]
        self.std_bias, self.std_scale = (self._optional(name) for name in ("v.std_bias", "v.std_scale"))
        self.projection = self._linear("mm.input_projection.weight")
        self.text_width = file.tensor("mm.input_projection.weight").shape[0]

    def _optional(self, name: str) -> np.ndarray | None:
        return dequantized(self.file, name).reshape(-1) if name in self.file.tensors else None

    def _linear(self, name: str) -> Linear:
        stem = name.removesuffix(".weight")
        found = [self._optional(f"{stem}.{c}") for c in CLAMPS]
        clamps = None
        if any(v is not None for v in found):
            defaults = (-np.inf, np.inf, -np.inf, np.inf)
            clamps = tuple(float(d if v is None else v[0]) for v, d in zip(found, defaults))
        return Linear(self.backend.upload(self.file.tensor(name)), clamps)  # type: ignore[arg-type]

    def _layer(self, i: int) -> Layer:
        w = self.file.tensor
        linear = {part: self._linear(f"v.blk.{i}.{part}.weight") for part in ("attn_q", "attn_k", "attn_v")}
        for norm in ("attn_q_norm", "attn_k_norm"):
            if w(f"v.blk.{i}.{norm}.weight").shape[-1] != self.head_dim:
                raise ModelFileError(f"{self.file.path.name}: v.blk.{i}.{norm} is not one weight per head dimension")
        scale = self._optional(f"v.blk.{i}.out_scale.weight")
        up = self.backend.upload
        return Layer(
            ln1=up(w(f"v.blk.{i}.ln1.weight")),
            q=linear["attn_q"],
            k=linear["attn_k"],
            v=linear["attn_v"],
            q_norm=up(w(f"v.blk.{i}.attn_q_norm.weight")),
            k_norm=up(w(f"v.blk.{i}.attn_k_norm.weight")),
            out=self._linear(f"v.blk.{i}.attn_out.weight"),
            attn_post_norm=up(w(f"v.blk.{i}.attn_post_norm.weight")),
            ln2=up(w(f"v.blk.{i}.ln2.weight")),
            gate=self._linear(f"v.blk.{i}.ffn_gate.weight"),
            up=self._linear(f"v.blk.{i}.ffn_up.weight"),
            down=self._linear(f"v.blk.{i}.ffn_down.weight"),
            ffn_post_norm=up(w(f"v.blk.{i}.ffn_post_norm.weight")),
            out_scale=None if scale is None else float(scale[0]),
        )

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The sides an image of ``width`` x ``height`` is resized to (:func:`sides`)."""
        return sides(width, height, self.patch, self.merge)

    def preprocess(self, rgb: np.ndarray) -> np.ndarray:
        """RGB bytes [h, w, 3] -> the encoder's input [3, h', w'] (:meth:`size`), normalized as the file says."""
        width, height = self.size(rgb.shape[1], rgb.shape[0])
        resized = image.letterbox(rgb, width, height, "bicubic")
        return image.normalize(resized, self.mean, self.std) * np.float32(2.0) - np.float32(1.0)

    def tokens_of(self, pixels: np.ndarray) -> int:
        """How many embeddings ``pixels`` (as :meth:`preprocess` gives them) become."""
        return (pixels.shape[1] // (self.patch * self.merge)) * (pixels.shape[2] // (self.patch * self.merge))

    def _product(self, x: Any, linear: Linear) -> Any:
        if linear.clamps is None:
            return self.backend.matmul(x, linear.weight)
        B, (lo, hi, out_lo, out_hi) = self.backend, linear.clamps
        y = B.matmul(B.from_host(np.clip(B.to_host(x), lo, hi)), linear.weight)
        return B.from_host(np.clip(B.to_host(y), out_lo, out_hi))

    def _rotate(self, x: Any, columns: np.ndarray, rows: np.ndarray) -> Any:
        """Each head's first half rotated by the patch's column, its second half by its row: the halves as rows of
        their own, each with its position."""
        n, half = len(columns), self.head_dim // 2
        positions = np.broadcast_to(np.stack([columns, rows], axis=1)[:, None, :], (n, self.heads, 2)).reshape(-1)
        halves = self.backend.reshape(x, (n * self.heads * 2, 1, half))
        rotated = self.backend.rope(halves, positions, RopeSpec(half, ROPE_BASE, neox=True))
        return self.backend.reshape(rotated, (n, self.heads, self.head_dim))

    def _ffn(self, h: Any, layer: Layer) -> Any:
        B, gate, up = self.backend, self._product(h, layer.gate), self._product(h, layer.up)
        if self.gelu:
            return B.gelu_mul(gate, up)
        return B.scale(B.silu_mul(B.scale(gate, 1.702), up), 1 / 1.702)  # gelu_quick(g) * up = silu(1.702 g) up / 1.702

    def encode(self, pixels: np.ndarray) -> Any:
        """Pixels [3, h, w] -> image embeddings [tokens_of(pixels), text width] (a backend array)."""
        B, p = self.backend, self.patch
        side_y, side_x = pixels.shape[1] // p, pixels.shape[2] // p
        n = side_y * side_x
        patches = pixels.reshape(3, side_y, p, side_x, p).transpose(1, 3, 0, 2, 4).reshape(n, -1)
        columns, rows = np.arange(n) % side_x, np.arange(n) // side_x
        x = B.matmul(B.from_host(patches), self.patch_kernel)
        x = B.add(x, B.add(B.embed(self.columns, columns), B.embed(self.rows, rows)))
        kv = B.allocate_kv([KVLayout(self.heads, self.head_dim)], 1, n, page_size=p * p)
        batch = Batch([Row(0, 0, np.zeros(n, np.int64), bidirectional=True)])
        shape = (n, self.heads, self.head_dim)
        for layer in self.layers:
            h = B.rms_norm(x, layer.ln1, self.eps)
            q, k, v = (B.reshape(self._product(h, w), shape) for w in (layer.q, layer.k, layer.v))
            q = self._rotate(B.rms_norm(q, layer.q_norm, self.eps), columns, rows)
            k = self._rotate(B.rms_norm(k, layer.k_norm, self.eps), columns, rows)
            h = self._product(B.attention(q, k, B.rms_norm(v, None, self.eps), kv, 0, batch, 1.0), layer.out)
            x = B.add(x, B.rms_norm(h, layer.attn_post_norm, self.eps))
            h = self._product(self._ffn(B.rms_norm(x, layer.ln2, self.eps), layer), layer.down)
            x = B.add(x, B.rms_norm(h, layer.ffn_post_norm, self.eps))
            if layer.out_scale is not None:
                x = B.scale(x, layer.out_scale)
        x = B.scale(pool(B, x, side_y, side_x, self.merge), math.sqrt(self.width))
        if self.std_bias is not None and self.std_scale is not None:  # a per-channel scale is a diagonal product
            x = B.add(x, B.from_host(np.broadcast_to(-self.std_bias, (n // self.merge**2, self.width))))
            x = B.matmul(x, B.upload(f32("v.std_scale", np.diag(self.std_scale))))
        return self._product(B.rms_norm(x, None, self.eps), self.projection)
