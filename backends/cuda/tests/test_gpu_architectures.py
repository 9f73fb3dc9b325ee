"""Tiny qwen3moe, gpt-oss (F32 and MXFP4 experts), deepseek2, gemma2/gemma3, phi3 and glm4moe models on the CUDA backend
against the CPU float64 oracle: logits agree (top-1 >= 99%, mean KL < 1e-3) in prefill and in
graph-replayed decode, and greedy 64-token continuations equal the oracle's (up to a near tie)."""

import gguf
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare, first_near_tie, top2_gap
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
from leat_backend_cpu.backend import CPUBackend

pytestmark = pytest.mark.gpu
Q = gguf.GGMLQuantizationType


def _classes():
    qwen = pytest.importorskip("leat_arch_qwen3.qwen")
    gpt_oss = pytest.importorskip("leat_arch_gpt_oss.gpt_oss")
    deepseek = pytest.importorskip("leat_arch_deepseek2.deepseek2")
    gemma = pytest.importorskip("leat_arch_gemma.gemma")
    phi3 = pytest.importorskip("leat_arch_phi3.phi3")
    glm4moe = pytest.importorskip("leat_arch_glm4moe.glm4moe")
    return qwen, gpt_oss, deepseek, gemma, phi3, glm4moe


#: name -> (module attribute path, tiny overrides, file type, expert type); the architectures' own tiny variants
CONFIGS = {
    "qwen3moe-f32": ("qwen.Qwen3Moe", {}, Q.F32, None),
    "qwen3moe-top3-q8_0": ("qwen.Qwen3Moe", {"experts_used": 3}, Q.Q8_0, None),
    "gpt-oss-f32": ("gpt_oss.GptOss", {"window": 5}, Q.F32, None),
    "gpt-oss-mxfp4": ("gpt_oss.GptOss", {"window": 5}, Q.F32, Q.MXFP4),
    "gpt-oss-odd-heads-top3-q8_0": (
        "gpt_oss.GptOss",
        {"layers": 3, "heads": 3, "kv_heads": 1, "window": 3, "experts": 6, "experts_used": 3},
        Q.Q8_0,
        Q.MXFP4,
    ),
    "deepseek2-v2-f32": ("deepseek.DeepSeek2", {}, Q.F32, None),
    "deepseek2-lite-kv-b-q8_0": ("deepseek.DeepSeek2", {"q_rank": 0, "split_kv_b": False, "heads": 3}, Q.Q8_0, None),
    "deepseek2-v3-yarn-f32": (
        "deepseek.DeepSeek2",
        {
            "gating": "sigmoid",
            "selection_bias": True,
            "groups": 4,
            "groups_used": 2,
            "weights_norm": True,
            "weights_scale": 2.5,
            "rope_scaling": "yarn",
            "rope_factor": 4.0,
            "yarn_context": 16,
            "yarn_log_mul": 0.0707,
        },
        Q.F32,
        None,
    ),
    "gemma2-f32": ("gemma.Gemma2", {"window": 5, "attn_softcap": 2.0, "final_softcap": 5.0}, Q.F32, None),
    "gemma2-q8_0": ("gemma.Gemma2", {"window": 5}, Q.Q8_0, None),
    "gemma3-f32": ("gemma.Gemma3", {"window": 5, "pattern": 2, "tied": False}, Q.F32, None),
    "gemma3-q4_0": ("gemma.Gemma3", {"window": 5, "pattern": 2}, Q.Q4_0, None),
    "phi3-f32": ("phi3.Phi3", {}, Q.F32, None),
    "phi3-q8_0": ("phi3.Phi3", {}, Q.Q8_0, None),
    "glm4moe-f32": ("glm4moe.Glm4Moe", {}, Q.F32, None),
    "glm4moe-q8_0": ("glm4moe.Glm4Moe", {}, Q.Q8_0, None),
}


def architecture(name):
    modules = dict(zip(("qwen", "gpt_oss", "deepseek", "gemma", "phi3", "glm4moe"), _classes()))
    where, overrides, qtype, experts = CONFIGS[name]
    module, cls = where.split(".")
    return getattr(modules[module], cls), overrides, qtype, experts


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-architectures")
    made = {}

    def build(name):
        if name not in made:
            cls, overrides, qtype, experts = architecture(name)
            params = cls.tiny(**overrides)
            types = {n: experts for n in cls.tensor_shapes(params) if n.endswith("_exps.weight")} if experts else None
            made[name] = write_tiny_gguf(cls, folder / f"{name}.gguf", qtype, params=params, types=types)
        return made[name]

    return build


def load(name, path, backend):
    cls = architecture(name)[0]
    return cls(ModelFile(path), backend)


def prompt(model, n, seed=0):
    return np.random.default_rng(seed).integers(0, model.vocab_size, n)


def allocate(model, context, kv_dtype="f32"):
    return model.backend.allocate_kv(model.kv_layouts(model.params), 1, context, dtype=kv_dtype)


def prefill_logits(model, tokens, kv_dtype="f32"):
    logits = model.forward(Batch([Row(0, 0, tokens, all_logits=True)]), allocate(model, len(tokens), kv_dtype))
    return np.asarray(model.backend.to_host(logits), np.float64)


def decode_logits(model, tokens, kv_dtype="f32"):
    """Logits of every position, one decode step at a time (through the backend's graph replay)."""
    backend, kv, out = model.backend, allocate(model, len(tokens), kv_dtype), []
    for position, token in enumerate(tokens):
        logits = backend.run(model.forward, Batch([Row(0, position, np.array([token]))]), kv)
        out.append(backend.to_host(logits)[0])
    return np.stack(out)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_logits_agree_with_the_oracle(files, cuda, name, kv_dtype):
    path = files(name)
    oracle, model = load(name, path, CPUBackend("f64")), load(name, path, cuda)
    tokens = prompt(model, 200)  # 200 positions: one top-1 difference is half a percent
    want = prefill_logits(oracle, tokens)
    result = compare(want, prefill_logits(model, tokens, kv_dtype), label=f"{name} prefill")
    assert not result.failures(top1=0.99, kl=1e-3), str(result)
    result = compare(want, decode_logits(model, tokens, kv_dtype), label=f"{name} decode")
    assert not result.failures(top1=0.99, kl=1e-3), str(result)
    assert not cuda.graph_failures


def greedy(model, tokens, steps, run):
    kv = allocate(model, len(tokens) + steps)
    logits = model.forward(Batch([Row(0, 0, tokens)]), kv)
    out, gaps = [], []
    for step in range(steps):
        row = np.asarray(model.backend.to_host(logits), np.float64)[-1]
        out.append(int(np.argmax(row)))
        gaps.append(float(top2_gap(row[None])[0]))
        logits = run(model, Batch([Row(0, len(tokens) + step, np.array([out[-1]]))]), kv)
    return out, gaps


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_continuation_matches_the_oracle(files, cuda, name):
    path = files(name)
    oracle, model = load(name, path, CPUBackend("f64")), load(name, path, cuda)
    tokens = prompt(model, 12, seed=1)
    want, gaps = greedy(oracle, tokens, 64, lambda m, b, kv: m.forward(b, kv))
    got, _ = greedy(model, tokens, 64, lambda m, b, kv: m.backend.run(m.forward, b, kv))
    tie = first_near_tie(gaps)
    upto = 64 if tie is None else tie + 1  # the step whose choice is a near tie may go either way
    assert got[:upto] == want[:upto], f"first difference at {next(i for i in range(upto) if got[i] != want[i])}"
    assert not cuda.graph_failures


@pytest.mark.parametrize("name", ["qwen3moe-top3-q8_0", "gpt-oss-mxfp4", "deepseek2-v3-yarn-f32"])
def test_batched_decode_equals_unbatched(files, cuda, name):
    """Three sequences decoded together (one graph) equal each decoded alone: routing is per token."""
    model = load(name, files(name), cuda)
    layouts = model.kv_layouts(model.params)
    prompts = [prompt(model, n, seed=n) for n in (5, 17, 9)]
    together = cuda.allocate_kv(layouts, 3, 64)
    alone = [cuda.allocate_kv(layouts, 1, 64) for _ in prompts]
    for s, (p, kv) in enumerate(zip(prompts, alone)):
        model.forward(Batch([Row(s, 0, p)]), together)
        model.forward(Batch([Row(0, 0, p)]), kv)
    tokens = [int(p[-1]) for p in prompts]
    for step in range(6):
        batch = Batch([Row(s, len(p) + step, np.array([t])) for s, (p, t) in enumerate(zip(prompts, tokens))])
        batched = cuda.to_host(cuda.run(model.forward, batch, together))
        for s, (p, kv) in enumerate(zip(prompts, alone)):
            row = cuda.to_host(cuda.run(model.forward, Batch([Row(0, len(p) + step, np.array([tokens[s]]))]), kv))[0]
            # one row goes through the fused int16-activation kernels, three rows through the others
            np.testing.assert_allclose(batched[s], row, rtol=0, atol=5e-3)
        tokens = [int(np.argmax(r)) for r in batched]
    assert not cuda.graph_failures
