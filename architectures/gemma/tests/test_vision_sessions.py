"""An image in a named session's history (tiny Gemma 3 + tiny mmproj, CPU backend): a later turn that repeats the
conversation reuses the image's positions from the session, also after a fork and after hibernating and a restart,
with the answer of a sessionless request; the same conversation with another image reuses nothing from the image on.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from leat.engine import Engine, GenerationRequest
from leat.model import load
from leat.testing import encode_png, write_tiny_gguf, write_tiny_mmproj
from leat.vision import MARKER
from leat_arch_gemma.gemma import Gemma3

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-sessions")
    params = Gemma3.tiny(window=8, pattern=2)
    path = write_tiny_gguf(Gemma3, folder / "gemma3.gguf", seed=3, params=params)
    model = load(str(path), backend="cpu", pull=False)
    model.load_mmproj(write_tiny_mmproj(folder / "mmproj.gguf", params.width, gguf.VisionProjectorType.GEMMA3))
    return model


def image(seed: int) -> bytes:
    return encode_png(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8))


def run(engine, ids, spans, **request):
    """Greedy tokens of the prompt ``ids`` with its image ``spans``, and how many of its tokens came cached."""
    handle = engine.submit(GenerationRequest(ids, 4, GREEDY, images=spans, ignore_eos=True, **request))
    events = list(handle)
    assert events[-1].kind == "done", events[-1]
    return [t for e in events for t in e.ids], events[-1].usage["cached_tokens"]


def test_an_image_in_a_session_survives_fork_hibernate_and_restart(model, tmp_path):
    ids, spans = model.image_prompt(f"look {MARKER} at this", [image(1)])
    _, others = model.image_prompt(f"look {MARKER} at this", [image(2)])
    end = spans[0].start + spans[0].length
    options = {"batch_size": 1, "max_context": 128, "page_size": 8, "session_store": tmp_path}
    engine = Engine(model, **options).start()
    try:
        reply, _ = run(engine, ids, spans, session="s")
        turn = ids + reply + model.tokenize(" and then", add_special=False)
        want, cached = run(engine, turn, spans, client="fresh")
        assert cached == 0
        engine.fork_session("s", "t")
        got, cached = run(engine, turn, spans, session="t")
        assert got == want and cached > end
        _, cached = run(engine, turn, others, session="s")  # another image: nothing from the image on is reused
        assert cached <= spans[0].start
        engine.hibernate("t")
    finally:
        engine.stop()
    restarted = Engine(model, **options).start()
    try:
        again = turn + got + model.tokenize(" more", add_special=False)
        want, _ = run(restarted, again, spans, client="fresh")
        got, cached = run(restarted, again, spans, session="t")
        assert got == want and cached > end
    finally:
        restarted.stop()
