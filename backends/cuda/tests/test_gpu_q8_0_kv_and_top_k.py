"""The q8_0 KV cache and top_k on the device, against the CPU float64 oracle (poisoned activations, as
test_gpu_ops.py): the cache's bytes equal the oracle's q8_0 cache bit for bit, attention over it (decode,
the one-key-per-lane prefill, splits; latent MLA caches too) follows the oracle, pages copy, read and
write; top_k equals numpy's stable sort; tiny llama models through the engine: kv q8_0 agrees with the
oracle's q8_0 cache in top-1, and sampled requests drawn from top-k candidates equal those drawn from
whole rows.
"""

import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.engine import Engine, GenerationRequest
from leat.errors import LeatError
from leat.model import Model
from leat.modelfile import ModelFile
from leat.testing import relative_error, write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_backend_cpu.backend import CPUBackend

pytestmark = pytest.mark.gpu


def same_bytes(cuda, oracle, kvs, group=0):
    """Every page of the cuda cache (quants, then scales) equals the oracle's q8_0 storage byte for byte."""
    pages = list(range(kvs[0].pages[group]))
    got, want = cuda.read_pages(kvs[0], pages, group), oracle.read_pages(kvs[1], pages, group)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, np.ascontiguousarray(w).reshape(len(pages), -1).view(np.uint8))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 32), (32, 8, 128), (9, 3, 64), (8, 1, 256)])
def test_q8_0_attention_prefill_then_decode(cuda, oracle, window, heads, kv_heads, dim):
    rng = np.random.default_rng(4)
    layouts = [KVLayout(kv_heads, dim, window=window), KVLayout(kv_heads, dim)]
    kvs = [b.allocate_kv(layouts, slots=3, context=80, page_size=16, dtype="q8_0") for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    seqs = {s: [rng.standard_normal((40, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    steps = [[(0, 0, 23), (1, 0, 9)], [(1, 9, 1), (0, 23, 3)], [(0, 26, 1), (1, 10, 1)]]
    for step in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(3))
        for layer in (0, 1):
            want = oracle.attention(q, k, v, kvs[1], layer, batch, 0.3)
            got = cuda.attention(*(cuda.from_host(t) for t in (q, k, v)), kvs[0], layer, batch, 0.3)
            # both caches hold the same quants (k and v reach both as the same float32 values), so only
            # the float32 arithmetic differs; the bound is f16's anyway
            assert relative_error(cuda.to_host(got), want) < 2e-3
    same_bytes(cuda, oracle, kvs)


def test_q8_0_attention_long_context_splits(cuda, oracle):
    """A 700-token prefill (the tensor-core kernel, the q8_0 cache decoded into its f16 tiles), decode steps split
    over the sequence, and a second long chunk."""
    rng = np.random.default_rng(5)
    heads, kv_heads, dim = 8, 2, 64
    kvs = [b.allocate_kv([KVLayout(kv_heads, dim)], slots=1, context=1280, dtype="q8_0") for b in (cuda, oracle)]
    q, k, v = (rng.standard_normal((1203, h, dim)) * 3 for h in (heads, kv_heads, kv_heads))
    for start, n in ((0, 700), (700, 1), (701, 2), (703, 497), (1200, 1), (1201, 2)):
        batch = Batch([Row(0, start, np.zeros(n, int), all_logits=True)])
        args = [t[start : start + n] for t in (q, k, v)]
        want = oracle.attention(*args, kvs[1], 0, batch, 0.125)
        got = cuda.attention(*(cuda.from_host(t) for t in args), kvs[0], 0, batch, 0.125)
        assert relative_error(cuda.to_host(got), want) < 2e-3
    same_bytes(cuda, oracle, kvs)


def test_q8_0_copy_read_and_write_pages(cuda, oracle):
    rng = np.random.default_rng(9)
    layouts = [KVLayout(2, 32), KVLayout(2, 32)]
    kvs = [b.allocate_kv(layouts, slots=2, context=32, pages=6, page_size=16, dtype="q8_0") for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 0, np.array([4, 1]))
    q, k, v = (rng.standard_normal((20, 2, 32)) for _ in range(3))
    prefill = Batch([Row(0, 0, np.zeros(20, int), all_logits=True)])
    for b, kv in zip((cuda, oracle), kvs):
        for layer in (0, 1):
            b.attention(*(cuda.from_host(t) if b is cuda else t for t in (q, k, v)), kv, layer, prefill, 0.25)
        b.copy_page(kv, 4, 2)  # slot 1 shares the first page copy-on-write
        b.set_pages(kv, 1, np.array([2, 5]))
    same_bytes(cuda, oracle, kvs)
    q2, k2, v2 = (rng.standard_normal((1, 2, 32)) for _ in range(3))
    step = Batch([Row(1, 16, np.zeros(1, int))])
    want = oracle.attention(q2, k2, v2, kvs[1], 0, step, 0.25)
    got = cuda.attention(*(cuda.from_host(t) for t in (q2, k2, v2)), kvs[0], 0, step, 0.25)
    assert relative_error(cuda.to_host(got), want) < 1e-5

    # read out (a hibernated session: quants and scales of both layers) and written back elsewhere
    kv = kvs[0]
    contents = cuda.read_pages(kv, [4, 1])
    assert [c.shape for c in contents] == [(2, 16 * 2 * 32)] * 4 + [(2, 16 * 2 * 32 // 16)] * 4
    step = Batch([Row(0, 19, np.zeros(1, int))])
    before = cuda.to_host(cuda.attention(*(cuda.from_host(t[19:20]) for t in (q, k, v)), kv, 1, step, 0.25))
    cuda.write_pages(kv, [3, 0], contents)
    cuda.set_pages(kv, 1, np.array([3, 0]))
    again = Batch([Row(1, 19, np.zeros(1, int))])
    after = cuda.to_host(cuda.attention(*(cuda.from_host(t[19:20]) for t in (q, k, v)), kv, 1, again, 0.25))
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_q8_0_refuses_what_it_cannot_store(cuda):
    with pytest.raises(LeatError, match="multiples of 32"):
        cuda.allocate_kv([KVLayout(2, 16)], slots=1, context=16, dtype="q8_0")
    with pytest.raises(LeatError, match="multiples of 32"):
        cuda.allocate_kv([KVLayout(1, 72, 64, latent=True)], slots=1, context=16, dtype="q8_0")


@pytest.mark.parametrize("heads,rank,rope", [(4, 56, 8), (16, 512, 64)])
def test_q8_0_mla_attention(cuda, oracle, heads, rank, rope):
    """A q8_0 latent cache ([latent, k_rope] quantized together in blocks of 32): the oracle's bytes, and
    latent attention over it, through a prefill, a long chunk (splits) and decode steps."""
    rng = np.random.default_rng(heads)
    layouts = [KVLayout(1, rank + rope, rank, latent=True), KVLayout(1, rank + rope, rank, window=5, latent=True)]
    kvs = [b.allocate_kv(layouts, slots=2, context=400, page_size=16, dtype="q8_0") for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    shapes = ((300, heads, rank), (300, heads, rope), (300, rank), (300, rope))
    seqs = {s: [rng.standard_normal(shape) for shape in shapes] for s in (0, 1)}
    steps = [[(0, 0, 23), (1, 0, 9)], [(1, 9, 200), (0, 23, 1)], [(0, 24, 1), (1, 209, 1)]]
    for step in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        args = [np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(4)]
        for layer in (0, 1):
            want = oracle.mla_attention(*args, kvs[1], layer, batch, 0.1)
            got = cuda.mla_attention(*(cuda.from_host(a) for a in args), kvs[0], layer, batch, 0.1)
            assert relative_error(cuda.to_host(got), want) < 2e-3
    same_bytes(cuda, oracle, kvs)


def test_top_k_equals_a_stable_sort(cuda):
    """Vocabulary-wide rows with ties (the lower index first), -inf rows and entries, +inf, k from 1 to 64."""
    rng = np.random.default_rng(13)
    x = (rng.integers(-300, 300, (6, 128256)) / 8).astype(np.float32)  # many equal values
    x[1] = -np.inf
    x[2, : 128256 - 5] = -np.inf  # 5 finite entries: k > 5 takes -inf ones, by index
    x[3, [7, 90000, 128255]] = 99.0
    x[4, 5000] = np.inf
    x[5] = rng.standard_normal(128256).astype(np.float32)
    for k in (1, 2, 8, 9, 40, 64):
        values, ids = cuda.top_k(cuda.from_host(x), k)
        order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, order)
        np.testing.assert_array_equal(values, np.take_along_axis(x, order, -1))
        assert ids.dtype == np.int64 and values.dtype == np.float32
    small = rng.standard_normal((3, 33)).astype(np.float32)
    values, ids = cuda.top_k(cuda.from_host(small), 64)  # k past the row: the whole row, sorted
    np.testing.assert_array_equal(ids, np.argsort(-small, axis=-1, kind="stable"))


@pytest.fixture(scope="module")
def tiny_q8_0(tmp_path_factory):
    """A tiny Q8_0 llama whose head dimension (32) a q8_0 cache can hold."""
    import gguf

    path = tmp_path_factory.mktemp("q8kv") / "hd32.gguf"
    params = Llama.tiny(head_dim=32, context=512)
    return write_tiny_gguf(Llama, path, gguf.GGMLQuantizationType.Q8_0, params=params, seed=3)


def served(path, backend):
    file = ModelFile(path)
    return Model(file, Llama(file, backend), backend)


def collect(engine, requests):
    handles = [engine.submit(r) for r in requests]
    engine.start()
    try:
        out = []
        for handle in handles:
            events = list(handle)
            assert events[-1].kind == "done", events[-1]
            out.append([t for e in events for t in e.ids])
        return out
    finally:
        engine.stop()


def test_engine_with_q8_0_kv_agrees_with_the_oracle(cuda, tiny_q8_0):
    """Greedy generation through the engine (kv q8_0: prefill chunks, graph-replayed batched decode); at
    each generated position the oracle (float64, its own q8_0 cache), run over the same tokens, picks
    the same top-1 at least 99% of the time."""
    model = served(tiny_q8_0, cuda)
    prompts = [np.random.default_rng(s).integers(0, 290, n).tolist() for s, n in ((1, 30), (2, 7), (3, 45), (4, 12))]
    engine = Engine(model, batch_size=4, max_context=256, kv="q8_0", prefill_chunk=16)
    outputs = collect(engine, [GenerationRequest(p, 50, {"temperature": 0}, ignore_eos=True) for p in prompts])
    oracle = Llama(ModelFile(tiny_q8_0), CPUBackend("f64"))
    agree = total = 0
    for p, out in zip(prompts, outputs):
        assert len(out) == 50
        tokens = np.array(p + out)
        kv = oracle.backend.allocate_kv(Llama.kv_layouts(oracle.params), 1, len(tokens), dtype="q8_0")
        logits = oracle.forward(Batch([Row(0, 0, tokens, all_logits=True)]), kv)
        picks = np.argmax(logits[len(p) - 1 : -1], axis=-1)
        agree += int((picks == np.array(out)).sum())
        total += len(out)
    assert agree >= 0.99 * total, f"top-1 agreement {agree}/{total}"
    assert not cuda.graph_failures


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_engine_candidates_equal_whole_rows(cuda, tiny_q8_0, kv, monkeypatch):
    """Sampled requests (default settings: top_k 40; top_k 64 with top_p; greedy beside them) draw the same
    tokens from the device's top-k candidates as from whole logit rows, with the same seeds."""
    model = served(tiny_q8_0, cuda)
    settings = [{}, {"top_k": 64, "top_p": 0.9, "min_p": 0.0, "temperature": 1.5}, {"temperature": 0}]
    requests = [
        GenerationRequest(
            np.random.default_rng(s).integers(0, 290, 20).tolist(), 32, settings[s % 3] | {"seed": s}, ignore_eos=True
        )
        for s in range(6)
    ]
    calls = []
    real_top_k = cuda.top_k
    monkeypatch.setattr(cuda, "top_k", lambda x, k: calls.append(k) or real_top_k(x, k))
    outputs = []
    for candidates in (True, False):
        engine = Engine(model, batch_size=6, max_context=128, kv=kv, top_k_candidates=candidates)
        outputs.append(collect(engine, requests))
        assert bool(calls) == candidates and all(40 <= k <= 64 for k in calls), calls
        calls.clear()
    assert outputs[0] == outputs[1]
