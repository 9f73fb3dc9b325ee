"""Qwen3.5's multi-token-prediction layer: it drafts as llama.cpp's ``draft-mtp`` does (logits recorded by
scripts/record_llamacpp_drafters.py on the files references/tiny_drafters.py builds), and the engine still refuses
to speculate for these models: a rejected draft would leave the linear layers' recurrent state past the tokens kept,
and that state cannot rewind."""

import importlib.util
import json
from pathlib import Path

import leat
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.engine import Engine
from leat.errors import LeatError
from leat.speculative import Speculation, load_proposer

REFERENCES = Path(__file__).parent / "references"
_spec = importlib.util.spec_from_file_location("tiny_drafters", REFERENCES / "tiny_drafters.py")
tiny_drafters = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_drafters)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return tiny_drafters.build(tmp_path_factory.mktemp("qwen35-mtp"))


def drafted_logits(model, tokens, k):
    """The nextn layer's logits at k greedy draft steps after ``tokens``: its KV filled with each token but the last
    paired with the target's state before it (zeros before the first), then the last token with the target's state
    before it, then each draft token with the layer's own state, one position on."""
    arch, ids = model.architecture, np.asarray(tokens)
    _, states = arch.forward_hidden(Batch([Row(0, 0, ids[:-1], all_logits=True)]), model.new_kv(256))
    kv = model.backend.allocate_kv(arch.nextn_kv_layouts(), 1, 256)
    logits, own = arch.nextn(Batch([Row(0, 0, ids)]), np.concatenate([np.zeros_like(states[:1]), states]), kv)
    out = [logits[-1]]
    while len(out) < k:
        token = np.asarray([int(np.argmax(out[-1]))])
        logits, own = arch.nextn(Batch([Row(0, len(ids) - 1 + len(out), token)]), own, kv)
        out.append(logits[-1])
    return np.array(out)


@pytest.mark.parametrize("name", ["qwen35-mtp", "qwen35moe-mtp"])
def test_the_nextn_layer_drafts_as_llamacpp(files, name):
    """The same greedy draft at every step, each logit within 0.01 of llama.cpp's (its F16 KV cache; measured 8.0e-4
    at most, of logits spread over 5.5 to 6.0)."""
    info = files[name]
    recorded = json.loads((REFERENCES / "drafters_llamacpp.json").read_text())["drafters"][name]
    assert recorded["sha256"] == info["sha256"], "the tiny files changed: run scripts/record_llamacpp_drafters.py"
    reference = np.load(REFERENCES / "drafters_llamacpp.npz")
    assert reference[f"{name}/tokens"].tolist() == info["tokens"]
    got = drafted_logits(leat.load(info["target"], backend="cpu", precision="f64"), info["tokens"], info["steps"])
    want = reference[f"{name}/logits"]
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert np.abs(got - want).max() < 0.01


def test_speculation_with_it_is_refused(files):
    model = leat.load(files["qwen35-mtp"]["target"], backend="cpu")
    proposer = load_proposer("mtp", model)  # the layer is one the mtp proposer runs
    with pytest.raises(LeatError, match="recurrent state per sequence, which cannot rewind: it cannot speculate"):
        Engine(model, speculation=Speculation(proposer))
