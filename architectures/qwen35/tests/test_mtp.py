"""Qwen3.5's multi-token-prediction layer: it drafts as llama.cpp's ``draft-mtp`` does (logits recorded by
scripts/record_llamacpp_drafters.py on the files references/tiny_drafters.py builds), and greedy decoding with it
(or with prompt lookup) equals plain decoding: after a rejected draft the linear layers' recurrent state rewinds to
the tokens kept (:meth:`leat.backend.Backend.gated_delta_net`)."""

import json
import runpy
from pathlib import Path

import leat
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.engine import Engine
from leat.errors import LeatError
from leat.model import Model
from leat.modelfile import ModelFile
from leat.speculative import Proposer, Speculation, load_proposer
from leat_arch_qwen35.qwen35 import Qwen35
from leat_backend_cpu.backend import CPUBackend
from leat_speculative.testing import greedy

REFERENCES = Path(__file__).parent / "references"
build_tiny_drafters = runpy.run_path(str(REFERENCES / "tiny_drafters.py"))["build"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return build_tiny_drafters(tmp_path_factory.mktemp("qwen35-mtp"))


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


class Oracle(Proposer):
    """Proposes each request's plain greedy continuation (``expected``, by prompt) with its third token wrong: two
    accepted, then a rejection inside the verified row."""

    def __init__(self, expected):
        super().__init__(None)
        self.expected = expected

    def propose(self, key, tokens, k):
        for prompt, out in self.expected:
            if tokens[: len(prompt)] == prompt:
                draft = out[len(tokens) - len(prompt) :][:3]
                return draft[:2] + [(t + 1) % 300 for t in draft[2:]]
        return []


@pytest.mark.parametrize("name", ["qwen35-mtp", "qwen35moe-mtp"])
def test_greedy_speculation_equals_plain_decoding(files, name):
    """Three requests in one batch (prompts over several chunks), drafting at every step with the nextn layer (on
    random weights every draft is rejected), then with drafts whose third token is wrong: the recurrent state rewinds
    into the verified row, and the output is plain decoding's."""
    model = leat.load(files[name]["target"], backend="cpu", precision="f64")
    prompts = [np.random.default_rng(1).integers(0, 290, n).tolist() for n in (7, 40, 90)]
    expected, _ = greedy(model, prompts)
    got, stats = greedy(model, prompts, Speculation(load_proposer("mtp", model), max_draft=3, threshold=0.0))
    assert got == expected
    assert stats["verifications"] > 12, stats
    got, stats = greedy(model, prompts, Speculation(Oracle(list(zip(prompts, expected))), max_draft=3, threshold=0.0))
    assert got == expected
    assert 6 < stats["accepted"] < stats["proposed"], stats


def test_a_draft_model_with_a_recurrent_state_is_refused(files):
    model = leat.load(files["qwen35-mtp"]["target"], backend="cpu")
    with pytest.raises(LeatError, match="keeps a recurrent state, which cannot rewind"):
        load_proposer("draft", model, draft=model)


def test_a_backend_that_does_not_rewind_the_state_is_refused(files):
    class NoRewind(CPUBackend):
        rewinds_drafts = False

    file = ModelFile(files["qwen35-mtp"]["target"])
    backend = NoRewind("f32")
    model = Model(file, Qwen35(file, backend), backend)
    with pytest.raises(LeatError, match="the cpu backend does not rewind past a rejected draft yet"):
        Engine(model, speculation=Speculation(load_proposer("mtp", model)))
