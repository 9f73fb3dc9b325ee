"""The ``mtp`` proposer: drafting with the model's own multi-token-prediction layer, verified exactly."""

import gguf
import leat
import numpy as np
import pytest
from leat import nextn
from leat.architecture import Weights
from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.speculative import Speculation, load_proposer
from leat.testing import write_tiny_gguf
from leat_arch_deepseek2.deepseek2 import DeepSeek2
from leat_arch_glm4moe.glm4moe import Glm4Moe
from leat_arch_llama.llama import Llama
from leat_speculative.mtp import MultiTokenPrediction
from leat_speculative.testing import greedy

FAMILIES = {"deepseek2": DeepSeek2, "glm4moe": Glm4Moe}
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    """A tiny file of each family with one nextn layer (block 3 of 4), its eh_proj in Q8_0 where the width is a
    multiple of Q8_0's blocks (the token and hidden halves are split at a block edge)."""
    family = FAMILIES[request.param]
    path = tmp_path_factory.mktemp("mtp") / f"{request.param}.gguf"
    params = family.tiny(layers=4, nextn_layers=1, context=512)
    types = {"blk.3.nextn.eh_proj.weight": Q8_0} if params.width % 32 == 0 else {}
    write_tiny_gguf(family, path, params=params, types=types)
    return leat.load(str(path), backend="cpu", precision="f64")


class Recording(MultiTokenPrediction):
    """Drafts 3 tokens whatever the controller asks (the engine keeps the first k), and records them."""

    def __init__(self, model):
        super().__init__(model)
        self.proposals = []

    def propose(self, key, tokens, k):
        draft = super().propose(key, tokens, 3)
        self.proposals.append((list(tokens), draft))
        return draft


def drafts_from_scratch(model, tokens, k):
    """The nextn layer run over the whole sequence at once, fresh: pairs (x_p, h_{p-1}) with the target's states
    from one pass (zeros before x_0), then k - 1 steps on its own states."""
    arch, ids = model.architecture, np.asarray(tokens, dtype=np.int64)
    _, h = arch.forward_hidden(Batch([Row(0, 0, ids, all_logits=True)]), model.new_kv(512))
    kv = model.backend.allocate_kv(arch.nextn_kv_layouts(), 1, 512)
    logits, own = arch.nextn(Batch([Row(0, 0, ids)]), np.concatenate([np.zeros_like(h[:1]), h[:-1]]), kv)
    draft = [int(np.argmax(logits[-1]))]
    while len(draft) < k:
        logits, own = arch.nextn(Batch([Row(0, len(ids) - 1 + len(draft), np.asarray(draft[-1:]))]), own, kv)
        draft.append(int(np.argmax(logits[-1])))
    return draft


def test_greedy_equals_plain_decoding_and_drafts_follow_the_layer(model):
    """Three requests in one batch (prompts over several chunks, one past the proposer's first 256 positions of KV),
    drafting at every step: the output is plain decoding's, and every draft is what the nextn layer gives when run
    from scratch over the tokens the request had kept (rejected drafts' states dropped)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 290, n).tolist() for n in (7, 40, 250)]
    expected, _ = greedy(model, prompts, context=512)
    proposer = Recording(model)
    got, stats = greedy(model, prompts, Speculation(proposer, max_draft=3, threshold=0.0), context=512)
    assert got == expected
    assert stats["proposed"] > 3 * 12, stats
    assert len(proposer.proposals) > 30
    short = [(tokens, draft) for tokens, draft in proposer.proposals if len(tokens) < 100]
    longest = max(proposer.proposals, key=lambda proposal: len(proposal[0]))
    assert len(longest[0]) > 256  # its KV was grown (copied) on the way
    for tokens, draft in short[::3] + [longest]:
        assert draft == drafts_from_scratch(model, tokens, len(draft)), len(tokens)
    assert not proposer.states  # every request's state is forgotten when it ends


def test_nextn_input_is_eh_proj_of_the_normed_token_then_hidden(model):
    """``eh_proj @ [rms_norm(embed(x)) * enorm ; rms_norm(h) * hnorm]`` in float64 from the file's tensors (a Q8_0
    eh_proj dequantized by gguf): the token's half is the first."""
    arch, file = model.architecture, model.architecture.file
    p = arch.params
    w = nextn.load_nextn(Weights(file, model.backend), 3, p.width, arch.embedding, arch.output_norm, arch.output)

    def tensor(name):
        t = file.tensors[name]
        return gguf.quants.dequantize(t.data, t.qtype).reshape(t.shape).astype(np.float64)

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + p.norm_eps) * weight

    tokens = np.array([3, 141, 299])
    hidden = np.random.default_rng(2).standard_normal((3, p.width))
    e = tensor("token_embd.weight")[tokens]
    want = (
        np.concatenate(
            [rms(e, tensor("blk.3.nextn.enorm.weight")), rms(hidden, tensor("blk.3.nextn.hnorm.weight"))], axis=1
        )
        @ tensor("blk.3.nextn.eh_proj.weight").T
    )
    got = nextn.nextn_input(model.backend, w, tokens, hidden, p.norm_eps)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_refused_for_a_file_without_nextn_layers(tmp_path, model):
    plain = leat.load(str(write_tiny_gguf(Llama, tmp_path / "llama.gguf")), backend="cpu")
    with pytest.raises(LeatError, match="no multi-token-prediction layer"):
        load_proposer("mtp", plain)
    assert isinstance(load_proposer("mtp", model), MultiTokenPrediction)
