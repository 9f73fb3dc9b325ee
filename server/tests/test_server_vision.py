"""Images through a real `leat serve --mmproj` (a tiny Gemma 3 model, a tiny gemma3 projector), in one process and
with an engine process behind an API frontend (the images' bytes cross to it), driven by the official openai and
anthropic clients: each API's image part answers what `Model.generate` answers in-process with the same image,
another image changes the answer, and bad image data is a 400."""

from __future__ import annotations

import base64
import struct

import anthropic
import gguf
import numpy as np
import openai
import pytest
from leat.model import load
from leat.testing import encode_png, write_tiny_gguf, write_tiny_mmproj
from leat.vision import MARKER
from leat_arch_gemma.gemma import Gemma3
from leat_server.testing import ServerProcess

QUESTION = "what is it"
MAX_TOKENS = 8
# seed 2's tiny model answers these two images differently (most tiny random models answer every image alike)
IMAGES = {
    "noise": encode_png(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)),
    "black": encode_png(np.zeros((32, 32, 3), np.uint8)),
}


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision")
    params = Gemma3.tiny()
    model = write_tiny_gguf(Gemma3, folder / "tiny-gemma3.gguf", seed=2, params=params)
    mmproj = write_tiny_mmproj(folder / "tiny-mmproj.gguf", params.width, gguf.VisionProjectorType.GEMMA3, seed=102)
    return model, mmproj


@pytest.fixture(scope="module")
def expected(files) -> dict[str, str]:
    """Each image's greedy answer from Model.generate in this process, on the prompt the chat template renders."""
    model = load(str(files[0]), backend="cpu", precision="f32", pull=False)
    model.load_mmproj(files[1])
    text = model.chat_template.render([{"role": "user", "content": f"{MARKER}{QUESTION}"}], add_generation_prompt=True)
    out = {}
    for name, png in IMAGES.items():
        ids, spans = model.image_prompt(text, [png], add_special=False)
        tokens = model.generate(ids, images=spans, max_tokens=MAX_TOKENS, sampling={"temperature": 0})
        out[name] = "".join(t.text for t in tokens)
    assert out["noise"] != out["black"], "the two images must answer differently for these tests to mean anything"
    return out


@pytest.fixture(scope="module", params=["0", "1"], ids=["one-process", "engine-process"])
def server(request, files):
    args = ["--backend", "cpu", "--mmproj", str(files[1]), "--api-workers", request.param, "--batch-size", "2"]
    with ServerProcess(files[0], args, timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client, url: str) -> str:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0
    )
    return answer.choices[0].message.content


def test_openai_image_parts_reach_the_model(client, expected):
    for name, png in IMAGES.items():
        assert chat(client, data_url(png)) == expected[name], name


def test_anthropic_image_blocks_reach_the_model(server, expected):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGES["black"]).decode()}
    answer = client.messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}
        ],
    )
    assert "".join(block.text for block in answer.content) == expected["black"]


def test_responses_input_image_reaches_the_model(client, expected):
    content = [
        {"type": "input_image", "image_url": data_url(IMAGES["noise"])},
        {"type": "input_text", "text": QUESTION},
    ]
    answer = client.responses.create(
        model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.output_text == expected["noise"]


def huge_png() -> bytes:
    """A one-pixel PNG whose header claims 5000 x 5000 pixels."""
    png = encode_png(np.zeros((1, 1, 3), np.uint8))
    return png[:16] + struct.pack(">II", 5000, 5000) + png[24:]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("https://example.com/cat.png", "not fetched"),
        ("data:image/png;base64,@@not base64@@", "not valid base64"),
        (data_url(b"this is not an image"), "image"),  # "not a PNG ... need Pillow", or Pillow's "cannot read"
        (data_url(IMAGES["noise"][:200]), "damaged"),
        (data_url(huge_png()), "more than"),
    ],
    ids=["remote-url", "not-base64", "not-an-image", "truncated", "too-many-pixels"],
)
def test_bad_images_are_a_400(client, server, url, says):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, url)
    assert says in info.value.body["message"]
    assert info.value.body["param"] in ("messages[0].content[0]", "messages", "prompt")
    assert server.process.poll() is None
