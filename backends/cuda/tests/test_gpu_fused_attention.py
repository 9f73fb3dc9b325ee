"""RoPE, the KV write and attention in one or two launches (rope_attention for decode rows, rope_kv_write then
attention otherwise), and attention's splits merged in its own launch, against the same ops launched one by one
(``rope_fusion`` and ``combine_fusion`` off) and the float64 oracle: every KV type, grouped and odd head counts,
partial rotary dims, windows, sinks, soft-caps, contexts across page boundaries and from one split to several."""

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.modelfile import ModelFile, Tensor
from leat.testing import relative_error, write_tiny_gguf
from leat_arch_llama.llama import Llama

pytestmark = pytest.mark.gpu
# against the oracle, as test_gpu_ops.py's attention tests (f16: its flash test's, the prefills' kernel here)
TOLERANCE = {"f32": 1e-5, "f16": 3e-3, "q8_0": 2e-3}


class Launches:
    """``cuda.ops`` that records the names of the kernels taken from it."""

    def __init__(self, module):
        self.module, self.names = module, []

    def __getitem__(self, name):
        self.names.append(name.split("<")[0])
        return self.module[name]


def attend(backend, q, k, v, kv, batch, spec, softcap=None, sinks=None):
    positions = batch.positions
    scale = q.shape[-1] ** -0.5
    out = backend.attention(
        backend.rope(q, positions, spec), backend.rope(k, positions, spec), v, kv, 0, batch, scale, softcap, sinks
    )
    return backend.to_host(out)


def fused_and_one_by_one(cuda, monkeypatch, args, kvs, batch, spec, softcap, sinks):
    """attention through the fused kernels (and the kernels they launched), then through one op per kernel."""
    launches = Launches(cuda.ops)
    with monkeypatch.context() as m:
        m.setattr(cuda, "ops", launches)
        m.setattr(cuda, "rope_fusion", True)
        m.setattr(cuda, "combine_fusion", True)
        fused = attend(cuda, *args, kvs[0], batch, spec, softcap, sinks)
    with monkeypatch.context() as m:
        m.setattr(cuda, "rope_fusion", False)
        m.setattr(cuda, "combine_fusion", False)
        plain = attend(cuda, *args, kvs[1], batch, spec, softcap, sinks)
    return fused, plain, launches.names


# (heads, kv_heads, head dim, rotary dims, neox): grouped 4 to 1 (one head chunk), odd groups of 3, one KV head
# of 256 dims, heads of their own (MHA, 5 chunks)
SHAPES = [(32, 8, 128, 128, False), (9, 3, 64, 32, True), (8, 1, 256, 256, True), (5, 5, 64, 64, False)]
# (window, softcap, sinks)
VARIANTS = [(None, None, False), (37, None, False), (None, 20.0, True)]


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("heads,kv_heads,dim,dims,neox", SHAPES)
@pytest.mark.parametrize("window,softcap,with_sinks", VARIANTS)
def test_fused_rope_kv_write_and_attention_equal_the_ops_one_by_one(
    cuda, oracle, monkeypatch, kv_dtype, heads, kv_heads, dim, dims, neox, window, softcap, with_sinks
):
    rng = np.random.default_rng(heads * dim + (window or 0))
    layouts = [KVLayout(kv_heads, dim, window=window)]
    backends = (cuda, cuda, oracle)
    kvs = [b.allocate_kv(layouts, slots=3, context=200, page_size=16, dtype=kv_dtype) for b in backends]
    for b, kv in zip(backends, kvs):  # slot 1's pages in reverse: page tables need not be in order
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    spec = RopeSpec(dims, 10000.0, neox, 1.0, np.linspace(1, 4, dims // 2), attn_factor=0.9)
    sinks = (None, None)
    if with_sinks:
        values = np.linspace(-6, 4, heads).astype(np.float32)
        sinks = (cuda.upload(Tensor("sinks", gguf.GGMLQuantizationType.F32, (heads,), values)), values)
    seqs = {s: [rng.standard_normal((170, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    # (rows as (slot, start, tokens), the kernels the fused path launches): prefills (more than 8 tokens: the
    # wide kernel or flash; fewer: attention), decode rows of distinct slots, at the start of a page and across
    # the one-split threshold (64 positions), a speculative row (two tokens of one slot) across a page boundary
    flash = kv_dtype == "f16" and dim in (64, 128) and not with_sinks  # flash.cu's kernel: not from cuda.ops
    steps = [
        ([(0, 0, 158)], ["rope_kv_write"] + ([] if flash else ["attention_wide"])),
        ([(1, 0, 7)], ["rope_kv_write", "attention"]),
        ([(0, 158, 1), (1, 7, 1)], ["rope_attention"]),
        ([(0, 159, 2)], ["rope_kv_write", "attention"]),
        ([(0, 161, 1)], ["rope_attention"]),
        ([(1, 8, 1)], ["rope_attention"]),
        ([(1, 9, 1), (0, 162, 1), (2, 0, 1)], ["rope_attention"]),
    ]
    for rows, kernels in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in rows])
        host = [np.concatenate([seqs[s % 2][i][a : a + n] for s, a, n in rows]) for i in range(3)]
        args = [cuda.from_host(t) for t in host]
        fused, plain, launched = fused_and_one_by_one(cuda, monkeypatch, args, kvs, batch, spec, softcap, sinks[0])
        want = attend(oracle, *host, kvs[2], batch, spec, softcap, sinks[1])
        label = f"{rows}: launched {launched}"
        assert launched == kernels, label  # no rope, kv_write or attention_combine launch
        assert relative_error(fused, plain) < 1e-6, label  # the same arithmetic: equal but for contraction
        assert relative_error(fused, want) < TOLERANCE[kv_dtype], label
    pages = list(range(kvs[0].pages[0]))
    for got, ref in zip(cuda.read_pages(kvs[0], pages), cuda.read_pages(kvs[1], pages), strict=True):
        np.testing.assert_array_equal(got, ref)  # the same bytes in the cache


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_splits_merged_in_the_attention_launch(cuda, oracle, monkeypatch, kv_dtype):
    """Decode at depth 700 (splits of 64 positions and more, merged by the last block of each head chunk) equals
    attention_combine's merge, steps after steps (the counters are left at zero for the next launch)."""
    rng = np.random.default_rng(21)
    heads, kv_heads, dim = 16, 2, 64
    backends = (cuda, cuda, oracle)
    kvs = [b.allocate_kv([KVLayout(kv_heads, dim)], slots=2, context=768, dtype=kv_dtype) for b in backends]
    spec = RopeSpec(dim, 500000.0, True)
    q, k, v = (rng.standard_normal((703, h, dim)) for h in (heads, kv_heads, kv_heads))
    for start, n in ((0, 700), (700, 1), (701, 1), (702, 1)):
        batch = Batch([Row(0, start, np.zeros(n, int), all_logits=True)])
        host = [t[start : start + n] for t in (q, k, v)]
        args = [cuda.from_host(t) for t in host]
        fused, plain, launched = fused_and_one_by_one(cuda, monkeypatch, args, kvs, batch, spec, None, None)
        assert "attention_combine" not in launched
        assert relative_error(fused, plain) < 1e-6
        assert relative_error(fused, attend(oracle, *host, kvs[2], batch, spec)) < TOLERANCE[kv_dtype]


def test_a_rope_read_elsewhere_is_launched(cuda, oracle):
    """A pending rope whose value something else reads (here the host) is the rope kernel's, and attention then
    takes q and k as they are."""
    rng = np.random.default_rng(22)
    spec = RopeSpec(32, 10000.0, False)
    q, k, v = (rng.standard_normal((1, h, 32)) for h in (4, 2, 2))
    batch = Batch([Row(0, 5, np.zeros(1, int))])
    rq = cuda.rope(cuda.from_host(q), batch.positions, spec)
    assert relative_error(cuda.to_host(rq), oracle.rope(q, batch.positions, spec)) < 1e-6
    kvs = [b.allocate_kv([KVLayout(2, 32)], slots=1, context=16, dtype="f32") for b in (cuda, oracle)]
    got = cuda.attention(
        rq, cuda.rope(cuda.from_host(k), batch.positions, spec), cuda.from_host(v), kvs[0], 0, batch, 1
    )
    want = oracle.attention(
        oracle.rope(q, batch.positions, spec), oracle.rope(k, batch.positions, spec), v, kvs[1], 0, batch, 1
    )
    assert relative_error(cuda.to_host(got), want) < 1e-5


def model_steps(model, kv_dtype):
    """Logits of a 70- and a 9-token prompt in two slots, then decode steps of both rows and of one, replayed as
    graphs (the one-token graph captures rope_attention, the two-token one rope_kv_write and attention)."""
    backend = model.backend
    kv = backend.allocate_kv(type(model).kv_layouts(model.params), 2, 128, dtype=kv_dtype)
    tokens = np.random.default_rng(6).integers(0, model.params.vocab, 100)
    out = [backend.to_host(model.forward(Batch([Row(0, 0, tokens[:70]), Row(1, 0, tokens[70:79])]), kv))]
    for step in range(6):
        rows = [Row(0, 70 + step, tokens[80 + step : 81 + step])]
        if step % 2:
            rows.append(Row(1, 9 + step // 2, tokens[90 + step : 91 + step]))
        out.append(backend.to_host(backend.run(model.forward, Batch(rows), kv)))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    """A tiny Qwen3 (each head's q and k RMS-normed before RoPE), head dimension 32."""
    from leat_arch_qwen3.qwen import Qwen3

    path = tmp_path_factory.mktemp("fused-qwen3") / "qwen3.gguf"
    return write_tiny_gguf(Qwen3, path, gguf.GGMLQuantizationType.Q8_0, params=Qwen3.tiny(head_dim=32), seed=7)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
def test_a_model_with_attention_fusion_equals_one_op_per_kernel(
    cuda, monkeypatch, tiny_q8_0, tiny_qwen3, family, kv_dtype
):
    """Llama, and Qwen3 whose q and k norms rope_attention takes in as well."""
    from leat_arch_qwen3.qwen import Qwen3

    model = Llama(ModelFile(tiny_q8_0), cuda) if family == "llama" else Qwen3(ModelFile(tiny_qwen3), cuda)
    logits = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            m.setattr(cuda, "rope_fusion", fused)
            m.setattr(cuda, "combine_fusion", fused)
            logits.append(model_steps(model, kv_dtype))
    np.testing.assert_allclose(logits[0], logits[1], rtol=0, atol=1e-4)
    assert not cuda.graph_failures
