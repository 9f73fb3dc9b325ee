"""The quantized kernels against gguf-py's dequantization, float64 products, and the float64 oracle on tiny models."""

import gguf
import numpy as np
import pytest
from leat.modelfile import Tensor
from leat_backend_cpu import native
from leat_backend_cpu.backend import CPUBackend
from leat_backend_cpu.native import KERNEL_TYPES, QuantizedWeight

Q = gguf.GGMLQuantizationType
TYPES = sorted(KERNEL_TYPES, key=int)
gguf_quantize = gguf.quants.quantize  # the tiny-model test replaces it for the types gguf-py cannot quantize
# byte offsets of the f16 scales in a block of each type gguf-py cannot quantize (its dequantize_blocks' splits)
SCALE_OFFSETS = {
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason=f"{native.unavailable()}")


def valid_blocks(values: np.ndarray, qtype: Q, seed: int = 0) -> np.ndarray:
    """Stored bytes for a [rows, cols] tensor: gguf-py's quantization of ``values`` where it has one, else random
    blocks whose f16 scales (at SCALE_OFFSETS) are at most 2.5e-4, so that every value is finite and below about 1."""
    try:
        return gguf_quantize(values, qtype).view(np.uint8).reshape(values.shape[0], -1)
    except NotImplementedError:
        pass
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    count = values.size // block
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(0.2, 1, count) * rng.choice([-2.5e-4, 2.5e-4], count)
        blocks[:, offset : offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks.reshape(values.shape[0], -1)


def weight(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """A quantized weight and gguf-py's float64 values of it."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    stored = valid_blocks(values, qtype, seed)
    exact = gguf.quants.dequantize(stored, qtype).reshape(rows, cols).astype(np.float64)
    return QuantizedWeight(qtype, (rows, cols), stored), exact


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_decoded_blocks_equal_gguf_dequantize(qtype):
    w, exact = weight(qtype, 24, 512)
    np.testing.assert_array_equal(native.dequantize(w, threads=2), exact.astype(np.float32))
    ids = np.array([7, 0, 23, 7])
    np.testing.assert_array_equal(native.rows(w, ids, threads=2), exact[ids].astype(np.float32))


def rounded_activations(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x as the prompt GEMM rounds it, in float64: per 32 values q = rint(x * (r / max|x|)) in float32, times
    max|x| / r, for r = native.activation_range(qtype)."""
    r = np.float32(native.activation_range(qtype))
    blocks = x.reshape(len(x), -1, 32)
    peak = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        q = np.rint(blocks * np.where(peak > 0, r / peak, np.float32(0)))
    return (q.astype(np.float64) * (peak / r).astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 13, 40])  # decode rows (blocks decoded in registers), prompts (the int16 GEMM)
def test_products_follow_float64(qtype, n):
    w, exact = weight(qtype, 300, 768)  # 300 rows: the last 16-row panel is partial
    x = np.random.default_rng(1).standard_normal((n, 768)).astype(np.float32)
    integer = n > native.GEMV_ROWS or qtype in native.library().integer_gemv  # the GEMM's, or the integer GEMV's
    rounded = integer and native.library().has_gemm
    want = (rounded_activations(x, qtype) if rounded else x.astype(np.float64)) @ exact.T
    got = native.matmul(x, w, threads=2)
    assert got.dtype == np.float32 and got.shape == (n, 300)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
    # the rounding itself: 16 bits per 32 values, far inside the 8 bits of ggml's activations
    exact_product = x.astype(np.float64) @ exact.T
    np.testing.assert_allclose(got, exact_product, rtol=0, atol=1e-4 * np.abs(exact_product).max())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("k", [32, 96, 800])  # one group, three, 25: Q4_0, Q4_1 and Q5_0 decode groups in pairs
def test_decode_products_of_an_odd_number_of_groups_follow_float64(qtype, k):
    w, exact = weight(qtype, 37, k)
    x = np.random.default_rng(4).standard_normal((3, k)).astype(np.float32)
    rounded = native.library().has_gemm and qtype in native.library().integer_gemv
    want = (rounded_activations(x, qtype) if rounded else x.astype(np.float64)) @ exact.T
    for n in (1, 3):  # one token, and a tile of two then one
        got = native.matmul(x[:n], w, threads=2)
        np.testing.assert_allclose(got, want[:n], rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=f"{n} tokens")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("k", [256, 2304])  # one block (two sets of four groups), nine
def test_k_quant_decode_products_follow_float64(qtype, k):
    """Q4_K's and Q6_K's decode products: on AVX-512 VBMI and AVX2 the integer path (igemvb_, which takes four groups
    a step on AVX-512), on the rounded x; a tile of four tokens and one alone, every scale and min bit random."""
    w, exact = weight(qtype, 70, k, seed=5)
    x = np.random.default_rng(6).standard_normal((5, k)).astype(np.float32) * np.geomspace(
        1e-3, 10, k, dtype=np.float32
    )
    integer = native.library().has_gemm and qtype in native.library().integer_gemv
    assert integer == native.library().has(f"igemvb_{qtype.name.lower()}")
    want = (rounded_activations(x, qtype) if integer else x.astype(np.float64)) @ exact.T
    got = native.matmul(x, w, threads=2)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.skipif(" avx2" not in native._cpu_flags(), reason="the AVX2 build runs on a CPU with AVX2 only")
def test_the_avx2_build_keeps_decode_rows_independent_of_the_batch(monkeypatch, tmp_path):
    """The kernels as a CPU with AVX2 and no AVX-512 gets them (-march=x86-64-v3; on this machine built with its own
    compiler, cc where it has AVX-512): Q4_K's and Q6_K's decode products (AVX2's igemvb_) give a token's row the bits
    it gets alone, and follow float64 on the rounded x. GCC summed a row's lanes in another order for some tiles here
    until igemv_sum kept its order."""
    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in native.FLAGS)
    monkeypatch.setattr(native, "FLAGS", flags)
    monkeypatch.setenv("LEAT_HOME", str(tmp_path))
    monkeypatch.setenv("LEAT_CPU_CTYPES", "1")
    native.library.cache_clear()
    try:
        assert native.library().has("igemvb_q4_k") and not native.library().has("igemvb_q4_0")  # AVX2's, not VBMI's
        for qtype in (Q.Q4_K, Q.Q6_K):
            x, alone, exact = decode_rows_alone_and_batched(qtype)
            want = rounded_activations(x, qtype) @ exact.T
            np.testing.assert_allclose(alone, want, rtol=0, atol=2e-6 * np.abs(want).max())
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("qtype, n", [(Q.Q4_K, 30), (Q.Q4_1, native.GEMV_ROWS)])  # the GEMM, the integer GEMV
def test_product_rows_do_not_depend_on_the_batch_or_threads(qtype, n):
    if n > native.GEMV_ROWS and not native.library().has_gemm:
        # float32 tiles through BLAS, whose rows do depend on the batch (OpenBLAS blocks by it): an AVX2-only CPU
        # (this test's first failure: a CI machine without AVX-512 VNNI, rows 2.6e-6 apart)
        pytest.skip("no AVX-512 VNNI here: a prompt's products go to BLAS, which promises no batch invariance")
    w, _ = weight(qtype, 200, 512)
    x = np.random.default_rng(2).standard_normal((n, 512)).astype(np.float32)
    x[7, 3] = np.nan
    together = native.matmul(x, w, threads=2)
    assert np.isnan(together[7]).all() and not np.isnan(np.delete(together, 7, axis=0)).any()
    np.testing.assert_array_equal(native.matmul(x[::-1], w, threads=1)[::-1], together)
    np.testing.assert_array_equal(native.matmul(x[:10], w, threads=2), together[:10])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_decode_products_of_a_few_tokens_equal_each_token_alone(qtype):
    """The GEMV decodes a row's blocks once for up to GEMV_TILE tokens: each token's row of the product is the one it
    gets alone, bit for bit, whichever tile (4, 2 or 1 tokens) it falls in."""
    decode_rows_alone_and_batched(qtype)


def decode_rows_alone_and_batched(qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asserts that each of GEMV_ROWS tokens' decode rows, in batches of 2..GEMV_ROWS, equal the rows it gets alone;
    returns x, those rows alone and the weight's float64 values."""
    w, exact = weight(qtype, 40, 512)
    x = np.random.default_rng(3).standard_normal((native.GEMV_ROWS, 512)).astype(np.float32)
    alone = np.concatenate([native.matmul(x[i : i + 1], w, threads=1) for i in range(len(x))])
    for n in range(2, native.GEMV_ROWS + 1):
        np.testing.assert_array_equal(native.matmul(x[:n], w, threads=2), alone[:n], err_msg=f"{qtype.name} {n}")
    return x, alone, exact


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activations_over_the_float32_range(gelu):
    """silu(g) * u and the tanh GELU, 16 lanes at a time through the vectorised exp, against float64."""
    g = np.concatenate([np.linspace(-120, 120, 40001), [0.0, -0.0, np.inf, -np.inf, np.nan]]).astype(np.float32)
    u = np.random.default_rng(4).uniform(-3, 3, g.size).astype(np.float32)
    got = native.gated(g, u, gelu).astype(np.float64)
    x = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        e = -1.5957691216057308 * (x + 0.044715 * x**3) if gelu else -x
        want = x / (1 + np.exp(e)) * u
    finite = np.isfinite(want)
    # the float32 argument of exp carries a relative error of |e| * 6e-8 into the result
    rtol = 2e-6 + 1.2e-7 * np.abs(np.nan_to_num(e[finite]))
    np.testing.assert_array_less(np.abs(got[finite] - want[finite]), rtol * np.abs(want[finite]) + 1e-30)
    assert np.isnan(got[~finite]).all() == np.isnan(want[~finite]).all()


def test_decode_rows_do_not_depend_on_the_batch_or_threads():
    w, _ = weight(Q.Q4_K, 200, 512)
    x = np.random.default_rng(2).standard_normal((5, 512)).astype(np.float32)
    together = native.matmul(x, w, threads=2)
    alone = np.concatenate([native.matmul(x[i : i + 1], w, threads=1) for i in range(5)])
    np.testing.assert_array_equal(together, alone)


def test_rows_out_of_range_are_an_error():
    w, _ = weight(Q.Q8_0, 4, 64)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        native.rows(w, np.array([4]), threads=1)


def test_upload_keeps_the_file_blocks():
    stored = valid_blocks(np.ones((8, 256), np.float32), Q.Q4_1)
    backend = CPUBackend("f32")
    uploaded = backend.upload(Tensor("w", Q.Q4_1, (8, 256), stored))
    assert isinstance(uploaded, QuantizedWeight) and np.shares_memory(uploaded.blocks, stored)
    assert backend.allocations.weights == stored.nbytes
    reference = CPUBackend("f32", weights="dequantized").upload(Tensor("w", Q.Q4_1, (8, 256), stored))
    assert isinstance(reference, np.ndarray) and reference.dtype == np.float32


def test_weight_bytes_before_loading_equal_what_upload_keeps():
    """What ``leat doctor`` states for the cpu backend: the file's blocks for 2-D and 3-D weights (an expert stack) of
    the kernels' types, float32 for the rest (a 1-D f16 norm, an f16 matrix), as the uploads count them."""
    rng = np.random.default_rng(0)
    tensors = [
        Tensor("w", Q.Q4_1, (8, 256), valid_blocks(rng.standard_normal((8, 256)).astype(np.float32), Q.Q4_1)),
        Tensor("norm", Q.F16, (256,), rng.standard_normal(256).astype(np.float16)),
        Tensor("experts", Q.Q8_0, (2, 4, 64), valid_blocks(rng.standard_normal((8, 64)).astype(np.float32), Q.Q8_0)),
        Tensor("f16", Q.F16, (4, 32), rng.standard_normal((4, 32)).astype(np.float16)),
    ]
    backend = CPUBackend("f32")
    for tensor in tensors:
        backend.upload(tensor)
    kept = 8 * 256 * 20 // 32 + 2 * 4 * 64 * 34 // 32 + 4 * (256 + 128)
    assert CPUBackend.weight_bytes(tensors) == backend.allocations.weights == kept


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.Q5_0, Q.Q4_K], ids=lambda q: q.name)  # gpt-oss's, the integer GEMV's
def test_experts_stay_as_the_file_blocks(qtype):
    """A MoE layer's 3-D expert stacks and MLA's per-head matrices are kept as the file's blocks, and moe and head_matmul
    multiply them as dense products do, prompt (GEMM) and decode (GEMV) rows alike: against the same weights
    dequantized (float64 products through the activations' rounding, as test_products_follow_float64 checks)."""
    from leat.moe import MoESpec, MoEWeights

    experts, d, ffn = 4, 256, 512
    rng = np.random.default_rng(5)
    shapes = {"gate": (experts, ffn, d), "up": (experts, ffn, d), "down": (experts, d, ffn)}
    tensors = {
        name: Tensor(name, qtype, shape, valid_blocks(rng.standard_normal((shape[0] * shape[1], shape[2])), qtype))
        for name, shape in shapes.items()
    }
    quantized, reference = CPUBackend("f32"), CPUBackend("f64")
    kept = {name: quantized.upload(tensor) for name, tensor in tensors.items()}
    assert all(isinstance(w, native.QuantizedStack) for w in kept.values())
    assert np.shares_memory(kept["gate"][3].blocks, tensors["gate"].data)
    assert quantized.allocations.weights == sum(t.data.nbytes for t in tensors.values())
    router = rng.standard_normal((experts, d)).astype(np.float32)
    spec = MoESpec(experts, 2, "softmax", normalize=True)
    for n in (3, 20):  # decode and prompt rows
        x = rng.standard_normal((n, d)).astype(np.float32)
        got = quantized.moe(x, MoEWeights(router, kept["gate"], kept["up"], kept["down"]), spec)
        exact = {name: reference.upload(tensor) for name, tensor in tensors.items()}
        want = reference.moe(x.astype(np.float64), MoEWeights(router, exact["gate"], exact["up"], exact["down"]), spec)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        heads = rng.standard_normal((n, experts, ffn)).astype(np.float32)  # times "down" as per-head [d, ffn]
        want = reference.head_matmul(heads.astype(np.float64), exact["down"])
        np.testing.assert_allclose(quantized.head_matmul(heads, kept["down"]), want, atol=1e-4 * np.abs(want).max())


def test_options():
    assert CPUBackend("f32", threads=3).describe() == {
        "backend": "cpu",
        "precision": "f32",
        "threads": 3,
        "weights": "quantized",
    }
    assert "weights" not in CPUBackend("f64").describe()
    with pytest.raises(ValueError, match="weights"):
        CPUBackend("f64", weights="quantized")
    with pytest.raises(ValueError, match="threads"):
        CPUBackend("f32", threads=-1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_tiny_llama_agrees_with_the_float64_oracle(qtype, tmp_path, monkeypatch):
    """A tiny random llama with every matrix in ``qtype``: the quantized path's logits against float64's."""
    from leat.compare import compare
    from leat.model import Model
    from leat.modelfile import ModelFile
    from leat.testing import write_tiny_gguf

    llama = pytest.importorskip("leat_arch_llama.llama").Llama
    params = llama.tiny(width=256, ffn=512, heads=4, kv_heads=2, head_dim=64)  # rows that hold 256-value blocks
    monkeypatch.setattr(gguf.quants, "quantize", valid_blocks)
    path = write_tiny_gguf(llama, tmp_path / f"tiny-{qtype.name}.gguf", qtype, params=params)
    tokens = np.random.default_rng(0).integers(0, params.vocab, 40)

    def logits(backend):
        file = ModelFile(path)
        model = Model(file, llama(file, backend), backend)
        return model.logits(tokens, native=True).astype(np.float64)

    fast = CPUBackend("f32")
    reference, other = logits(CPUBackend("f64")), logits(fast)
    assert fast.allocations.by_type.get(qtype.name), "no weight was kept quantized"
    agreement = compare(reference, other, label=f"cpu quantized vs f64 on {qtype.name}")
    failures = agreement.failures(top1=0.99, kl=1e-3)
    assert not failures, f"{agreement}: {'; '.join(failures)}"


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "sinks"])
def test_native_attention_follows_float64(kv_dtype, variant):
    """Two sequences through a paged cache, a prefill and then mixed steps: the C attention (the quantized path's,
    for head dimensions that are multiples of 16) against the float64 oracle storing the same KV dtype."""
    from leat.backend import KVLayout
    from leat.batch import Batch, Row

    heads, kv_heads, dim, scale = 6, 2, 32, 0.2
    layout = KVLayout(kv_heads, dim, window=21 if variant == "window" else None)
    rng = np.random.default_rng(3)
    seqs = {s: [rng.standard_normal((40, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    sinks = rng.standard_normal(heads)
    # up to 39 keys: blocks of 16 keys and the rest one by one
    steps = [[(0, 0, 7), (1, 0, 5)], [(1, 5, 1), (0, 7, 30)], [(0, 37, 1), (1, 6, 20)], [(0, 38, 1), (1, 26, 1)]]
    outputs = {}
    for backend in (CPUBackend("f32"), CPUBackend("f64")):
        kv = backend.allocate_kv([layout], slots=2, context=40, page_size=4, dtype=kv_dtype)
        kv.tables[0][:] = np.random.default_rng(5).permutation(20).reshape(2, 10)  # pages out of order
        got = []
        for spans in steps:
            batch = Batch([Row(s, a, np.zeros(n, np.int64), all_logits=True) for s, a, n in spans])
            q, k, v = (
                np.concatenate([seqs[s][i][a : a + n] for s, a, n in spans]).astype(backend.dtype) for i in range(3)
            )
            if variant == "softcap":
                got.append(backend.attention(q, k, v, kv, 0, batch, scale, softcap=0.5))
            elif variant == "sinks":
                got.append(backend.attention(q, k, v, kv, 0, batch, scale, sinks=sinks.astype(backend.dtype)))
            else:
                got.append(backend.attention(q, k, v, kv, 0, batch, scale))
        outputs[backend.precision] = np.concatenate(got).astype(np.float64)
    np.testing.assert_allclose(outputs["f32"], outputs["f64"], rtol=0, atol=2e-5)


def test_many_small_products_from_two_threads_finish():
    """The thread pool (more threads than cores) under back-to-back jobs from two Python threads (a late worker must not take from the next
    job: that lost rows and hung). In a subprocess, so that a hang fails the test instead of stalling the run."""
    import subprocess
    import sys

    script = """
import threading, numpy as np, gguf
from leat_backend_cpu import native
Q = gguf.GGMLQuantizationType
values = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
w = native.QuantizedWeight(Q.Q8_0, (64, 256), gguf.quants.quantize(values, Q.Q8_0))
x = np.ones((1, 256), np.float32)
want = native.matmul(x, w, 1)
def hammer():
    for _ in range(3000):
        assert np.array_equal(native.matmul(x, w, 8), want)
threads = [threading.Thread(target=hammer) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print("done")
"""
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr


def test_direct_calls_equal_ctypes_calls():
    """kernels/call.c's entry (arguments straight from the arrays) against ctypes (addresses) on the same library."""
    direct = native.library()
    if not direct.direct:
        pytest.skip("the kernels were built without Python's headers: every call goes through ctypes")
    through_ctypes = native.Kernels(direct.path, direct=False)
    w, _ = weight(Q.Q4_1, 40, 256)
    x = np.random.default_rng(3).standard_normal((20, 256)).astype(np.float32)
    for n, kind in ((2, "gemv"), (20, "gemm" if direct.has_gemm else "gemv")):
        outs = [np.full((n, 40), np.nan, np.float32) for _ in range(2)]
        args = (w.address, 40, 256, x[:n], n) + ((32767,) if kind == "gemm" else ())
        for kernels, out in zip((direct, through_ctypes), outs, strict=True):
            kernels.entry(f"{kind}_q4_1")(*args[:5], out, *args[5:], 2)
        assert not np.isnan(outs[0]).any()
        np.testing.assert_array_equal(outs[0], outs[1])
    norms = [np.empty_like(x) for _ in range(2)]
    for kernels, out in zip((direct, through_ctypes), norms, strict=True):
        kernels.entry("rms_norm")(x, None, out, 20, 256, 1e-5)
    np.testing.assert_array_equal(norms[0], norms[1])
    np.testing.assert_allclose(norms[0], x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True)), rtol=1e-5)
    with pytest.raises((ValueError, BufferError)):  # a strided view has no C-contiguous buffer
        direct.entry("rms_norm")(x[:, ::2], None, norms[0], 20, 128, 1e-5)
    with pytest.raises(TypeError, match="signature"):
        direct._call(0, "ppp", x, x, x)


def test_kernels_fall_back_to_ctypes_when_the_python_entry_does_not_build(monkeypatch):
    built = native.library().path  # already in the cache: loads through ctypes as well
    builds = []

    def build(compiler, source, flags):
        builds.append(any(flag.startswith("-I") for flag in flags))
        if builds[-1]:
            raise OSError("cc could not build the quantized kernels: Python.h: no such file")
        return built

    monkeypatch.setattr(native, "_python_headers", lambda: "/nowhere")
    monkeypatch.setattr(native, "_build", build)
    native.library.cache_clear()
    try:
        kernels = native.library()
        assert builds == [True, False] and not kernels.direct
        w, exact = weight(Q.Q8_0, 8, 64)
        x = np.ones((1, 64), np.float32)
        y = np.empty((1, 8), np.float32)
        kernels.entry("gemv_q8_0")(w.address, 8, 64, x, 1, y, 1)
        np.testing.assert_allclose(y[0], exact.sum(axis=1), rtol=1e-5)
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize(
    ("cc", "machine", "flags", "expected"),
    [
        ("gcc-13", "x86_64", "fpu avx2 avx512f", "/usr/bin/gcc-13"),  # $CC always wins
        (None, "x86_64", "fpu avx2 f16c", "/usr/bin/clang"),  # AVX2 only: clang
        (None, "x86_64", "fpu avx2 avx512f avx512bw", "/usr/bin/cc"),  # AVX-512: cc
        (None, "aarch64", "", "/usr/bin/cc"),  # not x86: cc
    ],
)
def test_the_compiler_is_cc_clang_without_avx512_or_cc(monkeypatch, cc, machine, flags, expected):
    """Which C compiler builds the kernels: ``$CC``; else clang on an x86 CPU without AVX-512 (GCC's code for the
    16-float vectors on AVX2 is several times slower); else ``cc``."""
    if cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(native.platform, "machine", lambda: machine)
    monkeypatch.setattr(native, "_cpu_flags", lambda: f"flags\t\t: {flags}\n")
    monkeypatch.setattr(native.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert native._compiler() == expected
    monkeypatch.setattr(native.shutil, "which", lambda name: None if name == "clang" else f"/usr/bin/{name}")
    assert native._compiler() == (expected if expected != "/usr/bin/clang" else "/usr/bin/cc")  # no clang: cc
