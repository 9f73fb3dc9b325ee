"""The tinygrad backend, on whichever device tinygrad picks (``DEV``; in CI its CPU device, which needs clang).

Ops against plain float64 references written here; dequantization inside tinygrad against
``gguf.quants.dequantize`` bit for bit; tiny llama models and SmolLM2 against the CPU float64 oracle
(leat.compare's measures, the design's bars: top-1 >= 99%, mean KL < 1e-3).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import gguf
import leat
import numpy as np
import pytest
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.compare import DEFAULT_MIN_GAP, compare, first_near_tie, top2_gap
from leat.errors import PullError
from leat.modelfile import Tensor as FileTensor
from leat_backend_tinygrad.backend import TinygradBackend, probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

# tinygrad spends most of a cold run in its Python kernel optimizer (kernels compile on first use);
# NOOPT=1 skips the optimizer (not the math), halving the cold run. LEAT_TINYGRAD_TEST_OPT=1 keeps it.
if not os.environ.get("LEAT_TINYGRAD_TEST_OPT"):
    from tinygrad.helpers import NOOPT

    NOOPT.value = 1

# tinygrad lowers and compiles a realize's new kernels in a pool of spawned processes (PARALLEL: one per CPU thread,
# each replaced after 16 tasks); on a 2-core test machine spawning them costs more than they save (backends/tinygrad:
# 343 s with PARALLEL=0 against 447 s at load 3): the same kernels, compiled in this process. PARALLEL=N overrides it.
if "PARALLEL" not in os.environ:
    from tinygrad.helpers import PARALLEL

    PARALLEL.value = 0

# prefill products in float32 (GPU devices default to float16 ones: their test is the backend bar, below)
os.environ.setdefault("LEAT_TINYGRAD_HALF", "0")

Q = gguf.GGMLQuantizationType
TOL = 2e-5
REFERENCES = Path(__file__).parents[3] / "tests" / "references"


@pytest.fixture(scope="module")
def backend():
    return TinygradBackend()


def close(got, want, tol=TOL):
    np.testing.assert_allclose(np.asarray(got.numpy(), np.float64), want, rtol=tol, atol=tol)


def f32(x):
    return np.asarray(x, np.float32)


def test_plugin_registers_lazily_without_importing_tinygrad():
    import subprocess
    import sys

    code = "import sys, leat.plugins as p; h = p.host(); assert 'tinygrad' in h.registry['backends']; print('tinygrad' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_probe_says_what_to_install_when_the_cpu_compiler_is_missing(monkeypatch):
    if TinygradBackend().device.split(":")[0] != "CPU":
        pytest.skip("the compiler check is the CPU device's")
    monkeypatch.setenv("CC", "no-such-compiler")
    assert "apt-get install clang" in probe_reason()


def test_describe_names_the_device(backend):
    info = backend.describe()
    assert info["backend"] == "tinygrad" and info["device"] and info["kernel_cache"]


def test_staged_products_follow_their_settings(monkeypatch):
    # LEAT_TINYGRAD_TILES: every staged product's tiles (gemm.Tiles); describe() names a 4096 x 4096 product's tiles,
    # None without NVIDIA's tensor cores (the CPU device), "off" with LEAT_TINYGRAD_STAGED=0
    from leat_backend_tinygrad import gemm
    from tinygrad import Device, dtypes

    monkeypatch.setenv("LEAT_TINYGRAD_TILES", "128,64,32,4,2,8,2,0")
    backend = TinygradBackend()
    assert backend.staged_tiles == gemm.Tiles(128, 64, 32, 4, 2, 8, 2, runs=False) and backend.staged_products
    assert gemm.Tiles.parse("128,64,32,4,2,auto,2") == gemm.Tiles(128, 64, 32, 4, 2, None, 2, runs=True)
    nvidia = gemm.tensor_core(Device[backend.device].renderer, dtypes.float16) is not None
    expected = repr(gemm.Tiles(128, 64, 32, 4, 2, 8, 2, runs=False)) if nvidia else "None"
    assert backend.describe()["staged_products"] == expected
    monkeypatch.setenv("LEAT_TINYGRAD_STAGED", "0")
    monkeypatch.delenv("LEAT_TINYGRAD_TILES")
    backend = TinygradBackend()
    assert backend.staged_tiles is None and backend.describe()["staged_products"] == "off"


@pytest.mark.parametrize(
    "qtype",
    [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q3_K],
    ids=lambda q: q.name,
)
def test_dequantization_equals_gguf(backend, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 3, 512
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        stored = gguf.quants.quantize(values, qtype)
    except NotImplementedError:  # K-quants: random bytes are valid blocks (f16 fields kept finite)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        stored = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        if qtype == Q.Q6_K:
            stored[..., -2:] = np.array([0.01], np.float16).view(np.uint8)
        if qtype in (Q.Q4_K, Q.Q5_K):
            stored[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)
        stored = stored.reshape(rows, -1)
    stored = stored if stored.dtype == np.uint8 else stored.view(np.uint8).reshape(rows, -1)
    if qtype in (Q.F32, Q.F16):
        stored = stored.view(np.float32 if qtype == Q.F32 else np.float16)
    want = gguf.quants.dequantize(stored, qtype).reshape(rows, cols).astype(np.float32)
    weight = backend.upload(FileTensor("w", qtype, (rows, cols), stored))
    np.testing.assert_array_equal(weight.values().numpy(), want)
    # and inside a matmul, where tinygrad fuses the dequantization into the product
    x = rng.standard_normal((2, cols))
    close(backend.matmul(f32(x), weight), x @ want.astype(np.float64).T, 1e-4)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_many_row_products_dequantize_the_weight_once(qtype, monkeypatch):
    # GPU devices take this path from 16 rows (prefill): the weight dequantized into a float32 copy, then
    # the product. It must equal the fused path (below the threshold) and the float64 product.
    monkeypatch.setenv("LEAT_TINYGRAD_GEMM_ROWS", "4")
    backend = TinygradBackend()
    assert backend.gemm_rows == 4
    rng = np.random.default_rng(int(qtype) + 7)
    rows, cols = 24, 512
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    stored = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    if qtype == Q.Q8_0:
        stored[..., :2] = scale
    elif qtype == Q.Q6_K:
        stored[..., -2:] = scale
    else:
        stored[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)
    stored = stored.reshape(rows, -1)
    w = gguf.quants.dequantize(stored, qtype).reshape(rows, cols).astype(np.float64)
    weight = backend.upload(FileTensor("w", qtype, (rows, cols), stored))
    x = rng.standard_normal((8, cols))
    fused = backend.matmul(f32(x[:3]), weight).numpy()  # below the threshold
    copied = backend.matmul(f32(x), weight)
    close(copied, x @ w.T, 1e-4)
    copied = copied.numpy()
    np.testing.assert_allclose(copied[:3], fused, rtol=1e-5, atol=1e-5 * np.abs(fused).max())


def test_matmul_with_bias(backend):
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((5, 32)), rng.standard_normal((7, 32)), rng.standard_normal(7)
    want = np.array([[sum(x[i, k] * w[j, k] for k in range(32)) + b[j] for j in range(7)] for i in range(5)])
    close(backend.matmul(f32(x), f32(w), f32(b)), want)


def test_rms_norm(backend):
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((4, 3, 16)), rng.standard_normal(16)
    want = np.empty_like(x)
    for idx in np.ndindex(4, 3):
        row = x[idx]
        want[idx] = row / math.sqrt(sum(v * v for v in row) / 16 + 1e-6) * w
    close(backend.rms_norm(f32(x), f32(w), 1e-6), want)


def rope_reference(x, positions, dims, base, neox, scale=1.0, factors=None):
    out = x.copy()
    for t, pos in enumerate(positions):
        for i in range(dims // 2):
            freq = base ** (-2 * i / dims) / (factors[i] if factors is not None else 1.0)
            angle = pos * scale * freq
            a, b = (i, i + dims // 2) if neox else (2 * i, 2 * i + 1)
            for h in range(x.shape[1]):
                xa, xb = x[t, h, a], x[t, h, b]
                out[t, h, a] = xa * math.cos(angle) - xb * math.sin(angle)
                out[t, h, b] = xa * math.sin(angle) + xb * math.cos(angle)
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dims", [16, 8])
def test_rope(backend, neox, dims):
    rng = np.random.default_rng(3)
    x, positions = rng.standard_normal((5, 2, 16)), np.array([0, 1, 7, 100, 4000])
    factors = np.linspace(1, 4, dims // 2)
    want = rope_reference(x, positions, dims, 10000.0, neox, 0.5, factors)
    close(backend.rope(f32(x), positions, RopeSpec(dims, 10000.0, neox, 0.5, factors)), want)


def attention_reference(q, keys, values, positions, scale, window=None, softcap=None, sinks=None):
    """Per query and head: softmax over the allowed cached keys (causal, windowed); optional soft-cap
    of each score and sink logit per head in the denominator."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = np.zeros((n, heads, values.shape[2]))
    for t in range(n):
        for h in range(heads):
            allowed = [
                j for j in range(len(keys)) if j <= positions[t] and (window is None or j > positions[t] - window)
            ]
            scores = [float(q[t, h] @ keys[j, h // group]) * scale for j in allowed]
            if softcap is not None:
                scores = [softcap * math.tanh(s / softcap) for s in scores]
            top = max(scores + ([sinks[h]] if sinks is not None else []))
            total = sum(math.exp(s - top) for s in scores) + (math.exp(sinks[h] - top) if sinks is not None else 0)
            out[t, h] = sum(math.exp(s - top) / total * values[j, h // group] for s, j in zip(scores, allowed))
    return out.reshape(n, -1)


STEPS = [  # two sequences: prefill 6 and 4 tokens, then one decodes 1 while the other prefills 3 more
    (
        [Row(0, 0, np.zeros(6, int), all_logits=True), Row(1, 0, np.zeros(4, int), all_logits=True)],
        [(0, 0, 6), (1, 0, 4)],
    ),
    ([Row(1, 4, np.zeros(1, int)), Row(0, 6, np.zeros(3, int), all_logits=True)], [(1, 4, 1), (0, 6, 3)]),
]


@pytest.mark.parametrize("kind", ["plain", "window", "softcap", "sinks", "f16-kv", "q8_0-kv"])
def test_attention_prefill_then_decode_two_sequences(backend, kind):
    rng = np.random.default_rng(4)
    heads, kv_heads, dim = 6, 2, 32
    window = 3 if kind == "window" else None
    kv_dtype = {"f16-kv": "f16", "q8_0-kv": "q8_0"}.get(kind, "f32")
    kv = backend.allocate_kv([KVLayout(kv_heads, dim, window=window)], slots=2, context=16, page_size=4, dtype=kv_dtype)
    seqs = {s: [rng.standard_normal((9, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    sinks = np.array([-2.0, 0.0, 1.5, 4.0, -30.0, 0.7])
    for rows, spans in STEPS:
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans]) for i in range(3))
        args = (f32(q), f32(k), f32(v), kv, 0, Batch(rows), 0.3)
        if kind == "softcap":
            out = backend.attention(*args, softcap=1.5)
        elif kind == "sinks":
            out = backend.attention(*args, sinks=f32(sinks))
        else:
            out = backend.attention(*args)
        offset = 0
        for s, a, n in spans:
            sq, sk, sv = seqs[s]
            if kv_dtype == "f16":
                sk, sv = sk.astype(np.float16), sv.astype(np.float16)
            elif kv_dtype == "q8_0":
                sk, sv = (
                    gguf.quants.dequantize(gguf.quants.quantize(f32(t).reshape(-1, dim), Q.Q8_0), Q.Q8_0).reshape(
                        t.shape
                    )
                    for t in (sk, sv)
                )
            want = attention_reference(
                sq[a : a + n],
                sk[: a + n].astype(np.float64),
                sv[: a + n].astype(np.float64),
                range(a, a + n),
                0.3,
                window,
                1.5 if kind == "softcap" else None,
                sinks if kind == "sinks" else None,
            )
            close(out[offset : offset + n], want, TOL if kv_dtype != "q8_0" else 1e-3)
            offset += n


def test_paged_kv_shuffled_table_copy_and_hibernate(backend):
    rng = np.random.default_rng(5)
    layout = KVLayout(2, 4)
    q, k, v = (
        f32(rng.standard_normal((11, 4, 4))),
        f32(rng.standard_normal((11, 2, 4))),
        f32(rng.standard_normal((11, 2, 4))),
    )
    contiguous = backend.allocate_kv([layout], slots=1, context=12, page_size=4)
    paged = backend.allocate_kv([layout], slots=2, context=12, pages=7, page_size=4)
    backend.set_pages(paged, 1, np.array([5, 0, 3]))
    want = backend.attention(
        q, k, v, contiguous, 0, Batch([Row(0, 0, np.zeros(11, int), all_logits=True)]), 0.5
    ).numpy()
    got = backend.attention(q, k, v, paged, 0, Batch([Row(1, 0, np.zeros(11, int), all_logits=True)]), 0.5).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(paged.k[0].numpy()[12:15], k[8:])
    backend.copy_page(paged, 3, 6)
    np.testing.assert_array_equal(paged.v[0].numpy()[24:28], paged.v[0].numpy()[12:16])
    saved = backend.read_pages(paged, [5, 0, 3])
    fresh = backend.allocate_kv([layout], slots=1, context=12, pages=4, page_size=4)
    backend.write_pages(fresh, [2, 1, 0], saved)
    backend.set_pages(fresh, 0, np.array([2, 1, 0]))
    again = backend.attention(q[10:], k[10:], v[10:], fresh, 0, Batch([Row(0, 10, np.zeros(1, int))]), 0.5).numpy()
    np.testing.assert_allclose(again, want[10:], rtol=1e-6, atol=1e-6)


def test_elementwise_ops_embed_and_take_rows(backend):
    x, y = np.linspace(-12, 12, 49), np.linspace(2, -3, 49)
    close(backend.silu_mul(f32(x), f32(y)), np.array([a / (1 + math.exp(-a)) * b for a, b in zip(x, y)]))
    gelu = [0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3))) for a in x]
    close(backend.gelu_mul(f32(x), f32(y)), np.array(gelu) * y)
    close(backend.add(f32(x), f32(y)), x + y)
    close(backend.scale(f32(x), 8.0**0.5), x * 8.0**0.5)
    close(backend.softcap(f32(x), 5.0), np.array([5.0 * math.tanh(a / 5.0) for a in x]))
    table = np.arange(40.0).reshape(10, 4).astype(np.float32)
    weight = backend.upload(FileTensor("t", Q.F32, (10, 4), table))
    np.testing.assert_array_equal(backend.embed(weight, np.array([4, 0, 4])).numpy(), table[[4, 0, 4]])
    np.testing.assert_array_equal(backend.take_rows(table, np.array([1, 3])).numpy(), table[[1, 3]])
    np.testing.assert_array_equal(backend.take_rows(table, np.array([2, 3, 4])).numpy(), table[2:5])


def test_head_matmul(backend):
    rng = np.random.default_rng(10)
    x, w = rng.standard_normal((5, 3, 8)), rng.standard_normal((3, 6, 8))
    want = np.array(
        [[[sum(x[t, h, k] * w[h, m, k] for k in range(8)) for m in range(6)] for h in range(3)] for t in range(5)]
    )
    close(backend.head_matmul(f32(x), f32(w)), want)


def test_mla_attention(backend):
    rng = np.random.default_rng(11)
    heads, rank, rope = 3, 8, 4
    kv = backend.allocate_kv([KVLayout(1, rank + rope, rank, latent=True)], slots=2, context=16, page_size=4)
    seqs = {
        s: [rng.standard_normal(shape) for shape in ((9, heads, rank), (9, heads, rope), (9, rank), (9, rope))]
        for s in (0, 1)
    }
    for rows, spans in STEPS:
        args = [f32(np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans])) for i in range(4)]
        out = backend.mla_attention(*args, kv, 0, Batch(rows), 0.4)
        offset = 0
        for s, a, n in spans:
            ql, qr, c, kr = seqs[s]
            q = np.concatenate([ql, qr], -1)[a : a + n]
            keys = np.concatenate([c, kr], -1)[: a + n, None, :]
            want = attention_reference(q, keys, c[: a + n, None, :], range(a, a + n), 0.4).reshape(n, heads, rank)
            close(out[offset : offset + n], want)
            offset += n


def test_moe_with_quantized_experts(backend):
    from leat.moe import MoESpec, MoEWeights, activate, route

    rng = np.random.default_rng(9)
    experts, d, ffn, n = 4, 32, 32, 5
    spec = MoESpec(experts, 2, "softmax_selected", activation="swiglu_oai")  # gpt-oss routing and clamps
    x, router, bias = rng.standard_normal((n, d)), rng.standard_normal((experts, d)), rng.standard_normal((experts, d))
    stored = [gguf.quants.quantize(f32(3 * rng.standard_normal((experts, ffn, d))), Q.Q8_0) for _ in range(3)]
    gate, up, down = (gguf.quants.dequantize(s, Q.Q8_0).reshape(experts, ffn, d).astype(np.float64) for s in stored)
    ids, gains = route(x @ router.T, spec, None)
    want = np.zeros_like(x)
    for t in range(n):
        for e, g in zip(ids[t], gains[t]):
            want[t] += g * (activate(gate[e] @ x[t], up[e] @ x[t], spec) @ down[e].T + bias[e])
    handles = [backend.upload(FileTensor("e", Q.Q8_0, (experts, ffn, d), s)) for s in stored]
    got = backend.moe(f32(x), MoEWeights(f32(router), *handles, down_bias=f32(bias)), spec)
    close(got, want, 1e-4)


# -- whole models against the CPU float64 oracle -------------------------------------------------------
def _tiny_models():
    spec = importlib.util.spec_from_file_location("leat_tests_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Q4_0, Q4_1, Q5_*, Q6_K are covered by the dequantization and matmul tests above; whole models of
# every type would take minutes of kernel compilation on a cold 2-core CI machine.
TINY = ["f32", "q8_0", "q4_k-llama3"]
BARS = {"top1": 0.99, "kl": 1e-3}


@pytest.mark.parametrize("name", TINY)
def test_tiny_llama_matches_the_f64_oracle(name, tmp_path, monkeypatch):
    path = str(_tiny_models().build(name, tmp_path / f"tiny-{name}.gguf"))
    ids = list(range(1, 65))
    want = leat.load(path, backend="cpu", precision="f64").logits(ids, native=True)
    got = leat.load(path, backend="tinygrad").logits(ids)
    agreement = compare(want, got, label=f"{name}: tinygrad vs cpu f64")
    print(agreement)
    assert not agreement.failures(**BARS), f"{agreement}"
    assert agreement.mean_kl < 1e-9  # measured ~1e-13: float32 against float64
    if name == "q4_k-llama3":
        # prefill products as on a GPU: the weight dequantized to a float16 copy, x in float16, float32 sums
        # (tensor cores there): the backend bar, not float32's ~1e-13 (measured here: mean KL 4e-7, top-1 100%)
        monkeypatch.setenv("LEAT_TINYGRAD_HALF", "1")
        monkeypatch.setenv("LEAT_TINYGRAD_GEMM_ROWS", "16")
        model = leat.load(path, backend="tinygrad")
        assert model.backend.half_products
        agreement = compare(want, model.logits(ids), label=f"{name}: float16 prefill products vs cpu f64")
        print(agreement)
        assert not agreement.failures(**BARS), f"{agreement}"


# qwen35's own test is test_qwen35_prefill_chunks_jitted_and_padded_continue_the_recurrent_state
ARCHITECTURES = ["qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss", "deepseek2", "qwen35moe"]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_tiny_model_of_each_architecture_matches_the_f64_oracle(name, tmp_path):
    from leat import plugins
    from leat.testing import write_tiny_gguf

    entry = plugins.host().get("architectures", name)
    if entry is None:
        pytest.skip(f"no installed plugin serves {name}")
    path = str(write_tiny_gguf(entry.load(), tmp_path / f"tiny-{name}.gguf"))
    ids = list(range(1, 33))
    want = leat.load(path, backend="cpu", precision="f64").logits(ids, native=True)
    got = leat.load(path, backend="tinygrad").logits(ids)
    agreement = compare(want, got, label=f"{name}: tinygrad vs cpu f64")
    print(agreement)
    assert not agreement.failures(**BARS), f"{agreement}"
    assert agreement.mean_kl < 1e-9  # measured <= 1.5e-12


# decode steps replay under TinyJit (Backend.run), 0.5-0.9 s each here; 32 passes SmolLM2's end of text (step 29 of
# this prompt's continuation); see the README for the time this takes
GREEDY_TOKENS = 32


@pytest.mark.slow
def test_smollm2_greedy_matches_cpu():
    """SmolLM2's 32-token greedy continuation (past its end of text), decode steps replayed under TinyJit, is the
    CPU float64 oracle's: each token is the oracle's argmax after the tokens before it (one oracle pass over
    the whole continuation), up to the first near-tie."""
    from leat.engine import Engine, GenerationRequest

    try:
        oracle = leat.load("default", backend="cpu", precision="f64")
    except PullError as error:
        pytest.skip(f"SmolLM2 is not cached and could not be pulled: {error}")
    model = leat.load("default", backend="tinygrad")
    prompt = model.tokenize("The capital of France is")
    engine = Engine(model, batch_size=1, max_context=len(prompt) + GREEDY_TOKENS).start()
    try:
        events = list(engine.submit(GenerationRequest(prompt, GREEDY_TOKENS, GREEDY, ignore_eos=True)))
    finally:
        engine.stop()
    got = [t for e in events for t in e.ids]
    steps = oracle.logits(prompt + got, native=True)[len(prompt) - 1 : -1]
    want = np.argmax(steps, axis=-1).tolist()
    tie = first_near_tie(top2_gap(steps), DEFAULT_MIN_GAP)
    n = len(got) if tie is None else tie
    print(f"compared {n} of {len(got)} steps")
    assert len(got) == GREEDY_TOKENS and got[:n] == want[:n], f"compared {n} steps\ncpu f64:  {want}\ntinygrad: {got}"


# gemma3: sliding-window layers, two page groups (SmolLM2's test is llama's); qwen35: recurrent states, read and
# written per slot in the jitted decode steps (the bucket's padding rows among them) and padded prefill chunks
@pytest.mark.parametrize("name", ["gemma3", "qwen35"])
def test_engine_decode_under_tinyjit_matches_the_f64_oracle(name, tmp_path):
    """Three greedy requests decoded together by the engine: decode steps of 3 rows (padded to the bucket of
    4), and of fewer while the others prefill, replay a TinyJit per bucket after capturing it."""
    from leat import plugins
    from leat.engine import Engine, GenerationRequest
    from leat.testing import write_tiny_gguf

    entry = plugins.host().get("architectures", name)
    if entry is None:
        pytest.skip(f"no installed plugin serves {name}")
    path = str(write_tiny_gguf(entry.load(), tmp_path / f"tiny-{name}.gguf"))
    oracle, model = leat.load(path, backend="cpu", precision="f64"), leat.load(path, backend="tinygrad")
    prompts = [[5, 9, 13, 2, 7], [20, 21, 22, 23, 24], [3, 3, 3, 4, 4]]
    engine = Engine(model, batch_size=3, max_context=64, page_size=8, prefill_chunk=16).start()
    try:
        handles = [engine.submit(GenerationRequest(p, 6, GREEDY)) for p in prompts]
        outputs = [[t for e in handle for t in e.ids] for handle in handles]
        buckets = sorted(key[2] for key in model.backend._jits if isinstance(key[2], int))
    finally:
        engine.stop()
    assert 4 in buckets and [len(got) for got in outputs] == [6, 6, 6], (buckets, outputs)
    for prompt, got in zip(prompts, outputs):
        want = [t.id for t in oracle.generate(prompt, max_tokens=len(got), sampling=GREEDY) if t.id >= 0]
        steps = oracle.logits(prompt + want, native=True)[len(prompt) - 1 : -1]
        tie = first_near_tie(top2_gap(steps), DEFAULT_MIN_GAP)
        n = len(want) if tie is None else tie
        assert got[:n] == want[:n], f"{name}: compared {n} steps\ncpu f64:  {want}\ntinygrad: {got}"


GREEDY = {"temperature": 0}


def test_replayed_decode_steps_update_no_graph_node_and_a_new_input_shape_captures_anew(tmp_path):
    """A decode step's TinyJit gets only bound Variables: its inputs' buffers (tokens, positions, page rows) are
    captured as the weights are, so no kernel of its graphs has a buffer replaced at a replay, and the steps still
    read each step's tokens (the logits equal eager steps'). Where an input must be a new Tensor (another shape), the
    key's TinyJit is dropped, so no replay reads a buffer it no longer gets."""
    from leat.testing import write_tiny_gguf
    from leat_arch_llama.llama import Llama
    from tinygrad.engine.realize import get_call_arg_uops
    from tinygrad.uop.ops import Ops

    path = str(write_tiny_gguf(Llama, tmp_path / "tiny.gguf"))
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv, eager_kv = model.new_kv(32, slots=1, dtype="f32"), model.new_kv(32, slots=1, dtype="f32")
    ids = np.arange(3, 15)
    for cache in (kv, eager_kv):
        backend.to_host(backend.run(forward, Batch([Row(0, 0, ids[:4])]), cache))
    got, want = [], []
    for pos in range(4, 12):
        step = Batch([Row(0, pos, ids[pos : pos + 1])])
        got.append(backend.to_host(backend.run(forward, step, kv)))
        want.append(forward(step, eager_kv).numpy())
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), rtol=1e-4, atol=1e-4)
    key = next(k for k in backend._jits if k[1] == id(kv) and k[2] == 1)
    assert backend._jits[key].cnt > 2  # replayed
    captured = backend._jits[key].captured
    assert captured.expected_input_info == [] and captured.expected_names == []  # no Tensor argument
    calls = [c for c in captured.linear.toposort() if c.op is Ops.CALL and c.src[0].op is Ops.PROGRAM]
    assert calls and not [b for c in calls for b in get_call_arg_uops(c) if b.op is Ops.PARAM], "a buffer replaced"
    backend._input(key, 0, np.zeros(1, np.int32))  # the same shape: the buffer is written, the TinyJit stays
    assert key in backend._jits
    backend._input(key, 0, np.zeros(2, np.int32))
    assert key not in backend._jits


def test_to_host_copies_a_realized_buffer_out_and_any_other_tensor_as_numpy_does(backend):
    from tinygrad import Tensor

    values = np.arange(24, dtype=np.float32).reshape(2, 12)
    realized = Tensor(values).realize()
    np.testing.assert_array_equal(backend.to_host(realized.reshape(4, 6)), values.reshape(4, 6))
    np.testing.assert_array_equal(backend.to_host(realized[1:]), values[1:])  # a view: tinygrad's own copy
    np.testing.assert_array_equal(backend.to_host(realized * 2), values * 2)  # not realized yet


def test_prefill_chunks_of_a_jitted_length_replay_under_tinyjit(tmp_path, monkeypatch):
    """One-row prefill chunks of a length in ``prefill_lengths`` (the engine's full chunk, 512, by default) run
    under a TinyJit of their own: the first is captured, later ones at other positions and pages replay it.
    Every position's logits equal the CPU float64 oracle's; a chunk whose pages are not adjacent in storage runs
    eagerly, a shorter one replays one TinyJit padded to the jitted length."""
    monkeypatch.setenv("LEAT_TINYGRAD_PREFILL_JIT", "8")
    path = str(_tiny_models().build("q4_k-llama3", tmp_path / "tiny.gguf"))
    ids = np.arange(1, 41)
    want = leat.load(path, backend="cpu", precision="f64").logits(ids.tolist(), native=True)
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    assert backend.prefill_lengths == {8}
    layouts = model.architecture.kv_layouts(model.architecture.params)
    kv = backend.allocate_kv(layouts, slots=1, context=40, pages=10, page_size=4)
    backend.set_pages(kv, 0, np.array([0, 1, 2, 3, 4, 5, 7, 6, 8, 9]))  # positions 24-31 sit on pages 7 and 6
    got = []
    for start in range(0, 40, 8):
        out = backend.run(forward, Batch([Row(0, start, ids[start : start + 8], all_logits=True)]), kv)
        got.append(np.asarray(backend.to_host(out)))
    jits = {key: jit for key, jit in backend._jits.items() if key[2] == "prefill"}
    assert list(jits) == [(forward, id(kv), "prefill", 8, True)]
    assert next(iter(jits.values())).cnt == 5  # from 1: captured at position 0, replayed at 8, 16, 32 (24: eager)
    agreement = compare(want, np.concatenate(got), label="jitted prefill chunks vs cpu f64")
    print(agreement)
    assert not agreement.failures(**BARS) and agreement.mean_kl < 1e-9, f"{agreement}"
    assert not backend._one_run(kv, Row(0, 20, ids[:8])) and backend._one_run(kv, Row(0, 8, ids[:16]))
    # shorter chunks (a prompt's last) pad to the jitted length and replay one TinyJit whatever their length; the
    # padded rows' KV writes keep the storage rows after the chunk (the K/V of positions 37-39 written above)
    kept = [k[35:40].numpy() for k in kv.k]
    for length in (5, 3, 6):  # run as an eager step would, captured, replayed
        out = backend.to_host(backend.run(forward, Batch([Row(0, 32, ids[32 : 32 + length])]), kv))
        np.testing.assert_allclose(out, want[31 + length : 32 + length], rtol=1e-5, atol=1e-5)
    assert backend._jits[(forward, id(kv), "padded", 8, False)].cnt == 3
    assert all(np.array_equal(k[35:40].numpy(), before) for k, before in zip(kv.k, kept))


def _slots_beside_the_oracle(tmp_path: Path, ids: list[np.ndarray]):
    """A tiny Llama-3 Q4_K model on the tinygrad backend, one slot of ten 4-position pages per sequence of ``ids``
    (slots 0 and 2 prefilled with 8 tokens), and ``step(rows)``, which runs a batch through ``Backend.run`` and
    checks each row's logits (all of a draft's) against the CPU float64 oracle's, in the batch's order."""
    path = str(_tiny_models().build("q4_k-llama3", tmp_path / "tiny.gguf"))
    oracle = leat.load(path, backend="cpu", precision="f64")
    want = [oracle.logits(seq.tolist(), native=True) for seq in ids]
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    layouts = model.architecture.kv_layouts(model.architecture.params)
    kv = backend.allocate_kv(layouts, slots=len(ids), context=40, pages=10 * len(ids), page_size=4)
    for slot in range(len(ids)):
        backend.set_pages(kv, slot, np.arange(10 * slot, 10 * slot + 10))
    for slot in (0, 2):
        backend.run(forward, Batch([Row(slot, 0, ids[slot][:8])]), kv)

    def step(rows: list[Row]) -> None:
        out = np.asarray(backend.to_host(backend.run(forward, Batch(rows), kv)))
        end = [r.start + len(r.tokens) for r in rows]
        expected = [want[r.slot][r.start if r.all_logits else e - 1 : e] for r, e in zip(rows, end)]
        np.testing.assert_allclose(out, np.concatenate(expected), rtol=1e-5, atol=1e-5)

    return backend, forward, kv, step


def test_a_prompt_chunk_with_decode_rows_replays_under_tinyjit(tmp_path, monkeypatch):
    """A step of one-token rows and a prompt chunk (the engine's continuous batching) runs under a TinyJit per
    (chunk's padded length, decode bucket): run as an eager step would, captured, then replayed, whichever row the
    chunk is. Each decode row's logits and the chunk's last equal the CPU float64 oracle's."""
    monkeypatch.setenv("LEAT_TINYGRAD_PREFILL_JIT", "8")
    ids = [np.arange(1, 41), np.arange(41, 81), np.arange(7, 87, 2)]  # slots 0 and 2 decode, slot 1 prefills
    backend, forward, kv, step = _slots_beside_the_oracle(tmp_path, ids)

    def decoding(position: int) -> list[Row]:
        return [Row(slot, position, ids[slot][position : position + 1]) for slot in (0, 2)]

    start = 0
    for i, length in enumerate((6, 5, 7, 3)):  # the chunk last: eager, captured, replayed twice
        step([*decoding(8 + i), Row(1, start, ids[1][start : start + length])])
        start += length
    step([Row(1, 21, ids[1][21:26]), *decoding(12)])  # the chunk first: the same TinyJit, logits reordered
    assert backend._jits[(forward, id(kv), "mixed", 8, 2)].cnt == 5
    step([decoding(13)[0], Row(1, 26, ids[1][26:32])])  # one decode row: a bucket of its own (run eagerly first)
    assert (forward, id(kv), "mixed", 8, 1) in backend._jits


def test_several_prompt_chunks_and_drafts_run_as_jitted_parts(tmp_path, monkeypatch):
    """A batch that is no jitted form as a whole (two prompt chunks with decode rows; a row with a draft) runs as
    jitted steps one after the other: the decode rows with the first chunk, each other row alone. Every row's
    logits (all of a draft's) equal the CPU float64 oracle's, in the batch's order."""
    monkeypatch.setenv("LEAT_TINYGRAD_PREFILL_JIT", "8")
    ids = [np.arange(1 + 40 * slot, 41 + 40 * slot) % 200 for slot in range(4)]  # slots 0 and 2 decode, 1 and 3 prefill
    backend, forward, kv, step = _slots_beside_the_oracle(tmp_path, ids)

    start = 0
    for i, length in enumerate((6, 5, 7)):  # run as an eager step would, captured, replayed
        a, b = Row(1, start, ids[1][start : start + length]), Row(3, start, ids[3][start : start + length - 1])
        step([Row(0, 8 + i, ids[0][8 + i : 9 + i]), a, Row(2, 8 + i, ids[2][8 + i : 9 + i]), b])
        start += length
        step([Row(3, start - 1, ids[3][start - 1 : start])])  # slot 3 catches up to slot 1
    assert backend._jits[(forward, id(kv), "mixed", 8, 2)].cnt == 3
    assert backend._jits[(forward, id(kv), "padded", 8, False)].cnt == 3
    # a row with a draft (every position's logits) among decode rows: the decode rows a step, the draft's row another
    step([Row(0, 11, ids[0][11:12]), Row(1, 18, ids[1][18:21], all_logits=True), Row(2, 11, ids[2][11:12])])
    # two chunks alone: two replays of one TinyJit, the first's logits kept from the second's overwriting them
    step([Row(1, 21, ids[1][21:26]), Row(3, 18, ids[3][18:22])])


def test_a_q8_0_caches_padded_and_mixed_steps_replay_as_eager_steps_write(tmp_path, monkeypatch):
    """A q8_0 cache's short chunks, alone and with a decode row, replay their TinyJits too: the padded rows' quants and
    scales are masked writes that keep what the storage holds. Logits and every stored byte equal those of the same
    steps run eagerly (``forward`` itself) on a second cache."""
    monkeypatch.setenv("LEAT_TINYGRAD_PREFILL_JIT", "8")
    path = str(_tiny_models().build("q4_k-llama3", tmp_path / "tiny.gguf"))
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    layouts = model.architecture.kv_layouts(model.architecture.params)
    caches = [backend.allocate_kv(layouts, slots=2, context=40, pages=20, page_size=4, dtype="q8_0") for _ in range(2)]
    for kv in caches:
        backend.set_pages(kv, 0, np.arange(10))
        backend.set_pages(kv, 1, np.arange(10, 20))
    ids = np.arange(3, 83)
    steps = [[Row(0, 0, ids[:8])], [Row(1, 0, ids[40:48])]]
    steps += [[Row(0, 8 + i, ids[8 + i : 9 + i]), Row(1, 8 + 5 * i, ids[48 + 5 * i : 53 + 5 * i])] for i in range(3)]
    steps += [[Row(0, 11, ids[11:16])], [Row(0, 16, ids[16:19])], [Row(0, 19, ids[19:25])]]
    for rows in steps:
        jitted = np.asarray(backend.to_host(backend.run(forward, Batch(rows), caches[0])))
        eager = np.asarray(backend.to_host(forward(Batch(rows), caches[1])))
        np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-5)
    assert backend._jits[(forward, id(caches[0]), "mixed", 8, 1)].cnt == 3
    assert backend._jits[(forward, id(caches[0]), "padded", 8, False)].cnt == 3
    for got, want in zip(caches[0].storages(), caches[1].storages(), strict=True):
        assert np.array_equal(got.numpy(), want.numpy())


def test_qwen35_prefill_chunks_jitted_and_padded_continue_the_recurrent_state(tmp_path, monkeypatch):
    """Tiny Qwen3.5's prompt in chunks through run(), in slot 1: a jitted-length chunk captured at position 0 (its
    state from zeros) and replayed at 8 (continuing), then shorter chunks padded to 8 (run, captured, replayed;
    the padding tokens leave the state and the convolution's inputs as they were). The full chunks' every logits
    and the short ones' last against the CPU float64 oracle; a row that does not continue its slot's state is
    refused."""
    from leat import plugins
    from leat.errors import LeatError
    from leat.testing import write_tiny_gguf

    monkeypatch.setenv("LEAT_TINYGRAD_PREFILL_JIT", "8")
    entry = plugins.host().get("architectures", "qwen35")
    if entry is None:
        pytest.skip("no installed plugin serves qwen35")
    path = str(write_tiny_gguf(entry.load(), tmp_path / "tiny-qwen35.gguf"))
    ids = np.arange(1, 30)
    want = leat.load(path, backend="cpu", precision="f64").logits(ids.tolist(), native=True)
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv = backend.allocate_kv(model.architecture.kv_layouts(model.architecture.params), slots=2, context=32, page_size=4)
    got, positions = [], []
    for start, stop in [(0, 8), (8, 16), (16, 21), (21, 24), (24, 29)]:
        every = stop - start == 8  # the padded chunks' last logits (a shorter row wanting all is a draft: eager)
        out = backend.run(forward, Batch([Row(1, start, ids[start:stop], all_logits=every)]), kv)
        got.append(np.asarray(backend.to_host(out)).reshape(-1, want.shape[1]))
        positions += list(range(start, stop)) if every else [stop - 1]
    counts = {key[2]: jit.cnt for key, jit in backend._jits.items()}
    assert counts == {"prefill": 3, "padded": 3}, counts  # each captured once and replayed
    agreement = compare(want[positions], np.concatenate(got), label="qwen35 jitted and padded chunks vs cpu f64")
    print(agreement)
    assert not agreement.failures(**BARS) and agreement.mean_kl < 1e-9, f"{agreement}"
    assert all(taken[1] == 29 for *_, taken in kv.recurrent.values()) and len(kv.recurrent) == 3
    with pytest.raises(LeatError, match="cannot continue at position 20"):
        backend.run(forward, Batch([Row(1, 20, ids[:3])]), kv)


def test_gated_delta_net_rewinds_into_a_verified_draft(backend):
    """Verified drafts (rows wanting every position's logits) in slot 1, each followed by a row that starts inside
    it: a jitted decode step (run() rewinds before it) and a padded chunk. The inputs are rows of tables gathered by
    token id, as embed gathers on the device; every output as leat.deltanet.run gives for the tokens kept."""
    from leat.deltanet import DeltaNet, run

    rng = np.random.default_rng(5)
    channels, heads, d = 48, 2, 8
    net = DeltaNet(
        2, heads, d, rng.standard_normal((channels, 4)) * 0.5, rng.standard_normal(heads), -np.ones(heads), 1e-6
    )
    tables = [rng.standard_normal((15, width)) for width in (channels, heads, heads)]
    weights = [backend.upload(FileTensor(f"t{i}", Q.F32, t.shape, f32(t))) for i, t in enumerate(tables)]

    def forward(batch, kv):
        return backend.gated_delta_net(*(backend.embed(w, batch.tokens) for w in weights), net, kv, 0, batch)

    def want(ids):
        return run(net, *(t[ids] for t in tables), np.zeros((3, channels)), np.zeros((heads, d, d)))

    kv = backend.allocate_kv([KVLayout(1, 8)], slots=2, context=16, page_size=4)
    steps = [(0, [0, 1, 2, 3, 4], False), (5, [5, 6, 7, 8], True), (7, [9], False), (8, [10, 11, 12], True)]
    kept = [0, 1, 2, 3, 4, 5, 6, 9, 10, 13, 14]
    for start, ids, draft in steps + [(9, [13, 14], False)]:
        out = backend.run(forward, Batch([Row(1, start, np.array(ids), all_logits=draft)]), kv)
        got = np.asarray(backend.to_host(out))[: len(ids)]  # a padded chunk's step gives its padding rows too
        np.testing.assert_allclose(got, want(kept[:start] + ids)[start:], rtol=1e-4, atol=1e-5)
    assert (forward, id(kv), 1) in backend._jits and kv.recurrent[0][2][1] == 11 and not kv.drafts


def test_a_decode_step_that_routes_experts_runs_eagerly(backend):
    """MoE routing reads the router's logits on the host, which a TinyJit replay would freeze: run() finds out
    on the first decode step and runs that forward eagerly from then on."""
    from leat.moe import MoESpec, MoEWeights

    rng = np.random.default_rng(3)
    experts, d = 4, 8
    weights = MoEWeights(*(f32(rng.standard_normal(shape)) for shape in [(experts, d)] + [(experts, d, d)] * 3))
    kv = backend.allocate_kv([KVLayout(1, d)], slots=1, context=8, page_size=4)
    jitted = []

    def forward(batch, kv):
        jitted.append(backend._step is not None)
        return backend.moe(f32(np.eye(d)[batch.tokens % d]), weights, MoESpec(experts, 2, "softmax_selected"))

    for position in range(3):
        backend.run(forward, Batch([Row(0, position, np.array([position]))]), kv)
    assert jitted == [True, False, False, False] and forward in backend._eager


def test_a_jits_inputs_are_copied_into_the_tensors_it_captured(tmp_path):
    """A decode step's tokens, positions and page rows are copied into the same Tensors at every replay (a new
    Tensor a step cost tinygrad a schedule each): the replays at later positions, with other tokens and pages,
    still give the CPU float64 oracle's logits."""
    path = str(_tiny_models().build("q4_k-llama3", tmp_path / "tiny.gguf"))
    ids = np.arange(3, 15)
    want = leat.load(path, backend="cpu", precision="f64").logits(ids.tolist(), native=True)
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv = backend.allocate_kv(model.architecture.kv_layouts(model.architecture.params), 1, 16, 4, 4)
    backend.set_pages(kv, 0, np.array([2, 0, 3, 1]))  # pages out of storage order
    got, seen = [], []
    for pos in range(len(ids)):
        got.append(np.asarray(backend.to_host(backend.run(forward, Batch([Row(0, pos, ids[pos : pos + 1])]), kv))))
        seen.append({i: id(t) for inputs in backend._inputs.values() for i, (_, t) in inputs.items()})
    assert seen[1] == seen[-1] and {0, 1, 2} <= set(seen[-1])  # tokens, positions, the page rows
    agreement = compare(want, np.concatenate(got), label="replayed decode steps vs cpu f64")
    assert not agreement.failures(**BARS) and agreement.mean_kl < 1e-9, f"{agreement}"
