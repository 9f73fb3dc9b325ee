"""Images in formats other than PNG go through Pillow: their sides are read from the header and a huge image is
refused before Pillow decodes a pixel, as a PNG is (before: a large JPEG or WebP was decoded whole)."""

import sys
import types

import numpy as np
import pytest
from leat.vision.image import MAX_PIXELS, ImageError, decode, size


class FakeImage:  # what Pillow's Image.open returns: the header read, pixels decoded by convert()
    def __init__(self, sides, decoded):
        self.size, self.decoded = sides, decoded

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def convert(self, mode):
        self.decoded.append(mode)
        return np.zeros((self.size[1], self.size[0], 3), np.uint8)


@pytest.fixture
def pillow(monkeypatch):
    decoded, opened = [], {}
    image = types.SimpleNamespace(open=lambda f: FakeImage(opened["sides"], decoded))
    monkeypatch.setitem(sys.modules, "PIL", types.SimpleNamespace(Image=image))
    monkeypatch.setitem(sys.modules, "PIL.Image", image)
    return opened, decoded


def test_a_huge_image_in_another_format_is_refused_before_it_is_decoded(pillow):
    opened, decoded = pillow
    opened["sides"] = (100_000, 50_000)
    for read in (decode, size):
        with pytest.raises(ImageError, match="100000 x 50000"):
            read(b"\xff\xd8\xff\xe0 a JPEG")
    opened["sides"] = (0, 10)
    with pytest.raises(ImageError, match="no pixels"):
        decode(b"\xff\xd8\xff\xe0 a JPEG")
    assert decoded == []
    opened["sides"] = (4096, MAX_PIXELS // 4096)  # the largest allowed
    assert size(b"\xff\xd8") == (4096, 4096) and decode(b"\xff\xd8").shape == (4096, 4096, 3) and decoded == ["RGB"]
