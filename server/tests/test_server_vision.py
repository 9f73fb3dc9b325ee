"""Images through a real `leat serve --mmproj` (tiny Gemma 3 and Gemma 4 models, tiny gemma3 and gemma4v projectors),
in one process and with an engine process behind two API frontends (the images' bytes cross to it), driven by the
official openai and anthropic clients: each API's image part answers what `Model.generate` answers in-process with
the same image, with as many prompt tokens, another image changes the answer, and bad image data is a 400.

A gemma4v image takes as many positions as its size says: an API frontend, without the encoder, counts them from the
image's header and the projector's metadata (``leat.vision.image_tokens``); Gemma 4's two images are of two sizes."""

from __future__ import annotations

import base64
import struct
import zlib
from dataclasses import dataclass

import anthropic
import gguf
import numpy as np
import openai
import pytest
from leat.model import load
from leat.testing import encode_png, write_tiny_gguf, write_tiny_mmproj
from leat.vision import MARKER
from leat_arch_gemma.gemma import Gemma3
from leat_arch_gemma4.gemma4 import Gemma4
from leat_server.testing import ServerProcess

QUESTION = "what is it"
MAX_TOKENS = 8


@dataclass(frozen=True)
class Family:
    architecture: type
    seed: int  # the model's; the projector's is 100 more
    projector: str
    vit: str
    sizes: tuple[tuple[int, int], tuple[int, int]]  # the images' (height, width): noise, black


FAMILIES = {
    # seed 2's tiny model answers these two images differently (some tiny random models answer every image alike)
    "gemma3": Family(Gemma3, 2, gguf.VisionProjectorType.GEMMA3, "siglip", ((32, 32), (32, 32))),
    # 110 x 100 pixels keep 9 x 8 = 72 tokens (the tiny projector's 4-pixel patches pooled 3 x 3: 12-pixel squares),
    # 30 x 20 are 6 too few and grow to 11 x 7 = 77; seed 4's greedy tokens lead by >= 0.11 (float64) after both
    "gemma4": Family(Gemma4, 4, gguf.VisionProjectorType.GEMMA4V, "rope2d", ((110, 100), (30, 20))),
}


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def images(family) -> dict[str, bytes]:
    noise, black = family.sizes
    return {
        "noise": encode_png(np.random.default_rng(0).integers(0, 256, (*noise, 3), dtype=np.uint8)),
        "black": encode_png(np.zeros((*black, 3), np.uint8)),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory, family):
    folder = tmp_path_factory.mktemp("vision")
    params = family.architecture.tiny()
    model = write_tiny_gguf(family.architecture, folder / "tiny.gguf", seed=family.seed, params=params)
    mmproj = write_tiny_mmproj(folder / "mmproj.gguf", params.width, family.projector, family.seed + 100, family.vit)
    return model, mmproj


@pytest.fixture(scope="module")
def expected(files, images) -> dict[str, tuple[str, int]]:
    """Each image's greedy answer from Model.generate in this process, on the prompt the chat template renders, and
    that prompt's length."""
    model = load(str(files[0]), backend="cpu", precision="f32", pull=False)
    model.load_mmproj(files[1])
    text = model.chat_template.render([{"role": "user", "content": f"{MARKER}{QUESTION}"}], add_generation_prompt=True)
    out = {}
    for name, png in images.items():
        ids, spans = model.image_prompt(text, [png], add_special=False)
        tokens = model.generate(ids, images=spans, max_tokens=MAX_TOKENS, sampling={"temperature": 0})
        out[name] = ("".join(t.text for t in tokens), len(ids))
    assert out["noise"][0] != out["black"][0], "the two images must answer differently for these tests to mean anything"
    return out


@pytest.fixture(scope="module", params=["0", "2"], ids=["one-process", "engine-process"])
def server(request, files):
    args = ["--backend", "cpu", "--mmproj", str(files[1]), "--api-workers", request.param, "--batch-size", "2"]
    with ServerProcess(files[0], args, timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client, url: str) -> tuple[str, int]:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0
    )
    return answer.choices[0].message.content, answer.usage.prompt_tokens


def test_openai_image_parts_reach_the_model(client, images, expected):
    for name, png in images.items():
        assert chat(client, data_url(png)) == expected[name], name


def test_anthropic_image_blocks_reach_the_model(server, images, expected):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(images["black"]).decode()}
    answer = client.messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}
        ],
    )
    prompt = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)  # the OpenAI test's is cached
    assert ("".join(block.text for block in answer.content), prompt) == expected["black"]


def test_responses_input_image_reaches_the_model(client, images, expected):
    content = [
        {"type": "input_image", "image_url": data_url(images["noise"])},
        {"type": "input_text", "text": QUESTION},
    ]
    answer = client.responses.create(
        model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.output_text == expected["noise"][0]


NOISE = encode_png(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))


def huge_png() -> bytes:
    """A one-pixel PNG whose header claims 5000 x 5000 pixels."""
    png = encode_png(np.zeros((1, 1, 3), np.uint8))
    return png[:16] + struct.pack(">II", 5000, 5000) + png[24:]


def palette_png() -> bytes:
    """A 1 x 1 palette PNG whose pixel is entry 5 of a two-entry palette (its chunks' CRCs left zero: not checked)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + bytes(4)

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 3, 0, 0, 0))
    return NOISE[:8] + header + chunk(b"PLTE", bytes(6)) + chunk(b"IDAT", zlib.compress(b"\0\5")) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://example.com/cat.png", "not fetched"),
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        (data_url(b"this is not an image"), "image"),  # "not a PNG ... need Pillow", or Pillow's "cannot read"
        (data_url(NOISE[:200]), "damaged"),
        (data_url(NOISE[:20]), "no header"),
        (data_url(huge_png()), "more than"),
        (data_url(NOISE[:16] + struct.pack(">II", 0, 32) + NOISE[24:]), "no pixels"),
        (data_url(palette_png()), "past its end"),
    ],
    ids=[
        "remote-url",
        "not-base64",
        "not-an-image",
        "truncated",
        "no-png-header",
        "too-many-pixels",
        "no-width",
        "palette",
    ],
)
def test_bad_images_are_a_400(client, server, url, says):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, url)
    assert says in info.value.body["message"]
    assert info.value.body["param"] in ("messages[0].content[0]", "messages", "prompt")
    assert server.process.poll() is None
