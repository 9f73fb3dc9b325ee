"""Gemma 4's assistant drafter: the ``assistant`` proposer's drafts against a float64 numpy reference of llama.cpp's
graph (the file's tensors dequantized by gguf), greedy output with it equal to plain decoding, and what it refuses."""

import json
import math
import runpy
from pathlib import Path

import gguf
import leat
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.conformance.architecture import assert_metadata_round_trips
from leat.errors import LeatError
from leat.modelfile import ModelFile
from leat.speculative import Speculation, load_proposer
from leat.testing import write_tiny_gguf
from leat_arch_gemma4.assistant import POST_PROJECTION, PRE_PROJECTION, Gemma4Assistant
from leat_arch_gemma4.gemma4 import Gemma4
from leat_speculative.assistant import Assistant
from leat_speculative.testing import greedy

Q8_0 = gguf.GGMLQuantizationType.Q8_0
REFERENCES = Path(__file__).parent / "references"
build_tiny_drafters = runpy.run_path(str(REFERENCES / "tiny_drafters.py"))["build"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny E2B-shaped target (6 layers, window 8, the last two sharing layers 2 and 3's KV) and a tiny assistant
    in Q8_0 (its pre-projection split at the target's width, a block edge), both on the float64 oracle."""
    folder = tmp_path_factory.mktemp("assistant")
    target = leat.load(str(write_tiny_gguf(Gemma4, folder / "target.gguf")), backend="cpu", precision="f64")
    path = write_tiny_gguf(Gemma4Assistant, folder / "assistant.gguf", qtype=Q8_0, seed=3)
    return target, leat.load(str(path), backend="cpu", precision="f64")


def tensor(file, tensor_name):
    t = file.tensors[tensor_name]
    return gguf.quants.dequantize(t.data, t.qtype).reshape(t.shape).astype(np.float64)


def rms(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def neox(x, position, dims, base, factors):
    half = dims // 2
    angle = position * base ** (-2.0 * np.arange(half) / dims) / (1.0 if factors is None else factors[:half])
    cos, sin, out = np.cos(angle), np.sin(angle), x.copy()
    out[:, :half] = x[:, :half] * cos - x[:, half:dims] * sin
    out[:, half:dims] = x[:, half:dims] * cos + x[:, :half] * sin
    return out


def reference(target, assistant, tokens, k):
    """The assistant's logits at each of k greedy draft steps after ``tokens``, as llama.cpp's graph computes them,
    in float64 from the files' tensors: the target's states and K/V from one fresh pass over all but the last token."""
    arch, a, last = target.architecture, assistant.architecture.params, len(tokens) - 1
    batch = Batch([Row(0, 0, np.asarray(tokens[:-1]), all_logits=True)])
    _, states, shared = arch.forward_shared_kv(batch, target.new_kv(256))
    file = ModelFile(assistant.file.path)

    def w(kind, layer=None):
        return tensor(file, gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight")

    T = gguf.MODEL_TENSOR
    embedding, hidden, token, out = tensor(target.file, "token_embd.weight"), states[-1], tokens[-1], []
    for _ in range(k):
        cur = tensor(file, PRE_PROJECTION) @ np.concatenate([embedding[token] * math.sqrt(a.width_out), hidden])
        for i in range(a.layers):
            sliding, size = a.pattern[i], a.head_size(i)
            keys, values = (np.asarray(x, np.float64) for x in shared[0 if sliding else 1])
            x = rms(cur, w(T.ATTN_NORM, i), a.norm_eps)
            q = rms((w(T.ATTN_Q, i) @ x).reshape(a.heads, size), w(T.ATTN_Q_NORM, i), a.norm_eps)
            if sliding:
                q = neox(q, last, a.rope_dims_swa, a.rope_base_swa, None)
            else:
                q = neox(q, last, a.rope_dims, a.rope_base, w(T.ROPE_FREQS))
            seen = slice(max(0, last - a.window + 1) if sliding else 0, last)  # the positions before, in the window
            group = a.heads // keys.shape[1]
            heads = []
            for h in range(a.heads):
                scores = keys[seen, h // group] @ q[h]
                weights = np.exp(scores - scores.max())
                heads.append(weights / weights.sum() @ values[seen, h // group])
            attended = rms(w(T.ATTN_OUT, i) @ np.concatenate(heads), w(T.ATTN_POST_NORM, i), a.norm_eps) + cur
            x = rms(attended, w(T.FFN_NORM, i), a.norm_eps)
            g = w(T.FFN_GATE, i) @ x
            gelu = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            x = w(T.FFN_DOWN, i) @ (gelu * (w(T.FFN_UP, i) @ x))
            cur = (rms(x, w(T.FFN_POST_NORM, i), a.norm_eps) + attended) * w(T.LAYER_OUT_SCALE, i)[0]
        normed = rms(cur, w(T.OUTPUT_NORM), a.norm_eps)
        logits, hidden = w(T.TOKEN_EMBD) @ normed, tensor(file, POST_PROJECTION) @ normed
        out.append(logits)
        token = int(np.argmax(logits))
    return out


class Recording(Assistant):
    """Drafts 3 tokens whatever the controller asks (the engine keeps the first k), and records them."""

    def __init__(self, model, draft):
        super().__init__(model, draft=draft)
        self.proposals = []

    def propose(self, key, tokens, k):
        draft = super().propose(key, tokens, 3)
        self.proposals.append((list(tokens), draft))
        return draft


def test_greedy_equals_plain_decoding_and_drafts_follow_the_reference(models):
    """Three requests in one batch (prompts over several chunks and past the window of 8), drafting at every step:
    the output is plain decoding's, and every draft checked is the reference's greedy chain after the tokens the
    request had kept (rejected drafts' K/V and states dropped)."""
    target, assistant = models
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 290, n).tolist() for n in (5, 30, 70)]
    expected, _ = greedy(target, prompts)
    proposer = Recording(target, assistant)
    got, stats = greedy(target, prompts, Speculation(proposer, max_draft=3, threshold=0.0))
    assert got == expected
    assert stats["proposed"] > 3 * 12 and len(proposer.proposals) > 30, stats
    for tokens, draft in proposer.proposals[::7]:
        assert draft == [int(np.argmax(x)) for x in reference(target, assistant, tokens, 3)], len(tokens)
    assert not proposer.states  # every request's copy is forgotten when it ends


def drafted_logits(target, assistant, tokens, k):
    """The logits of each of k draft steps after ``tokens``, through the proposer's own path: the prompt in two
    chunks (its copy of the target's K/V past the window), then one proposal."""
    proposer = Assistant(target, draft=assistant)
    logits, step = [], proposer.assistant.draft

    def recorded(*args):
        out = step(*args)
        logits.append(np.array(out[0][0]))
        return out

    proposer.assistant.draft = recorded
    kv, middle = target.new_kv(256), len(tokens) // 2
    for start, stop in ((0, middle), (middle, len(tokens) - 1)):
        ids = np.asarray(tokens[start:stop])
        _, hidden = proposer.forward_hidden(Batch([Row(0, start, ids)]), kv)
        proposer.observe(9, start, ids, hidden, 0)
    draft = proposer.propose(9, tokens, k)
    assert draft == [int(np.argmax(x)) for x in logits]
    return np.array(logits)


def test_draft_logits_match_the_reference(models):
    target, assistant = models
    tokens = np.random.default_rng(4).integers(0, 300, 21).tolist()
    want = reference(target, assistant, tokens, 4)
    np.testing.assert_allclose(drafted_logits(target, assistant, tokens, 4), np.array(want), rtol=1e-9, atol=1e-9)


def test_draft_logits_match_llamacpp(tmp_path):
    """llama.cpp's assistant (``draft-mtp`` against the target's context, F16 KV cache), recorded by
    scripts/record_llamacpp_drafters.py on the files references/tiny_drafters.py builds: the same greedy draft at
    every step, and each step's logits, fed llama.cpp's token and hidden state of the step before, within 0.12 (the
    target's own bar against llama.cpp: its F16 cache and GELU table). Measured: 0.084 at most, of logits spread over
    4.8 to 6.6; run freely, each step's difference carries into the next (0.086, 0.14, 0.20, 0.26)."""
    ((name, info),) = build_tiny_drafters(tmp_path).items()
    recorded = json.loads((REFERENCES / "drafters_llamacpp.json").read_text())["drafters"][name]
    assert recorded["sha256"] == info["sha256"], "the tiny files changed: run scripts/record_llamacpp_drafters.py"
    reference_ = np.load(REFERENCES / "drafters_llamacpp.npz")
    tokens, want, states = info["tokens"], reference_[f"{name}/logits"], reference_[f"{name}/hidden"]
    assert reference_[f"{name}/tokens"].tolist() == tokens
    target = leat.load(info["target"], backend="cpu", precision="f64")
    assistant = leat.load(info["assistant"], backend="cpu", precision="f64")
    assert drafted_logits(target, assistant, tokens, info["steps"]).argmax(-1).tolist() == want.argmax(-1).tolist()
    proposer = Assistant(target, draft=assistant)
    ids, kv = np.asarray(tokens[:-1]), target.new_kv(256)
    proposer.observe(9, 0, ids, proposer.forward_hidden(Batch([Row(0, 0, ids)]), kv)[1], 0)
    proposer.propose(9, tokens, 1)  # the request's copy of the target's KV
    state, last = proposer.states[9], len(tokens) - 1
    inputs = zip([tokens[-1], *want.argmax(-1)[:-1]], [reference_[f"{name}/target_hidden"], *states[:-1]])
    for step, (token, hidden) in enumerate(inputs):
        logits, _ = assistant.architecture.draft(
            int(token), np.asarray(hidden, np.float64)[None], last, target.architecture, state.kv, state.last
        )
        assert np.abs(logits[0] - want[step]).max() < 0.12, step


def test_metadata_round_trips(tmp_path):
    assert_metadata_round_trips(Gemma4Assistant, Gemma4Assistant.tiny(), tmp_path, floats=("norm_eps",))


def test_refusals(models, tmp_path):
    target, assistant = models
    with pytest.raises(LeatError, match="needs the assistant model"):
        load_proposer("assistant", target)
    with pytest.raises(LeatError, match="is not an assistant drafter"):
        load_proposer("assistant", target, draft=target)
    with pytest.raises(LeatError, match="drafts for a model that shares its KV with an assistant"):
        load_proposer("assistant", assistant, draft=assistant)
    wide = write_tiny_gguf(Gemma4Assistant, tmp_path / "wide.gguf", params=Gemma4Assistant.tiny(width_out=96))
    with pytest.raises(LeatError, match="embedding_length_out is 96, the target's width 64"):
        load_proposer("assistant", target, draft=str(wide))
    with pytest.raises(LeatError, match="runs no text alone"):
        list(assistant.generate([1, 2], max_tokens=1))
