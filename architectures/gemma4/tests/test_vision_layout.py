"""An API frontend lays a Gemma 4 image out without the encoder (``leat.vision.image_tokens``: the image's header
and the projector's ``sizing``): its count equals what the encoder makes of the decoded, preprocessed pixels, and
the engine refuses an image laid out at another count."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from leat.errors import LeatError, ModelFileError
from leat.model import load
from leat.testing import encode_png, write_tiny_gguf, write_tiny_mmproj
from leat.vision import Vision, image_tokens
from leat_arch_gemma4.gemma4 import Gemma4


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layout")
    params = Gemma4.tiny()
    model = load(str(write_tiny_gguf(Gemma4, folder / "tiny.gguf", params=params)), backend="cpu", pull=False)
    model.load_mmproj(
        write_tiny_mmproj(folder / "mmproj.gguf", params.width, gguf.VisionProjectorType.GEMMA4V, 1, "rope2d")
    )
    return model.vision


# (height, width): kept (72 tokens of the tiny projector's 12-pixel squares), too few, one square, a thin strip,
# too many, sides that round down and up
@pytest.mark.parametrize("size", [(110, 100), (30, 20), (12, 12), (13, 500), (300, 600), (257, 129)])
def test_a_frontend_counts_what_the_encoder_makes(vision, size):
    png = encode_png(np.zeros((*size, 3), np.uint8))
    layout = vision.layout()
    assert layout["tokens"] is None and layout["sizing"] is not None
    assert image_tokens(layout, png) == vision.span(0, png).length


def test_the_engine_refuses_an_image_laid_out_at_another_count(vision):
    png = encode_png(np.zeros((110, 100, 3), np.uint8))
    with pytest.raises(LeatError, match="laid out at 70 positions makes 72"):
        vision.span(0, png, 70)


V = gguf.Keys.ClipVision


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (V.PATCH_SIZE, 65535, "make images too large"),  # before: loaded, then 8.5 TiB asked for the first image
        (V.EMBEDDING_LENGTH, 65535, "do not fit its tensors"),  # before: ValueError (a reshape)
        (V.Attention.HEAD_COUNT, 0, "outside 1 to 65536"),  # before: ZeroDivisionError
    ],
)
def test_a_projector_of_impossible_hyperparameters_is_refused(vision, tmp_path, key, value, says):
    path = write_tiny_mmproj(
        tmp_path / "mmproj.gguf", Gemma4.tiny().width, gguf.VisionProjectorType.GEMMA4V, 1, "rope2d"
    )
    gguf.GGUFReader(path, "r+").fields[key].parts[-1][0] = value  # the memory map writes it through
    with pytest.raises(ModelFileError, match=says):
        Vision(path, vision.encoder.backend, Gemma4.tiny().width, Gemma4.projectors)


def test_a_projector_of_two_deviations_for_three_channels_is_refused(vision, tmp_path, monkeypatch):
    """Before: it loaded, and each image was a ValueError (a failed broadcast) when normalized."""
    add = gguf.GGUFWriter.add_array
    monkeypatch.setattr(gguf.GGUFWriter, "add_array", lambda w, k, v: add(w, k, v[:2] if k == V.IMAGE_STD else v))
    path = write_tiny_mmproj(
        tmp_path / "mmproj.gguf", Gemma4.tiny().width, gguf.VisionProjectorType.GEMMA4V, 1, "rope2d"
    )
    with pytest.raises(ModelFileError, match="do not fit"):
        Vision(path, vision.encoder.backend, Gemma4.tiny().width, Gemma4.projectors)
