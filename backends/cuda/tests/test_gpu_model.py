"""Tiny llama models on the CUDA backend against the CPU float64 oracle: logits agree (top-1 >= 99%,
mean KL < 1e-3), greedy continuations match for 64 tokens, batched decode equals unbatched, and a
replayed graph equals the eager step."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare, first_near_tie, top2_gap
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_backend_cpu.backend import CPUBackend

pytestmark = pytest.mark.gpu
TINY_MODELS = Path(__file__).parents[3] / "tests" / "references" / "tiny_models.py"
CONFIGS = [
    "f32",
    "f32-gqa4-llama3",
    "f16",
    "q8_0",
    "q8_0-untied-odd-heads",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q6_k",
    "q5_k",
    "q4_k-llama3",
]


def _tiny_models():
    spec = importlib.util.spec_from_file_location("tiny_models", TINY_MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    if not TINY_MODELS.exists():
        import gguf

        return {
            "f32": write_tiny_gguf(Llama, folder / "f32.gguf"),
            "q8_0": write_tiny_gguf(Llama, folder / "q8_0.gguf", gguf.GGMLQuantizationType.Q8_0),
        }
    tiny = _tiny_models()
    return {name: tiny.build(name, folder / f"{name}.gguf") for name in CONFIGS}


def load(path, backend):
    return Llama(ModelFile(path), backend)


def prompt(model, n, seed=0):
    return np.random.default_rng(seed).integers(0, model.params.vocab, n)


def prefill_logits(model, tokens, kv_dtype="f32"):
    kv = model.backend.allocate_kv(Llama.kv_layouts(model.params), 1, len(tokens), dtype=kv_dtype)
    logits = model.forward(Batch([Row(0, 0, tokens, all_logits=True)]), kv)
    return model.backend.to_host(logits) if not isinstance(logits, np.ndarray) else logits


def decode_logits(model, tokens, kv_dtype="f32"):
    """Logits of every position, one decode step at a time (through the backend's graph replay)."""
    backend = model.backend
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), 1, len(tokens), dtype=kv_dtype)
    out = []
    for position, token in enumerate(tokens):
        logits = backend.run(model.forward, Batch([Row(0, position, np.array([token]))]), kv)
        out.append(backend.to_host(logits)[0])
    return np.stack(out)


def agreement_failures(oracle_logits, logits, label):
    result = compare(oracle_logits, logits, label=label)
    return result, result.failures(top1=0.99, kl=1e-3)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_logits_agree_with_the_oracle(files, cuda, name, kv_dtype):
    if name not in files:
        pytest.skip(f"{TINY_MODELS} not found")
    oracle = load(files[name], CPUBackend("f64"))
    model = load(files[name], cuda)
    tokens = prompt(model, 200)  # 200 positions: one top-1 difference is half a percent
    want = prefill_logits(oracle, tokens)
    result, failures = agreement_failures(want, prefill_logits(model, tokens, kv_dtype), f"{name} prefill")
    assert not failures, str(result)
    result, failures = agreement_failures(want, decode_logits(model, tokens, kv_dtype), f"{name} decode")
    assert not failures, str(result)
    assert not cuda.graph_failures


def greedy(model, tokens, steps, run):
    kv = model.backend.allocate_kv(Llama.kv_layouts(model.params), 1, len(tokens) + steps)
    logits = model.forward(Batch([Row(0, 0, tokens)]), kv)
    out, gaps = [], []
    for step in range(steps):
        row = np.asarray(model.backend.to_host(logits), np.float64)[-1]
        out.append(int(np.argmax(row)))
        gaps.append(float(top2_gap(row[None])[0]))
        batch = Batch([Row(0, len(tokens) + step, np.array([out[-1]]))])
        logits = run(model, batch, kv)
    return out, gaps


@pytest.mark.parametrize("name", ["f32", "q8_0", "q4_1", "q4_k-llama3", "q6_k"])
def test_greedy_continuation_matches_the_oracle(files, cuda, name):
    if name not in files:
        pytest.skip(f"{TINY_MODELS} not found")
    oracle = load(files[name], CPUBackend("f64"))
    model = load(files[name], cuda)
    tokens = prompt(model, 12, seed=1)
    want, gaps = greedy(oracle, tokens, 64, lambda m, b, kv: m.forward(b, kv))
    got, _ = greedy(model, tokens, 64, lambda m, b, kv: m.backend.run(m.forward, b, kv))
    tie = first_near_tie(gaps)
    upto = 64 if tie is None else tie + 1  # the step whose choice is a near tie may go either way
    assert got[:upto] == want[:upto], f"first difference at {next(i for i in range(upto) if got[i] != want[i])}"


def test_batched_decode_equals_unbatched_and_graphs_equal_eager(files, cuda):
    model = load(files["q8_0"], cuda)
    layouts = Llama.kv_layouts(model.params)
    prompts = [prompt(model, n, seed=n) for n in (5, 17, 9)]
    together = cuda.allocate_kv(layouts, 3, 64)
    alone = [cuda.allocate_kv(layouts, 1, 64) for _ in prompts]
    for s, (p, kv) in enumerate(zip(prompts, alone)):  # the same prefill kernels for both caches
        model.forward(Batch([Row(s, 0, p)]), together)
        model.forward(Batch([Row(0, 0, p)]), kv)
    tokens = [int(p[-1]) for p in prompts]
    for step in range(10):
        batch = Batch([Row(s, len(p) + step, np.array([t])) for s, (p, t) in enumerate(zip(prompts, tokens))])
        batched = cuda.to_host(cuda.run(model.forward, batch, together))
        for s, (p, kv) in enumerate(zip(prompts, alone)):
            single = Batch([Row(0, len(p) + step, np.array([tokens[s]]))])
            if step == 3:  # the same step eagerly, on a scratch copy of the cache state: equal bit for bit
                eager = cuda.to_host(model.forward(single, kv))
                replay = cuda.to_host(cuda.run(model.forward, single, kv))
                np.testing.assert_array_equal(eager, replay)
                row = replay[0]
            else:
                row = cuda.to_host(cuda.run(model.forward, single, kv))[0]
            # three rows go through the unfused kernels, one row through the fused ones: equal up to
            # where x's int16 rounding falls (see test_fused_decode_equals_unfused)
            np.testing.assert_allclose(batched[s], row, rtol=0, atol=5e-3)
        tokens = [int(np.argmax(r)) for r in batched]
    assert not cuda.graph_failures


@pytest.mark.parametrize("name", ["q4_k-llama3", "q8_0-untied-odd-heads"])
def test_fused_decode_equals_unfused(files, name):
    """Norms applied inside the products, residual adds and the gated unit fused into them: the same
    logits as one op per kernel, up to where x's int16 rounding falls (a norm summed in another order
    can move a value across a rounding boundary)."""
    from leat_backend_cuda.backend import CUDABackend

    logits = []
    for fuse in (True, False):
        model = load(files[name], CUDABackend(fuse=fuse, poison=True))
        logits.append(decode_logits(model, prompt(model, 24, seed=3)))
    result = compare(logits[1], logits[0], label=f"{name} fused vs unfused")
    assert not result.failures(top1=0.99, kl=1e-5), str(result)
    assert result.max_abs_logit_diff < 5e-3, str(result)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
@pytest.mark.parametrize("v_type", ["Q8_0", "Q4_0"])
def test_rope_epilogue_equals_rope_kv_write(tmp_path, kv_dtype, v_type, split):
    """One token a step, graph-replayed: q, k and v with RoPE and the cache write in gemv_q's epilogue (GEMV_Q_ROPE;
    v in a launch of its own where its type differs from q's and k's, as Q4_K_M's Q6_K v does) give the logits and
    the cache that the products followed by rope_kv_write give, bit for bit; also with the small products split over
    K (``split``: LEAT_CUDA_GEMV_SPLIT=1)."""
    import gguf
    from leat_backend_cuda.backend import CUDABackend

    q = gguf.GGMLQuantizationType
    layers = Llama.tiny().layers
    types = {f"blk.{i}.attn_v.weight": q[v_type] for i in range(layers)}
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", q.Q8_0, seed=21, types=types)
    results, taken = [], []
    for fused in (True, False):
        backend = CUDABackend(poison=True)
        backend.gemv_split = split
        backend._write_kv_fused = _recorded(backend._write_kv_fused, taken) if fused else lambda *args: None
        model = load(path, backend)
        tokens = prompt(model, 10, seed=4)
        kv = backend.allocate_kv(Llama.kv_layouts(model.params), 1, 16, dtype=kv_dtype)
        steps = [Batch([Row(0, i, tokens[i : i + 1])]) for i in range(len(tokens))]
        logits = np.stack([backend.to_host(backend.run(model.forward, step, kv))[0] for step in steps])
        caches = [_bytes(backend, c) for layer in range(layers) for c in (kv.k[layer], kv.v[layer])]
        results.append((logits, caches))
    assert len(taken) >= layers and all(t is not None for t in taken)  # the epilogue ran, every layer
    np.testing.assert_array_equal(results[0][0], results[1][0])
    for fused_cache, plain_cache in zip(results[0][1], results[1][1], strict=True):
        assert fused_cache.any()  # written: the cache starts as zeros
        np.testing.assert_array_equal(fused_cache, plain_cache)


def _bytes(backend, memory) -> np.ndarray:
    """A device allocation's bytes (a KV plane: Memory, no shape or dtype of its own)."""
    out = np.empty(memory.nbytes, np.uint8)
    backend.device.download(out, memory.ptr)
    return out


def _recorded(method, results: list):
    """``method``, with each of its results appended to ``results``."""

    def call(*args):
        results.append(method(*args))
        return results[-1]

    return call


def test_steps_with_prefill_chunks_replay_a_graph_and_equal_eager(files, cuda):
    """A step that carries prompt chunks beside decode rows runs as a captured graph (every token a row of its
    own, the asked-for logits picked inside): its logits and the cache it leaves equal the eager step's."""
    model = load(files["q8_0"], cuda)
    layouts = Llama.kv_layouts(model.params)
    first, second = prompt(model, 20, seed=5), prompt(model, 90, seed=6)
    caches = [cuda.allocate_kv(layouts, 3, 256, dtype=dtype) for dtype in ("f16", "f16")]
    for kv in caches:
        model.forward(Batch([Row(0, 0, first)]), kv)
    step = Batch([Row(0, 20, np.array([7])), Row(2, 0, second[:60]), Row(1, 0, second[:30])])
    replay = cuda.to_host(cuda.run(model.forward, step, caches[0]))
    eager = cuda.to_host(model.forward(step, caches[1]))
    assert replay.shape == eager.shape == (3, model.params.vocab)
    assert not cuda.graph_failures and any(key[2:] == (96, 3) for key in cuda._captured)
    np.testing.assert_allclose(replay, eager, rtol=0, atol=5e-3)
    # the next step reads what the graph wrote: a continuation of the chunk agrees too
    after = Batch([Row(2, 60, second[60:]), Row(0, 21, np.array([3]))])
    np.testing.assert_allclose(
        cuda.to_host(model.forward(after, caches[0])), cuda.to_host(model.forward(after, caches[1])), rtol=0, atol=5e-3
    )


def test_steps_past_the_per_token_buckets_replay_a_graph_with_tiled_attention_and_equal_eager(tmp_path, cuda):
    """A step of more than TILED_GRAPH_TOKENS tokens (a decode row beside a prompt's chunk) runs as a captured graph
    whose flash attention takes the tiles flash_tiles made on the device: its logits and the cache it leaves agree
    with the eager step's (flash attention over the host's tiles), then a deep chunk's step replays it and agrees too
    (no attention budget past TILED_GRAPH_TOKENS)."""
    import gguf
    from leat_backend_cuda.backend import TILED_GRAPH_TOKENS

    params = Llama.tiny(head_dim=64, width=256, context=2048)
    path = write_tiny_gguf(Llama, tmp_path / "hd64.gguf", gguf.GGMLQuantizationType.Q8_0, params=params)
    model = load(path, cuda)
    layouts = Llama.kv_layouts(model.params)
    caches = [cuda.allocate_kv(layouts, 3, 2048, dtype="f16") for _ in range(2)]
    first, long = prompt(model, 20, seed=5), prompt(model, 1200, seed=6)
    for kv in caches:
        model.forward(Batch([Row(0, 0, first)]), kv)
    n = TILED_GRAPH_TOKENS + 40
    for step in (
        Batch([Row(0, 20, np.array([7])), Row(2, 0, long[:n])]),
        Batch([Row(2, n, long[n : 2 * n]), Row(0, 21, np.array([3]))]),
        Batch([Row(2, 2 * n, long[2 * n : 3 * n])]),
    ):
        replay = cuda.to_host(cuda.run(model.forward, step, caches[0]))
        eager = cuda.to_host(model.forward(step, caches[1]))
        assert replay.shape == eager.shape == (len(step.rows), model.params.vocab)
        np.testing.assert_allclose(replay, eager, rtol=0, atol=5e-3)
    assert not cuda.graph_failures and any(key[2] == 384 for key in cuda._captured)
    np.testing.assert_allclose(
        _bytes(cuda, caches[0].k[0]).view(np.float16), _bytes(cuda, caches[1].k[0]).view(np.float16), rtol=0, atol=2e-3
    )


def test_speculative_rows_replay_a_graph_and_equal_eager(files, cuda):
    """Rows that want every token's logits (a token and its draft) run as a captured graph, each token a
    row of its own: the logits equal the eager step's, and the engine's greedy speculative output equals
    plain decoding."""
    from leat.engine import Engine, GenerationRequest
    from leat.model import Model
    from leat.speculative import Speculation, load_proposer

    model = load(files["q8_0"], cuda)
    layouts = Llama.kv_layouts(model.params)
    p = prompt(model, 20, seed=3)
    kv_graph, kv_eager = cuda.allocate_kv(layouts, 2, 64), cuda.allocate_kv(layouts, 2, 64)
    for kv in (kv_graph, kv_eager):
        model.forward(Batch([Row(1, 0, p)]), kv)
    # slot 1 verifies a draft of 3 at position 20, slot 0 is empty padding-free decode of one token
    step = Batch([Row(1, 20, np.array([5, 9, 9, 2]), all_logits=True)])
    replay = cuda.to_host(cuda.run(model.forward, step, kv_graph))
    eager = cuda.to_host(model.forward(step, kv_eager))
    assert replay.shape == eager.shape == (4, model.params.vocab)
    np.testing.assert_allclose(replay, eager, rtol=0, atol=5e-3)
    assert any(key[0] == model.forward for key in cuda._captured) and not cuda.graph_failures

    file = ModelFile(files["q8_0"])
    served = Model(file, Llama(file, cuda), cuda)
    text = np.tile(prompt(model, 12, seed=4), 4).tolist()  # a repetitive prompt: the n-gram proposer drafts
    outputs = []
    for speculation in (None, Speculation(load_proposer("ngram", served))):
        served.speculation = speculation
        engine = Engine(served, batch_size=2, max_context=160, speculation=speculation).start()
        handles = [engine.submit(GenerationRequest(text, 48, {"temperature": 0})) for _ in range(2)]
        outputs.append([[t for e in h for t in e.ids] for h in handles])
        stats = engine.stats()
        engine.stop()
    assert outputs[0] == outputs[1]
    assert stats["speculation"]["verifications"] > 0, stats
    assert not cuda.graph_failures


def test_pipelined_decode_steps_equal_plain_ones(files, cuda):
    """The engine queues a decode step before the last one's tokens reach the host, its tokens gathered on the
    device from the last step's argmax: greedy outputs equal the engine's without pipelining, also when requests
    end at different steps and new ones join."""
    from leat.engine import Engine, GenerationRequest
    from leat.model import Model

    file = ModelFile(files["q8_0"])
    served = Model(file, Llama(file, cuda), cuda)
    prompts = [prompt(served.architecture, n, seed=n).tolist() for n in (5, 17, 30, 9, 12, 3)]
    lengths = [40, 12, 25, 33, 7, 50]
    outputs, ahead = [], []
    for pipeline in (False, True):
        engine = Engine(served, batch_size=4, max_context=160, kv="f16", pipeline=pipeline).start()
        handles = [engine.submit(GenerationRequest(p, n, {"temperature": 0})) for p, n in zip(prompts, lengths)]
        outputs.append([[t for e in h for t in e.ids] for h in handles])
        ahead.append(engine.steps_ahead)
        engine.stop()
    assert outputs[0] == outputs[1] and all(outputs[0])
    assert ahead[0] == 0 and ahead[1] > 20, ahead
    assert not cuda.graph_failures
