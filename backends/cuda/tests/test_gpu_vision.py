"""Images on the CUDA backend against the float64 CPU oracle: the ops images add (layer_norm, gelu without up,
attention over bidirectional rows, vision.py) on random inputs, then each tiny model and mmproj llama.cpp's vision
references were recorded on (``tiny_vision.py`` in architectures/gemma/tests/references: Gemma 3 and its ``gemma3``
projector; in architectures/gemma4/tests/references: Gemma 4 and its ``gemma4v`` projector, 2-D RoPE and pooling;
both with a sliding window shorter than the image's span): the image embeddings, and the logits of the text after
the image, computed at once and step by step through ``run`` (graphs for the text, the image's row eagerly).

The logits are checked against the oracle rounded as the CUDA backend rounds (test_gpu_qwen35.F16Rows: where a
product goes to the tensor cores, x and the weight rounded to f16, in the encoder's products of hundreds of patches
and the model's prompt chunks alike), as Qwen3.5's are: the tiny Gemma 4 amplifies that rounding. Its encoder so
rounded moves the image embeddings by 3.9e-3 of the largest entry (llama.cpp's are 3.1e-3 away), and on the host
alone the f64 oracle with that encoder is top-1 95% (39 of 41), mean KL 9.9e-4 from the exact one; the H200 printed
90%, 1.8e-3 for the CUDA backend against the exact oracle, and 95-98% (one or two near ties of 41) with KL 2-3e-4
against the oracle with the rounded encoder only. The model's half is also checked alone, given the oracle's own
embeddings."""

import contextlib
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.compare import DEFAULT_MIN_GAP, compare
from leat.model import Model, load
from leat.modelfile import Tensor
from leat.testing import relative_error

pytestmark = pytest.mark.gpu
ARCHITECTURES = Path(__file__).parents[3] / "architectures"
_spec = importlib.util.spec_from_file_location("gpu_qwen35", Path(__file__).with_name("test_gpu_qwen35.py"))
gpu_qwen35 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_qwen35)
# Embeddings: the encoder's products of 64 patches go through the tensor-core GEMM (f16 operands, float32 sums).
# The oracle with every product's operands rounded to f16 as x_to_f16 rounds them is 4.3e-4 of the largest entry
# from the float64 one on these files; the bar leaves ten times that.
EMBEDDING_BAR = 5e-3
# Top-1 is counted where the reference's top two logits are at least this far apart (the default: 0.001). The tiny
# Gemma 4's logits after the image have near ties that what F16Rows leaves out (float32 sums, the f16 KV cache and
# the f16 tiles of flash attention) flips: on the H200, one or two of 41 positions, at gaps 0.011-0.034 of the
# rounded oracle, with mean KL 1e-4 (a tenth of the bar). 0.1 is the gap Gemma 4's llama.cpp tests count at.
MIN_GAP = {"gemma": DEFAULT_MIN_GAP, "gemma4": 0.1}


def test_layer_norm(cuda, oracle):
    rng = np.random.default_rng(31)
    for rows, cols in ((3, 32), (5, 1152), (2, 72)):
        x = rng.standard_normal((rows, cols)) * 3 + 20  # a large mean: the variance is taken about it
        w, b = rng.standard_normal(cols), rng.standard_normal(cols)
        for weight, bias in ((w, b), (None, None)):
            want = oracle.layer_norm(x, weight, bias, 1e-6)
            args = [None if a is None else cuda.from_host(a) for a in (weight, bias)]
            # float32 throughout (numpy, in the kernel's order) is 2.8e-7 to 4.5e-7 from the oracle on these rows
            assert relative_error(cuda.to_host(cuda.layer_norm(cuda.from_host(x), *args, 1e-6)), want) < 2e-6


def test_gelu_without_up(cuda, oracle):
    g = np.random.default_rng(32).standard_normal((7, 300)) * 4
    got = cuda.to_host(cuda.gelu_mul(cuda.from_host(g)))
    np.testing.assert_allclose(got, oracle.gelu_mul(g), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (16, 16, 72), (8, 4, 256)])
def test_bidirectional_attention(cuda, oracle, kv_dtype, window, heads, kv_heads, dim):
    """A prefix, then a batch of a causal row (slot 0) and a bidirectional one (slot 1, after its prefix; pages in
    reverse order), then a decode step of each: every query of the bidirectional row sees the row's last position,
    its window counted back from its own."""
    if kv_dtype == "q8_0" and dim % 32:
        pytest.skip("q8_0 KV needs head dimensions that are multiples of 32")
    rng = np.random.default_rng(dim + (window or 0))
    layouts = [KVLayout(kv_heads, dim, window=window)]
    kvs = [b.allocate_kv(layouts, slots=2, context=96, page_size=16, dtype=kv_dtype) for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    steps = [
        [Row(1, 0, np.zeros(20, int))],
        [Row(0, 0, np.zeros(9, int)), Row(1, 20, np.zeros(40, int), bidirectional=True)],
        [Row(0, 9, np.zeros(1, int)), Row(1, 60, np.zeros(1, int))],
    ]
    for rows in steps:
        batch = Batch(rows)
        q, k, v = (rng.standard_normal((len(batch), h, dim)) for h in (heads, kv_heads, kv_heads))
        want = oracle.attention(q, k, v, kvs[1], 0, batch, dim**-0.5)
        got = cuda.to_host(cuda.attention(*(cuda.from_host(t) for t in (q, k, v)), kvs[0], 0, batch, dim**-0.5))
        # both caches hold the same f16 values or q8_0 quants (as test_gpu_ops and test_gpu_q8_0_kv_and_top_k bound)
        assert relative_error(got, want) < (1e-5 if kv_dtype == "f32" else 2e-3)


def test_bidirectional_attention_with_softcap_and_sinks(cuda, oracle):
    rng = np.random.default_rng(33)
    heads, kv_heads, dim = 6, 2, 64
    kvs = [b.allocate_kv([KVLayout(kv_heads, dim)], slots=1, context=32, dtype="f32") for b in (cuda, oracle)]
    sinks = Tensor("sinks", gguf.GGMLQuantizationType.F32, (heads,), rng.standard_normal(heads).astype(np.float32))
    batch = Batch([Row(0, 0, np.zeros(24, int), bidirectional=True)])
    q, k, v = (rng.standard_normal((24, h, dim)) * 2 for h in (heads, kv_heads, kv_heads))
    want = oracle.attention(q, k, v, kvs[1], 0, batch, 0.2, softcap=4.0, sinks=oracle.upload(sinks))
    got = cuda.attention(*(cuda.from_host(t) for t in (q, k, v)), kvs[0], 0, batch, 0.2, 4.0, cuda.upload(sinks))
    assert relative_error(cuda.to_host(got), want) < 1e-5


@pytest.fixture(scope="module", params=["gemma", "gemma4"])
def tiny(request, tmp_path_factory) -> dict:
    path = ARCHITECTURES / request.param / "tests" / "references" / "tiny_vision.py"
    spec = importlib.util.spec_from_file_location(f"tiny_vision_{request.param}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {**module.build(tmp_path_factory.mktemp("vision")), "family": request.param}


def _loaded(files: dict, **options):
    model = load(files["model"], pull=False, **options)
    model.load_mmproj(files["mmproj"])
    ids, spans = model.image_prompt(files["prompt"], [Path(files["image"]).read_bytes()])
    return model, ids, spans


@pytest.fixture(scope="module")
def models(tiny):
    return _loaded(tiny, backend="cuda"), _loaded(tiny, backend="cpu", precision="f64")


@pytest.fixture(scope="module")
def rounded(tiny, models):
    """The oracle as the CUDA backend rounds: the float64 model and encoder on F16Rows, whose products round x and
    the weight to f16 where ``cuda`` sends them to the tensor cores."""
    (gpu, _, _), (cpu, _, _) = models
    backend = gpu_qwen35.F16Rows(gpu.backend)
    model = Model(cpu.file, type(cpu.architecture)(cpu.file, backend), backend, (cpu.tokenizer, None))
    model.load_mmproj(tiny["mmproj"])
    return model


def oracle_embeddings(models) -> np.ndarray:
    _, (cpu, _, oracle_spans) = models
    return cpu.backend.to_host(cpu.vision.embeddings(oracle_spans[0]))


@contextlib.contextmanager
def given_embeddings(model, embeddings):
    """``model``'s encoder answering ``embeddings`` (of the one image) for as long as the block runs."""
    encode = model.vision.embeddings
    model.vision.embeddings = lambda span: model.backend.from_host(embeddings)
    try:
        yield model
    finally:
        model.vision.embeddings = encode


def test_image_embeddings_match_the_oracle(models):
    (gpu, _, spans), (cpu, _, oracle_spans) = models
    got = gpu.backend.to_host(gpu.vision.embeddings(spans[0]))
    want = cpu.backend.to_host(cpu.vision.embeddings(oracle_spans[0]))
    assert got.shape == want.shape == (spans[0].length, gpu.architecture.params.width)
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error < EMBEDDING_BAR, f"max |cuda - oracle| is {error:.3g} of the largest embedding entry"


def _after(spans, ids) -> np.ndarray:
    return np.arange(spans[0].start + spans[0].length, len(ids))


def test_logits_after_the_image_match_the_oracle(tiny, models, rounded):
    """The whole path (CUDA's encoder, then its model) against the oracle rounded as the backend rounds."""
    (gpu, ids, spans), (_, _, oracle_spans) = models
    want = rounded.logits(ids, images=oracle_spans, native=True)
    after = _after(spans, ids)
    got = gpu.logits(ids, images=spans)[after]
    agreement = compare(want[after], got, min_gap=MIN_GAP[tiny["family"]], label="cuda, text after the image")
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)
    causal = rounded.logits(ids, images=[], native=True)  # the image's placeholders as tokens: far from the image's
    assert compare(want[after], causal[after], label="no image").failures(top1=0.99, kl=1e-3)


def test_logits_given_the_oracles_embeddings_match_the_oracle(tiny, models, rounded):
    """The model's half alone: the image's row (bidirectional where the family says) from the same embeddings."""
    (gpu, ids, spans), (_, _, oracle_spans) = models
    embeddings = oracle_embeddings(models)
    with given_embeddings(rounded, embeddings):
        want = rounded.logits(ids, images=oracle_spans, native=True)
    with given_embeddings(gpu, embeddings):
        got = gpu.logits(ids, images=spans)
    after = _after(spans, ids)
    gap = MIN_GAP[tiny["family"]]
    agreement = compare(want[after], got[after], min_gap=gap, label="cuda given the oracle's embeddings")
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def stepped(model, ids, span, embeddings, kv_dtype) -> np.ndarray:
    """The logits of the text after the image as the engine steps the prompt: the text before the image as one
    chunk, the image's row (``embeddings`` as its inputs), then the text after it one token a step."""
    backend, forward = model.backend, model.architecture.forward
    kv = model.new_kv(len(ids), dtype=kv_dtype)
    tokens, end = np.asarray(ids), span.start + span.length
    backend.run(forward, Batch([Row(0, 0, tokens[: span.start])]), kv)
    image = Row(0, span.start, tokens[span.start : end], bidirectional=True, inputs=backend.from_host(embeddings))
    out = [backend.to_host(backend.run(forward, Batch([image]), kv))[-1]]
    for position in range(end, len(ids) - 1):
        row = Row(0, position, tokens[position : position + 1])
        out.append(backend.to_host(backend.run(forward, Batch([row]), kv))[0])
    return np.stack(out)


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_steps_through_run_match_the_oracle(tiny, models, rounded, kv_dtype):
    """Stepped as the engine steps (graphs for the text, the image's row eagerly), from the oracle's embeddings,
    against the rounded oracle stepped the same way."""
    (gpu, ids, spans), _ = models
    embeddings = oracle_embeddings(models)
    got = stepped(gpu, ids, spans[0], embeddings, kv_dtype)
    assert gpu.backend.graph_failures == []
    want = stepped(rounded, ids, spans[0], embeddings, "f32")
    agreement = compare(want, got, min_gap=MIN_GAP[tiny["family"]], label=f"cuda through run, {kv_dtype} KV")
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)
