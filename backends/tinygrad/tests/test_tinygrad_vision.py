"""Images on the tinygrad backend against the CPU backend's float64 path: the ops images add (layer_norm, gelu
without up, attention over bidirectional rows) on random inputs, then a tiny Gemma 3 model with a tiny ``gemma3``
mmproj (a sliding window shorter than the image's span): the image embeddings, the logits of the text after the
image, and greedy decoding through the engine (text steps under TinyJit, the image's row eagerly)."""

from __future__ import annotations

import os

import gguf
import leat
import numpy as np
import pytest
from leat import plugins
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.compare import DEFAULT_MIN_GAP, compare, first_near_tie, top2_gap
from leat.conformance.backend import cpu_oracle
from leat.modelfile import Tensor as FileTensor
from leat.testing import encode_png, relative_error, write_tiny_gguf, write_tiny_mmproj
from leat_backend_tinygrad.backend import TinygradBackend, probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

if not os.environ.get("LEAT_TINYGRAD_TEST_OPT"):  # as in test_tinygrad_backend.py: a cold run is mostly the optimizer
    from tinygrad.helpers import NOOPT

    NOOPT.value = 1
if "PARALLEL" not in os.environ:  # as in test_tinygrad_backend.py: kernels compiled in this process, not a pool
    from tinygrad.helpers import PARALLEL

    PARALLEL.value = 0
os.environ.setdefault("LEAT_TINYGRAD_HALF", "0")

BARS = {"top1": 0.99, "kl": 1e-3}


@pytest.fixture(scope="module")
def backend():
    return TinygradBackend()


@pytest.fixture(scope="module")
def oracle():
    return cpu_oracle()("f64")


def test_layer_norm(backend, oracle):
    rng = np.random.default_rng(41)
    x = rng.standard_normal((5, 72)) * 3 + 20  # a large mean: the variance is taken about it
    w, b = rng.standard_normal(72), rng.standard_normal(72)
    for weight, bias in ((w, b), (None, None)):
        want = oracle.layer_norm(x, weight, bias, 1e-6)
        args = [None if a is None else backend.from_host(a) for a in (weight, bias)]
        # measured: the CPU backend's float32 path is 2.1e-7 and 3.2e-7 from the oracle here, this 4.4e-7 and 6.9e-7
        assert relative_error(backend.to_host(backend.layer_norm(backend.from_host(x), *args, 1e-6)), want) < 2e-6


def test_gelu_without_up(backend, oracle):
    g = np.random.default_rng(42).standard_normal((7, 60)) * 4
    np.testing.assert_allclose(backend.to_host(backend.gelu_mul(backend.from_host(g))), oracle.gelu_mul(g), 1e-5, 1e-6)


def test_bidirectional_attention(backend, oracle):
    """A prefix, then a batch of a causal row (slot 0) and a bidirectional one (slot 1, after its prefix; pages in
    reverse order; a window, soft-capped scores and sinks): every query of the bidirectional row sees the row's last
    position, its window counted back from its own."""
    heads, kv_heads, dim = 4, 2, 32
    rng = np.random.default_rng(43)
    layouts = [KVLayout(kv_heads, dim, window=6)]
    kvs = [b.allocate_kv(layouts, slots=2, context=48, page_size=8) for b in (backend, oracle)]
    for b, kv in zip((backend, oracle), kvs):
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    host_sinks = FileTensor("sinks", gguf.GGMLQuantizationType.F32, (heads,), rng.standard_normal(heads, np.float32))
    sinks = (backend.upload(host_sinks), oracle.upload(host_sinks))
    steps = [
        [Row(1, 0, np.zeros(10, int))],
        [Row(0, 0, np.zeros(5, int)), Row(1, 10, np.zeros(20, int), bidirectional=True)],
    ]
    for rows in steps:
        batch = Batch(rows)
        q, k, v = (rng.standard_normal((len(batch), h, dim)) * 2 for h in (heads, kv_heads, kv_heads))
        want = oracle.attention(q, k, v, kvs[1], 0, batch, dim**-0.5, 4.0, sinks[1])
        args = (backend.from_host(t) for t in (q, k, v))
        got = backend.to_host(backend.attention(*args, kvs[0], 0, batch, dim**-0.5, 4.0, sinks[0]))
        assert relative_error(got, want) < 1e-5  # float32: measured 1.6e-7, 2.3e-7


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    entry = plugins.host().get("architectures", "gemma3")
    if entry is None:
        pytest.skip("no installed plugin serves gemma3")
    gemma3, out = entry.load(), tmp_path_factory.mktemp("vision")
    params = gemma3.tiny(window=8, pattern=2)  # a sliding window shorter than the image's 16 tokens
    model = write_tiny_gguf(gemma3, out / "tiny-gemma3.gguf", seed=21, params=params)
    mmproj = write_tiny_mmproj(out / "tiny-mmproj.gguf", params.width, gguf.VisionProjectorType.GEMMA3, seed=22)
    pixels = np.random.default_rng(23).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return {"model": model, "mmproj": mmproj, "image": encode_png(pixels)}


def _loaded(files: dict, **options):
    """The model with its mmproj, a prompt's ids and its image's span: 16 text tokens, the image's 16, 16 more (chunks
    of one length: tinygrad compiles kernels per shape, so they share their products' kernels)."""
    model = leat.load(str(files["model"]), pull=False, **options)
    model.load_mmproj(files["mmproj"])
    span = model.vision.span(16, files["image"])
    ids = np.random.default_rng(24).integers(1, 256, 48)
    ids[span.start : span.start + span.length] = 0  # placeholders, as leat.vision.place writes them
    return model, ids.tolist(), [span]


@pytest.fixture(scope="module")
def models(files):
    return _loaded(files, backend="tinygrad"), _loaded(files, backend="cpu", precision="f64")


def test_image_embeddings_match_the_oracle(models):
    (model, _, spans), (cpu, _, oracle_spans) = models
    got = model.backend.to_host(model.vision.embeddings(spans[0]))
    want = cpu.backend.to_host(cpu.vision.embeddings(oracle_spans[0]))
    assert got.shape == want.shape == (spans[0].length, model.architecture.params.width)
    assert relative_error(got, want) < 1e-5  # float32 throughout: measured 2.2e-7


def test_logits_after_the_image_match_the_oracle(models):
    (model, ids, spans), (cpu, _, oracle_spans) = models
    want = cpu.logits(ids, images=oracle_spans, native=True)
    after = np.arange(spans[0].start + spans[0].length, len(ids))
    agreement = compare(want[after], model.logits(ids, images=spans)[after], label="tinygrad, after the image")
    assert not agreement.failures(**BARS), str(agreement)
    causal = cpu.logits(ids, native=True)  # the image's placeholders as tokens: far from the image's logits
    assert compare(want[after], causal[after], label="no image").failures(**BARS)


def test_greedy_through_the_engine_matches_the_oracle(models):
    """leat's engine steps the prompt (the text before the image, the image's row, the text after it), then decodes
    under TinyJit; each token is the oracle's argmax after the image and the tokens before it, up to a near-tie."""
    (model, ids, spans), (cpu, _, oracle_spans) = models
    got = [t.id for t in model.generate(ids, max_tokens=6, sampling={"temperature": 0}, images=spans) if t.id >= 0]
    steps = cpu.logits(ids + got, images=oracle_spans, native=True)[len(ids) - 1 : -1]
    tie = first_near_tie(top2_gap(steps), DEFAULT_MIN_GAP)
    n = len(got) if tie is None else tie
    assert len(got) == 6 and got[:n] == np.argmax(steps, axis=-1)[:n].tolist(), f"compared {n} steps: {got}"


def test_an_image_row_runs_outside_tinyjit(models):
    """A row with input embeddings, attending both ways, reaches the forward as it is: never a jitted or padded step
    (whose attention is causal, reading the step's positions, and whose embeddings come from its tokens)."""
    (model, ids, spans), _ = models
    backend, seen = model.backend, []
    inputs = model.vision.embeddings(spans[0])

    def forward(batch, kv):
        seen.append((batch.inputs is inputs, len(batch), batch.rows[0].bidirectional, backend._step is None))
        return backend.from_host(np.zeros((1, 4)))

    image = Row(0, 0, np.zeros(spans[0].length, np.int64), bidirectional=True, inputs=inputs)
    backend.run(forward, Batch([image]), model.new_kv(len(ids)))
    assert seen == [(True, spans[0].length, True, True)]
