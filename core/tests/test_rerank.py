"""Rerankers (issue #19): a file of pooling type rank loads its classifier head in core, whatever its family; the
engine scores between its steps as the model does alone; files that are no rerankers, or lack the head, are refused
with what is wrong. (Agreement with llama.cpp: tests/test_llamacpp_rerank.py.)"""

from typing import Any

import gguf
import leat
import numpy as np
import pytest
from leat.engine import Engine, GenerationRequest
from leat.errors import LeatError, ModelFileError
from leat.model import rerank_prompt
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

HEAD = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.CLS_OUT] + ".weight"


def reranker(labels: list[str], head_rows: int | None = None) -> type:
    """A llama file made a reranker; ``head_rows``: a head of that many rows instead (0: none)."""

    class Reranker(Llama):
        @classmethod
        def write_metadata(cls, writer: gguf.GGUFWriter, params: Any) -> None:
            Llama.write_metadata(writer, params)
            writer.add_uint32(gguf.Keys.LLM.POOLING_TYPE.format(arch="llama"), int(gguf.PoolingType.RANK))
            writer.add_array(gguf.Keys.Classifier.OUTPUT_LABELS.format(arch="llama"), labels)

        @classmethod
        def tensor_shapes(cls, params: Any) -> dict[str, tuple[int, ...]]:
            shapes = super().tensor_shapes(params)
            if head_rows is not None:
                width = shapes.pop(HEAD)[1]
                shapes |= {HEAD: (head_rows, width)} if head_rows else {}
            return shapes

    return Reranker


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rerank")
    return write_tiny_gguf(reranker(["yes", "no", "maybe"]), folder / "r.gguf", params=Llama.tiny(context=256))


def test_rank_is_the_softmax_of_the_head_times_the_last_state(path):
    model = leat.load(str(path), backend="cpu", precision="f64")
    assert model.pooling == "rank"
    table = model.file.tensor(HEAD)
    head = np.asarray(table.data, np.float64).reshape(table.shape)
    assert head.shape == (3, 64)
    ids = rerank_prompt(model.file, model.tokenizer, "a query", "a document")
    assert ids == model.tokenize("a query", add_special=True) + model.tokenize("a document", add_special=False)
    logits = head @ model.hidden(ids)[-1]
    np.testing.assert_allclose(model.rank(ids), np.exp(logits) / np.exp(logits).sum(), rtol=1e-12)
    with pytest.raises(LeatError, match="reranker"):
        model.embed(ids)


def test_the_engine_ranks_between_its_steps(path):
    model = leat.load(str(path), backend="cpu", precision="f32")
    engine = Engine(model, batch_size=2, max_context=128, page_size=8).start()
    try:
        handle = engine.submit(GenerationRequest(list(range(3, 40)), 40, {"temperature": 0}, ignore_eos=True))
        prompts = [rerank_prompt(model.file, model.tokenizer, "sky", doc) for doc in ("blue", "paris is in france")]
        for ids, got in zip(prompts, engine.rank(prompts)):
            np.testing.assert_allclose(got, model.rank(ids), atol=1e-7)
        assert sum(len(e.ids or ()) for e in handle) == 40
    finally:
        engine.stop()


def test_files_without_a_usable_head_are_refused(tmp_path):
    missing = write_tiny_gguf(reranker(["yes", "no"], head_rows=0), tmp_path / "m.gguf", params=Llama.tiny())
    with pytest.raises(ModelFileError, match="no classifier head cls.output.weight"):
        leat.load(str(missing), backend="cpu")
    wrong = write_tiny_gguf(reranker(["yes", "no"], head_rows=3), tmp_path / "w.gguf", params=Llama.tiny())
    with pytest.raises(ModelFileError, match=r"shape \[3, 64\]; 2 output labels .* make it \[2, 64\]"):
        leat.load(str(wrong), backend="cpu")
    plain = write_tiny_gguf(Llama, tmp_path / "p.gguf", params=Llama.tiny())
    model = leat.load(str(plain), backend="cpu")
    with pytest.raises(LeatError, match="not rank"):
        model.rank([1, 2, 3])
