"""A SigLIP/CLIP-style ViT and the average-pool projector of the ``gemma3`` projector type, as llama.cpp's
tools/mtmd (clip.cpp's ``build_vit``, models/siglip.cpp) computes them, written once against Backend ops.

* Patches: the patch convolution (stride = kernel = patch size) is a product of each patch's pixels, channel-major,
  with the kernel as a [width, 3 * patch * patch] matrix, plus its bias; then the learned position embeddings.
* Each layer: x += out(attn(ln1(x))), x += down(gelu(up(ln2(x)))), with LayerNorms (weight and bias), biased
  projections, every patch attending to every other (a bidirectional row over a one-layer KV cache that each
  layer overwrites), scores scaled by 1/sqrt(head_dim), gelu in ggml's tanh form; then ``post_ln``.
* The projector: the patch grid averaged over ``merge`` x ``merge`` squares (ggml_pool_2d, default 4), RMSNorm with
  ``mm.soft_emb_norm`` (stored with Gemma's 1 already added), times ``mm.input_projection`` ([vision, text]:
  its transpose is the product's matrix).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from leat.backend import Backend, KVLayout
from leat.batch import Batch, Row
from leat.errors import ModelFileError
from leat.modelfile import ModelFile, Tensor
from leat.vision import image

V = gguf.Keys.ClipVision
Q = gguf.GGMLQuantizationType


@dataclass
class Layer:
    ln1: tuple[Any, Any]
    q: tuple[Any, Any]
    k: tuple[Any, Any]
    v: tuple[Any, Any]
    out: tuple[Any, Any]
    ln2: tuple[Any, Any]
    up: tuple[Any, Any]
    down: tuple[Any, Any]


class SigLIP:
    """The encoder of one mmproj file on one backend: ``encode`` pixels into ``tokens`` rows of the text width."""

    def __init__(self, file: ModelFile, backend: Backend):
        self.file, self.backend = file, backend
        need = functools.partial(required, file)
        self.size, self.patch = int(need(V.IMAGE_SIZE)), int(need(V.PATCH_SIZE))
        self.width, self.heads = int(need(V.EMBEDDING_LENGTH)), int(need(V.Attention.HEAD_COUNT))
        self.eps, layers = float(need(V.Attention.LAYERNORM_EPS)), int(need(V.BLOCK_COUNT))
        self.mean = np.asarray(need(V.IMAGE_MEAN), np.float32)[:3]
        self.std = np.asarray(need(V.IMAGE_STD), np.float32)[:3]
        self.merge, self.side = int(file.get(V.Projector.SCALE_FACTOR, 4)), self.size // self.patch
        if not 0 < self.merge <= self.side or self.side % self.merge or self.size > 4096:  # image.MAX_PIXELS
            raise ModelFileError(f"{file.path.name}: {self.size}-pixel images do not pool by {self.merge}")
        self.tokens = (self.side // self.merge) ** 2
        up = backend.upload
        kernel = self._host("v.patch_embd.weight")
        self.patch_kernel = up(f32("v.patch_embd.weight", kernel.reshape(self.width, -1)))
        self.patch_bias = up(file.tensor("v.patch_embd.bias"))
        self.positions = up(file.tensor("v.position_embd.weight"))
        self.layers = [Layer(*(self._pair(f"v.blk.{i}.{part}") for part in self._parts(i))) for i in range(layers)]
        self.post_ln = self._pair("v.post_ln")
        self.soft_norm = up(file.tensor("mm.soft_emb_norm.weight"))
        projection = self._host("mm.input_projection.weight")  # [vision width, text width]
        self.text_width = projection.shape[1]
        self.projection = up(f32("mm.input_projection.weight", projection.T))

    def _parts(self, layer: int) -> tuple[str, ...]:
        """The layer's tensor stems; older converters stored the MLP's up and down under each other's names
        (a "down" that takes the width in), which llama.cpp swaps back, as here."""
        swapped = self.file.tensor(f"v.blk.{layer}.ffn_down.weight").shape[-1] == self.width
        return PARTS[:-2] + (PARTS[-1], PARTS[-2]) if swapped else PARTS

    def _host(self, name: str) -> np.ndarray:
        return dequantized(self.file, name)

    def _pair(self, stem: str) -> tuple[Any, Any]:
        return self.backend.upload(self.file.tensor(f"{stem}.weight")), self.backend.upload(
            self.file.tensor(f"{stem}.bias")
        )

    def preprocess(self, rgb: np.ndarray) -> np.ndarray:
        """RGB bytes [h, w, 3] -> the encoder's input [3, size, size]: letterboxed to the square (aspect ratio kept,
        black around, as llama.cpp does for this projector), normalized by the file's mean and std."""
        return image.normalize(image.letterbox(rgb, self.size, self.size), self.mean, self.std)

    def encode(self, pixels: np.ndarray) -> Any:
        """Pixels [3, size, size] -> image embeddings [tokens, text width] (a backend array)."""
        B, n, p = self.backend, self.side * self.side, self.patch
        patches = pixels.reshape(3, self.side, p, self.side, p).transpose(1, 3, 0, 2, 4).reshape(n, -1)
        x = B.matmul(B.from_host(patches), self.patch_kernel, self.patch_bias)
        x = B.add(x, B.embed(self.positions, np.arange(n)))
        head_dim = self.width // self.heads
        kv = B.allocate_kv([KVLayout(self.heads, head_dim)], 1, n, page_size=p * p)
        batch = Batch([Row(0, 0, np.zeros(n, np.int64), bidirectional=True)])
        shape = (n, self.heads, head_dim)
        for layer in self.layers:
            h = B.layer_norm(x, *layer.ln1, self.eps)
            q, k, v = (B.reshape(B.matmul(h, *w), shape) for w in (layer.q, layer.k, layer.v))
            x = B.add(x, B.matmul(B.attention(q, k, v, kv, 0, batch, head_dim**-0.5), *layer.out))
            h = B.layer_norm(x, *layer.ln2, self.eps)
            x = B.add(x, B.matmul(B.gelu_mul(B.matmul(h, *layer.up)), *layer.down))
        x = B.layer_norm(x, *self.post_ln, self.eps)
        return B.matmul(B.rms_norm(self._pool(x), self.soft_norm, self.eps), self.projection)

    def _pool(self, x: Any) -> Any:
        return pool(self.backend, x, self.side, self.side, self.merge)

    def tokens_of(self, pixels: np.ndarray) -> int:
        """How many embeddings ``pixels`` (as :meth:`preprocess` gives them) become: one count for every image."""
        return self.tokens


def pool(B: Backend, x: Any, rows: int, cols: int, merge: int) -> Any:
    """The mean of each ``merge`` x ``merge`` square of a ``rows`` x ``cols`` patch grid (rows [rows * cols, width],
    row-major), in row-major order of the squares (ggml_pool_2d's average)."""
    corner = (np.arange(rows // merge)[:, None] * merge * cols + np.arange(cols // merge)[None, :] * merge).reshape(-1)
    total = None
    for dy in range(merge):
        for dx in range(merge):
            part = B.take_rows(x, corner + dy * cols + dx)
            total = part if total is None else B.add(total, part)
    return B.scale(total, 1.0 / (merge * merge))


def required(file: ModelFile, key: str) -> Any:
    value = file.get(key, None)
    if value is None or (isinstance(value, int) and not 0 < value <= 1 << 16):
        raise ModelFileError(f"{file.path.name}: the mmproj's {key} is {value}: missing, or outside 1 to 65536")
    return value


def dequantized(file: ModelFile, name: str) -> np.ndarray:
    t = file.tensor(name)
    return gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape)


PARTS = ("ln1", "attn_q", "attn_k", "attn_v", "attn_out", "ln2", "ffn_up", "ffn_down")


def f32(name: str, values: np.ndarray) -> Tensor:
    data = np.ascontiguousarray(values, dtype=np.float32)
    return Tensor(name, Q.F32, data.shape, data)
