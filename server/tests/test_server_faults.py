"""A request whose own parts fail mid-generation gets a 4xx; the requests running beside it are not touched.

The server runs in-process (its ASGI app on an httpx transport) so a test can give one request a logits
processor that fails: here through ``logit_bias``, whose processors ``Service.logit_bias`` makes.
"""

from __future__ import annotations

import asyncio

import httpx
import leat
import openai
import pytest
from leat.testing import FailsOnCall, write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server import ServeOptions, build
from leat_server.service import Service

POISON = "13"  # the logit_bias key that gets the failing processor


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(Llama, tmp_path_factory.mktemp("faults") / "tiny.gguf", params=Llama.tiny(context=512))
    return leat.load(str(path), backend="cpu", precision="f32")


@pytest.fixture
def app(model, monkeypatch):
    plain = Service.logit_bias

    def logit_bias(self, bias):
        return [FailsOnCall(3)] if bias and POISON in bias else plain(self, bias)

    monkeypatch.setattr(Service, "logit_bias", logit_bias)
    app, engine = build(ServeOptions(model="tiny", batch_size=4), model, keys=None)
    engine.start()
    yield app, engine
    engine.stop()


def ask(client, text, **extra):
    messages = [{"role": "user", "content": text}]
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, **extra)


def test_a_failing_processor_is_a_400_and_the_others_finish(app):
    app, engine = app

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as http:
            client = openai.AsyncOpenAI(base_url="http://127.0.0.1:8080/v1", api_key="-", http_client=http)
            texts = ["hello there", "the quick brown fox", "one two three"]
            alone = [(await ask(client, t)).choices[0].message.content for t in texts]
            together = await asyncio.gather(
                *(ask(client, t) for t in texts), ask(client, "poison", logit_bias={POISON: 1}), return_exceptions=True
            )
            streamed = await http.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "poison"}],
                    "max_tokens": 10,
                    "temperature": 0,  # sampled, the tiny model may stop before the processor's failing call
                    "logit_bias": {POISON: 1},
                    "stream": True,
                },
            )
        return alone, together, streamed

    alone, together, streamed = asyncio.run(main())
    *answers, failed = together
    assert [a.choices[0].message.content for a in answers] == alone
    assert isinstance(failed, openai.BadRequestError), failed
    assert failed.body["type"] == "invalid_request_error"
    assert failed.body["message"] == "generation failed: test constraint failed: ValueError: poisoned"
    # streamed, the 200 has gone out: the error comes in-band, as the same client error
    assert streamed.status_code == 200 and '"type":"invalid_request_error"' in streamed.text.replace(" ", "")
    stats = engine.stats()
    assert stats["running"] == 0 and stats["kv_pages_used"] == stats["kv_pages_cached"]
