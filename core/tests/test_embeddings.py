"""Embeddings (issue #19): a sequence's final hidden states pooled as the GGUF says and L2-normalized, checked
against the float64 oracle's hidden states pooled here."""

import gguf
import leat
import numpy as np
import pytest
from leat.engine import Engine, GenerationRequest
from leat.errors import LeatError
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

POOLING = gguf.Keys.LLM.POOLING_TYPE.format(arch="llama")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(Llama, tmp_path_factory.mktemp("embed") / "tiny.gguf", params=Llama.tiny(context=256))


def unit(v):
    return v / np.linalg.norm(v)


def test_pooling_follows_the_gguf_and_matches_the_oracle(path):
    model = leat.load(str(path), backend="cpu", precision="f32")
    oracle = leat.load(str(path), backend="cpu", precision="f64")
    ids = model.tokenize("the quick brown fox jumps over the lazy dog")
    states = oracle.hidden(ids)
    assert states.shape == (len(ids), 64)
    assert model.pooling == "mean"  # the file states none
    np.testing.assert_allclose(model.embed(ids), unit(states.mean(axis=0)), atol=1e-5)
    for kind, row in ((gguf.PoolingType.LAST, -1), (gguf.PoolingType.CLS, 0)):
        model.file.metadata[POOLING] = int(kind)
        np.testing.assert_allclose(model.embed(ids), unit(states[row]), atol=1e-5)
    model.file.metadata[POOLING] = int(gguf.PoolingType.NONE)
    with pytest.raises(LeatError, match="pooling type is none"):
        model.embed(ids)
    # the last hidden state is what the logits are made of
    output = oracle.file.tensor("token_embd.weight")  # tied: the output matrix is the embedding (F32 here)
    table = np.asarray(output.data, np.float64).reshape(output.shape)
    np.testing.assert_allclose(oracle.logits(ids, native=True), states @ table.T, rtol=1e-7, atol=1e-7)


def test_the_engine_embeds_between_its_steps(path):
    model = leat.load(str(path), backend="cpu", precision="f32")
    engine = Engine(model, batch_size=2, max_context=128, page_size=8).start()
    try:
        handle = engine.submit(GenerationRequest(list(range(3, 40)), 60, {"temperature": 0}, ignore_eos=True))
        prompts = [model.tokenize("hello world"), model.tokenize("the sky is blue")]
        got = engine.embed(prompts)
        for ids, vector in zip(prompts, got):
            np.testing.assert_allclose(vector, model.embed(ids), atol=1e-6)
        events = list(handle)
        assert events[-1].kind == "done" and sum(len(e.ids or ()) for e in events) == 60
    finally:
        engine.stop()
