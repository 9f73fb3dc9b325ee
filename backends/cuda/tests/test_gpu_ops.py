"""Every CUDA op against the float64 oracle (the CPU backend in f64), on fresh random inputs.

The device backend runs with ``poison=True``: every activation buffer starts as NaN, so an
element a kernel fails to write shows up as a NaN in the comparison.
"""

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout, RopeSpec
from leat.batch import Batch, Row
from leat.modelfile import Tensor
from leat.testing import relative_error
from leat_backend_cuda import quants

pytestmark = pytest.mark.gpu
Q = gguf.GGMLQuantizationType
KERNEL_TYPES = sorted(quants.LAYOUTS, key=int)
# byte offset of the f16 scale fields (d, and dmin where present) of types gguf-py cannot quantize
SCALES = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    **{q: (0,) for q in (Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_S, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S)},
}


def stored(qtype: Q, rows: int, cols: int, rng, sane: bool = True) -> np.ndarray:
    """GGUF bytes of a [rows, cols] tensor: quantized random data, or random blocks with small scales."""
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == Q.F32:
        return values.view(np.uint8)
    if qtype == Q.BF16:
        return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(rows, -1)
    try:
        return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(rows, -1)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        if sane:
            scale = rng.uniform(0.002, 0.02, len(data)).astype(np.float16).view(np.uint16)
            for offset in SCALES.get(qtype, ()):
                data[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
            if qtype == Q.IQ1_M:  # d's four nibbles are the top nibbles of the four u16 scale words (bytes 48-55)
                words = data[:, 48:56].copy().view(np.uint16)
                nibbles = (scale[:, None] >> np.array([0, 4, 8, 12], np.uint16)) & 0xF
                data[:, 48:56] = (words & 0x0FFF | nibbles << 12).astype(np.uint16).view(np.uint8)
        return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_dequantize_equals_gguf_bit_for_bit(cuda, qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 5, 512
    data = stored(qtype, rows, cols, rng, sane=False)
    weight = cuda.upload(Tensor("w", qtype, (rows, cols), data))
    want = gguf.quants.dequantize(data, qtype).reshape(rows, cols)
    got = cuda.to_host(cuda.dequantize(weight))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", [q for q in KERNEL_TYPES if quants.LAYOUTS[q].planes], ids=lambda q: q.name)
def test_upload_splits_planes_on_the_device_as_device_bytes(cuda, qtype):
    rng = np.random.default_rng(50 + int(qtype))
    data = stored(qtype, 7, 512, rng, sane=False)
    weight = cuda.upload(Tensor("w", qtype, (7, 512), data))
    got = np.empty(weight.memory.nbytes, np.uint8)
    cuda.device.download(got, weight.ptr)
    np.testing.assert_array_equal(got, quants.device_bytes(qtype, data))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_embed_rows_equal_gguf(cuda, qtype):
    rng = np.random.default_rng(100 + int(qtype))
    data = stored(qtype, 40, 256, rng, sane=False)
    weight = cuda.upload(Tensor("token_embd.weight", qtype, (40, 256), data))
    tokens = np.array([3, 39, 0, 3, 17])
    want = gguf.quants.dequantize(data, qtype).reshape(40, 256)[tokens]
    np.testing.assert_array_equal(cuda.to_host(cuda.embed(weight, tokens)), want)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 33, 64, 70])
def test_matmul(cuda, oracle, qtype, n):
    rng = np.random.default_rng(1000 * int(qtype) + n)
    cols = 768 if quants.LAYOUTS[qtype].block == 256 else 96  # 96: the GEMM's 32-wide K steps
    rows = 75  # not a multiple of any tile
    data = stored(qtype, rows, cols, rng)
    weight = cuda.upload(Tensor("w", qtype, (rows, cols), data))
    bias = rng.standard_normal(rows)
    x = rng.standard_normal((n, cols))
    want = oracle.matmul(x, oracle.upload(Tensor("w", qtype, (rows, cols), data)), bias)
    got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), weight, cuda_array(cuda, bias)))
    # float weights, few tokens: float32 throughout; quantized weights, few tokens: x rounded to int16
    # per run of 8 or 16 values; otherwise gemm_few or the GEMM: f16 operands, float32 accumulation
    if not quants.LAYOUTS[qtype].integer and n <= quants.GEMV_MAX_TOKENS:
        bound = 2e-6
    elif quants.LAYOUTS[qtype].integer and n <= min(quants.GEMV_Q_MAX_TOKENS, cuda.few_tokens[0] - 1):
        bound = 2e-4  # the types with mins subtract two sums: the rounding of x shows a little more
    else:
        bound = 2e-3
    assert relative_error(got, want) < bound


def gate_and_up(cuda, oracle, qtype: Q, rows: int, cols: int, rng):
    """Two random matrices of one type and shape (a gated unit's gate and up), on the GPU and in the oracle."""
    data = [stored(qtype, rows, cols, rng) for _ in range(2)]
    on_gpu = [cuda.upload(Tensor(name, qtype, (rows, cols), d)) for name, d in zip("gu", data)]
    in_oracle = [oracle.upload(Tensor(name, qtype, (rows, cols), d)) for name, d in zip("gu", data)]
    return on_gpu[0], on_gpu[1], in_oracle[0], in_oracle[1]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_every_gemv_q_instantiation(cuda, oracle, qtype, monkeypatch):
    """Each gemv_q the backend compiles (tokens, rows a warp, units in flight, mode; the split shapes of
    LEAT_CUDA_GEMV_SPLIT=1 too), and the pipelined loop of each (GEMV_Q_PIPE) and the split over K of each one-token
    shape (GEMV_Q_SPLIT), its shape forced through quants.gemv_q_shape: plain with a bias, the RMS norm inside, the
    gated unit, both; rows not a multiple of any group and long enough for several steps a lane; against the float64
    products, and the pipelined loop equal to the plain one bit for bit (the same sums in the same order; the split's
    are in another order)."""
    assert quants.LAYOUTS[qtype].integer  # products of one token go through gemv_q
    pipe, split = quants.GEMV_Q_PIPE, quants.GEMV_Q_SPLIT
    # (the ROPE twins write the cache: test_gpu_model.py's test_rope_epilogue_equals_rope_kv_write)
    # with the split shapes the rule gives (GEMV_Q_SPLIT_VARIANTS, kept apart from GEMV_Q_VARIANTS)
    variants = [
        (t, r, u, m)
        for t, r, u, m in (*quants.GEMV_Q_VARIANTS, *quants.GEMV_Q_SPLIT_VARIANTS)
        if not m & quants.GEMV_Q_ROPE
    ]
    plain = tuple(dict.fromkeys((t, r, u, m & ~(pipe | split)) for t, r, u, m in variants))
    pipelined = tuple((t, r, u, m | pipe) for t, r, u, m in plain)
    splits = tuple((t, r, u, m | split) for t, r, u, m in plain if t == 1)
    monkeypatch.setattr(quants, "GEMV_Q_VARIANTS", plain + pipelined + splits)
    monkeypatch.setattr(cuda, "_modules", {})  # the type's kernels compiled again, with the pipelined ones
    rng = np.random.default_rng(6000 + int(qtype))
    cols = 2304 if quants.LAYOUTS[qtype].block == 256 else 2336
    rows = 75
    gate, up, ref_gate, ref_up = gate_and_up(cuda, oracle, qtype, rows, cols, rng)
    bias, norm_weight = rng.standard_normal(rows), rng.standard_normal(cols)
    monkeypatch.setattr(cuda, "few_tokens", (1 << 30, 1 << 30))  # gemv_q for every token count it has
    for tokens, r, u, mode in plain:
        x = rng.standard_normal((tokens, cols)) * 3
        results = []
        for variant in (0, pipe) + ((split,) if (tokens, r, u, mode | split) in splits else ()):
            monkeypatch.setattr(quants, "gemv_q_shape", lambda *_, shape=(r, u, variant): shape)
            x_in = cuda_array(cuda, x)
            if mode & quants.GEMV_Q_NORM:
                x_in = cuda.rms_norm(x_in, cuda_array(cuda, norm_weight), 1e-5)
            if mode & quants.GEMV_Q_GLU:
                got = cuda.silu_mul(cuda.matmul(x_in, gate), cuda.matmul(x_in, up))
            else:
                got = cuda.matmul(x_in, gate, cuda_array(cuda, bias))
            results.append(cuda.to_host(got))
        ref = oracle.rms_norm(x, norm_weight, 1e-5) if mode & quants.GEMV_Q_NORM else x
        if mode & quants.GEMV_Q_GLU:
            want = oracle.silu_mul(oracle.matmul(ref, ref_gate), oracle.matmul(ref, ref_up))
        else:
            want = oracle.matmul(ref, ref_gate, bias)
        for got in results:
            assert relative_error(got, want) < 3e-4, (tokens, r, u, mode)
        np.testing.assert_array_equal(results[1], results[0])


@pytest.mark.parametrize(
    "qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q3_K, Q.F16, Q.IQ4_NL, Q.IQ2_XXS], ids=lambda q: q.name
)
def test_gemm_few_over_long_rows_and_row_tiles(cuda, oracle, qtype):
    """gemm_few (3-32 tokens): rows long enough that each warp takes several steps, the last step
    partial (units not a multiple of 4), every instantiation that covers the tokens (one or two row tiles),
    rows not a multiple of 16 or of 32."""
    rng = np.random.default_rng(3000 + int(qtype))
    cols = 2304 if quants.LAYOUTS[qtype].block == 256 else 2336
    rows = 200
    data = stored(qtype, rows, cols, rng)
    weight = cuda.upload(Tensor("w", qtype, (rows, cols), data))
    reference = oracle.upload(Tensor("w", qtype, (rows, cols), data))
    bias = rng.standard_normal(rows)
    saved = cuda.few_tokens, cuda.few_shape, cuda.cublas_min_tokens_f16, cuda.wg_tokens
    try:
        cuda.few_tokens = (1, quants.GEMM_FEW_MAX_TOKENS)
        cuda.cublas_min_tokens_f16 = 1 << 30  # gemm_few even where the weight has an f16 copy
        cuda.wg_tokens = (1, 0)  # and not gemm_wg (Hopper)
        for n in (1, 6, 16, 24, 32):
            x = rng.standard_normal((n, cols)) * np.logspace(-3, 3, n)[:, None]
            want = oracle.matmul(x, reference, bias)
            for shape in [v for v in quants.GEMM_FEW_VARIANTS if 8 * v[0] >= n]:
                cuda.few_shape = shape
                got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), weight, cuda_array(cuda, bias)))
                for t in range(n):
                    assert relative_error(got[t], want[t]) < 2e-3, (n, shape, t)
    finally:
        cuda.few_tokens, cuda.few_shape, cuda.cublas_min_tokens_f16, cuda.wg_tokens = saved


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.IQ4_XS, Q.F16], ids=lambda q: q.name)
def test_gemm_rows_over_token_tiles_and_splits(cuda, oracle, qtype):
    """gemm_rows (33-128 tokens): every instantiation, one and several token tiles (blockIdx.z), K whole and split
    into partial sums, rows not a multiple of a block's, against the float64 product with a bias."""
    rng = np.random.default_rng(5000 + int(qtype))
    rows, cols = 200, 2304
    data = stored(qtype, rows, cols, rng)
    weight = cuda.upload(Tensor("w", qtype, (rows, cols), data))
    reference = oracle.upload(Tensor("w", qtype, (rows, cols), data))
    bias = rng.standard_normal(rows)
    saved = cuda.rows_tokens, cuda.rows_shape, cuda.rows_blocks
    try:
        cuda.rows_tokens = (33, 128)
        for n in (33, 64, 100):
            x = rng.standard_normal((n, cols)) * np.logspace(-3, 3, n)[:, None]
            want = oracle.matmul(x, reference, bias)
            for shape in quants.GEMM_ROWS_VARIANTS:
                for blocks in (1, 1000):  # K whole; split into its 9 chunks
                    cuda.rows_shape, cuda.rows_blocks = shape, blocks
                    got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), weight, cuda_array(cuda, bias)))
                    for t in range(n):
                        assert relative_error(got[t], want[t]) < 2e-3, (n, shape, blocks, t)
    finally:
        cuda.rows_tokens, cuda.rows_shape, cuda.rows_blocks = saved


@pytest.mark.parametrize(
    "qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q8_0, Q.Q4_0, Q.IQ4_XS, Q.F16], ids=lambda q: q.name
)
def test_gemm_wg_over_token_tiles_and_splits(cuda, oracle, qtype):
    """gemm_wg (Hopper's wgmma, 9-64 tokens): every token tile (16, 32, 64), tokens that fill a tile and that do
    not, rows not a multiple of a block's 128, K whole and split into partial sums, against the float64 product
    with a bias."""
    if cuda.device.arch != "sm_90":
        pytest.skip(f"gemm_wg runs on sm_90 only, not {cuda.device.arch}")
    rng = np.random.default_rng(8000 + int(qtype))
    rows, cols = 200, 2304
    data = stored(qtype, rows, cols, rng)
    weight = cuda.upload(Tensor("w", qtype, (rows, cols), data))
    reference = oracle.upload(Tensor("w", qtype, (rows, cols), data))
    bias = rng.standard_normal(rows)
    saved = cuda.wg_tokens, cuda.wg_blocks
    try:
        cuda.wg_tokens = (9, 64)
        for n in (9, 16, 17, 33, 64):
            x = rng.standard_normal((n, cols)) * np.logspace(-3, 3, n)[:, None]
            want = oracle.matmul(x, reference, bias)
            for blocks in (1, 1000):  # K whole; split into its 9 chunks
                cuda.wg_blocks = blocks
                got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), weight, cuda_array(cuda, bias)))
                for t in range(n):
                    assert relative_error(got[t], want[t]) < 2e-3, (n, blocks, t)
    finally:
        cuda.wg_tokens, cuda.wg_blocks = saved


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.IQ4_XS, Q.F16], ids=lambda q: q.name)
def test_gated_unit_in_one_gemm_few_launch(cuda, oracle, qtype):
    """silu(x gate^T) * (x up^T) for 3-32 tokens: gate and up in one gemm_few launch (x read once for both) for every
    instantiation, against the float64 products; the fused launch really replaced the two products."""
    from leat_backend_cuda.backend import Pending

    rng = np.random.default_rng(4000 + int(qtype))
    cols = 2304 if quants.LAYOUTS[qtype].block == 256 else 2336
    rows = 200
    gate, up, ref_gate, ref_up = gate_and_up(cuda, oracle, qtype, rows, cols, rng)
    saved = cuda.few_tokens, cuda.few_shape, cuda.cublas_min_tokens_f16, cuda.wg_tokens
    try:
        cuda.few_tokens = (1, quants.GEMM_FEW_MAX_TOKENS)
        cuda.cublas_min_tokens_f16 = 1 << 30  # gemm_few even where the weight has an f16 copy
        cuda.wg_tokens = (1, 0)  # and not gemm_wg (Hopper)
        for n in (3, 8, 16, 24, 32) if quants.LAYOUTS[qtype].integer else (9, 16, 32):
            x = rng.standard_normal((n, cols)) * np.logspace(-2, 1, n)[:, None]
            want = oracle.silu_mul(oracle.matmul(x, ref_gate), oracle.matmul(x, ref_up))
            for shape in [v for v in quants.GEMM_FEW_VARIANTS if 8 * v[0] >= n]:
                cuda.few_shape = shape
                xd = cuda_array(cuda, x)
                g, u = cuda.matmul(xd, gate), cuda.matmul(xd, up)
                assert isinstance(g, Pending) and g.waiting("few")
                got = cuda.to_host(cuda.silu_mul(g, u))
                assert g.waiting("few") and u.waiting("few")  # neither product was launched alone
                for t in range(n):
                    assert relative_error(got[t], want[t]) < 3e-3, (n, shape, t)
    finally:
        cuda.few_tokens, cuda.few_shape, cuda.cublas_min_tokens_f16, cuda.wg_tokens = saved


def test_matmul_without_tensor_cores_is_float32(oracle):
    from leat_backend_cuda.backend import CUDABackend

    cuda = CUDABackend(tensor_cores=False, poison=True)  # quantized weights, 21 tokens: the float kernel
    rng = np.random.default_rng(7)
    data = stored(Q.Q4_K, 33, 512, rng)
    x = rng.standard_normal((21, 512))
    want = oracle.matmul(x, oracle.upload(Tensor("w", Q.Q4_K, (33, 512), data)))
    got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), cuda.upload(Tensor("w", Q.Q4_K, (33, 512), data))))
    assert relative_error(got, want) < 2e-6


def test_large_activations_do_not_overflow_the_f16_gemm(cuda, oracle):
    rng = np.random.default_rng(8)
    data = stored(Q.Q8_0, 64, 256, rng)
    x = rng.standard_normal((40, 256)) * np.logspace(-6, 6, 40)[:, None]  # rows from 1e-6 to 1e6
    want = oracle.matmul(x, oracle.upload(Tensor("w", Q.Q8_0, (64, 256), data)))
    got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), cuda.upload(Tensor("w", Q.Q8_0, (64, 256), data))))
    for row in range(40):
        assert relative_error(got[row], want[row]) < 2e-3


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda q: q.name)
def test_matmul_through_cublas(cuda, oracle, qtype):
    """Products of many tokens: the weight decoded to f16 rows, cuBLAS's f16 GEMM with float32 accumulation,
    x's scales and the bias applied after; also in chunks of rows (a scratch smaller than the weight), and with
    rows of x from 1e-6 to 1e6 (the f16 scaling)."""
    from leat_backend_cuda import driver

    if cuda.cublas is None:
        pytest.skip(f"cuBLAS is not installed: {cuda.describe()['cublas']}")
    rng = np.random.default_rng(2000 + int(qtype))
    cols = 768 if quants.LAYOUTS[qtype].block == 256 else 96
    rows, n = 75, 40
    data = stored(qtype, rows, cols, rng)
    budget, cuda.f16_budget = cuda.f16_budget, 1 << 30  # a kept f16 copy (a test's arrays map no file)
    try:
        weight = cuda.upload(Tensor("w", qtype, (rows, cols), data))
    finally:
        cuda.f16_budget = budget
    reference = oracle.upload(Tensor("w", qtype, (rows, cols), data))
    bias = rng.standard_normal(rows)
    x = rng.standard_normal((n, cols)) * np.logspace(-6, 6, n)[:, None]
    want = oracle.matmul(x, reference, bias - bias)
    scratch, threshold, kept = cuda._f16_weights, cuda.cublas_min_tokens, weight.f16
    assert kept is not None  # the fixture's budget keeps an f16 copy: products multiply it; then decoded in chunks
    try:
        cuda.cublas_min_tokens = n
        for rows_per_chunk in (None, rows, 16):
            if rows_per_chunk is not None:
                cuda._f16_weights, weight.f16 = driver.Memory(rows_per_chunk * cols * 2), None
            got = cuda.to_host(cuda.matmul(cuda_array(cuda, x), weight))
            for row in range(n):
                assert relative_error(got[row], want[row]) < 2e-3
        got = cuda.to_host(cuda.matmul(cuda_array(cuda, x[:1].repeat(n, 0)), weight, cuda_array(cuda, bias)))
        assert relative_error(got, oracle.matmul(x[:1].repeat(n, 0), reference, bias)) < 2e-3
    finally:
        cuda._f16_weights, cuda.cublas_min_tokens = scratch, threshold


def cuda_array(cuda, values):
    return cuda.from_host(values)


def test_rms_norm(cuda, oracle):
    rng = np.random.default_rng(2)
    for shape, eps in (((4, 3, 16), 1e-6), ((5, 4096), 1e-5), ((2, 80), 1e-6)):
        x, w = rng.standard_normal(shape), rng.standard_normal(shape[-1])
        want = oracle.rms_norm(x, w, eps)
        assert relative_error(cuda.to_host(cuda.rms_norm(cuda_array(cuda, x), cuda_array(cuda, w), eps)), want) < 1e-6
        assert (
            relative_error(cuda.to_host(cuda.rms_norm(cuda_array(cuda, x), None, eps)), oracle.rms_norm(x, None, eps))
            < 1e-6
        )


@pytest.mark.parametrize("n,cols", [(3, 768), (24, 4096), (300, 256)])
def test_a_pending_norm_goes_into_the_f16_rows_of_a_product(cuda, n, cols):
    """rms_norm's output read as f16 rows (gemm_few, the GEMM, cuBLAS) is made by one kernel, rms_norm_f16,
    without the float32 rows: the same f16 values and scales as x_to_f16 makes from those rows."""
    from leat_backend_cuda.backend import Pending, _ready

    rng = np.random.default_rng(n)
    x, w = cuda_array(cuda, rng.standard_normal((n, cols)) * 3), cuda_array(cuda, rng.standard_normal(cols))
    pending = cuda.rms_norm(x, w, 1e-5)
    assert isinstance(pending, Pending)
    fused = [cuda.to_host(a) for a in cuda._f16_rows(pending, n, cols)]
    assert pending.waiting("norm")  # the float32 rows were never made
    plain = [cuda.to_host(a) for a in cuda._f16_rows(_ready(cuda.rms_norm(x, w, 1e-5)), n, cols)]
    np.testing.assert_array_equal(fused[0], plain[0])
    np.testing.assert_array_equal(fused[1], plain[1])


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dims,head_dim", [(16, 16), (8, 16), (128, 128), (64, 256)])
def test_rope(cuda, oracle, neox, dims, head_dim):
    rng = np.random.default_rng(3)
    x, positions = rng.standard_normal((6, 3, head_dim)), np.array([0, 1, 7, 100, 4000, 131071])
    spec = RopeSpec(dims, 500000.0, neox, 0.5, np.linspace(1, 8, dims // 2))
    want = oracle.rope(x, positions, spec)
    assert relative_error(cuda.to_host(cuda.rope(cuda_array(cuda, x), positions, spec)), want) < 1e-6


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("dims,head_dim", [(16, 16), (8, 16), (128, 128), (64, 256), (6, 10)])
def test_rope_of_a_pending_norm_runs_the_norm_inside(cuda, oracle, weighted, neox, dims, head_dim):
    """The per-head q/k norms ahead of RoPE (Qwen3, Gemma): rope takes rms_norm's pending output into one kernel,
    rope_norm, whose values equal rms_norm's then rope's bit for bit, and the oracle's."""
    from leat_backend_cuda.backend import Pending, _ready

    rng = np.random.default_rng(head_dim + dims)
    x, positions = rng.standard_normal((5, 4, head_dim)) * 3, np.array([0, 1, 7, 4000, 131071])
    w = rng.standard_normal(head_dim) if weighted else None
    spec = RopeSpec(dims, 1e6, neox, 1.0, None)
    want = oracle.rope(oracle.rms_norm(x, w, 1e-6), positions, spec)
    pending = cuda.rms_norm(cuda_array(cuda, x), None if w is None else cuda_array(cuda, w), 1e-6)
    assert isinstance(pending, Pending)
    fused = cuda.to_host(cuda.rope(pending, positions, spec))
    assert pending.waiting("norm")  # the normed rows were never made
    plain = cuda.to_host(cuda.rope(_ready(pending), positions, spec))
    np.testing.assert_array_equal(fused, plain)
    assert relative_error(fused, want) < 1e-6


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 16), (32, 8, 128), (9, 3, 64), (8, 1, 256)])
def test_attention_prefill_then_decode(cuda, oracle, kv_dtype, window, heads, kv_heads, dim):
    rng = np.random.default_rng(4)
    layouts = [KVLayout(kv_heads, dim, window=window), KVLayout(kv_heads, dim)]
    kvs = [b.allocate_kv(layouts, slots=3, context=80, page_size=16, dtype=kv_dtype) for b in (cuda, oracle)]
    # the engine's page tables need not be in order: give slot 1 pages in reverse
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    seqs = {s: [rng.standard_normal((40, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    steps = [[(0, 0, 23), (1, 0, 9)], [(1, 9, 1), (0, 23, 3)], [(0, 26, 1), (1, 10, 1)]]
    for step in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(3))
        for layer in (0, 1):
            want = oracle.attention(q, k, v, kvs[1], layer, batch, 0.3)
            got = cuda.attention(*(cuda_array(cuda, t) for t in (q, k, v)), kvs[0], layer, batch, 0.3)
            # f16 KV rounds k and v to 11 bits
            assert relative_error(cuda.to_host(got), want) < (1e-5 if kv_dtype == "f32" else 2e-3)


# the steps of a long-context check: a 700-token prefill, decode steps split over the sequence, a 497-token chunk,
# and decode past 1,024 positions; (start, tokens) of one sequence of LONG_TOKENS in a cache of 1,280
LONG_STEPS, LONG_TOKENS = ((0, 700), (700, 1), (701, 2), (703, 497), (1200, 1), (1201, 2)), 1203


def attend_long_context(cuda, oracle, kv_dtype, heads, kv_heads, dim, scale, softcap, bar, seed):
    """Each of LONG_STEPS' outputs of ``cuda.attention`` within ``bar`` of the oracle's over the same cache."""
    rng = np.random.default_rng(seed)
    layouts = [KVLayout(kv_heads, dim)]
    kvs = [b.allocate_kv(layouts, slots=1, context=1280, dtype=kv_dtype) for b in (cuda, oracle)]
    q, k, v = (rng.standard_normal((LONG_TOKENS, h, dim)) for h in (heads, kv_heads, kv_heads))
    for start, n in LONG_STEPS:
        batch = Batch([Row(0, start, np.zeros(n, int), all_logits=True)])
        args = [t[start : start + n] for t in (q, k, v)]
        want = oracle.attention(*args, kvs[1], 0, batch, scale, softcap or None)
        got = cuda.attention(*(cuda_array(cuda, t) for t in args), kvs[0], 0, batch, scale, softcap or None)
        assert relative_error(cuda.to_host(got), want) < bar


@pytest.mark.parametrize("kv_dtype", ["f32", "f16"])
def test_attention_long_context_splits(cuda, oracle, kv_dtype):
    """A 700-token prefill (one split per token), decode steps split over the sequence, and decode past
    1024 positions (the one-key-per-lane kernel, split)."""
    attend_long_context(cuda, oracle, kv_dtype, 8, 2, 64, 0.125, 0.0, 1e-5 if kv_dtype == "f32" else 2e-3, 5)


@pytest.mark.parametrize("kv_dtype,heads,kv_heads,dim,softcap", [("f16", 32, 8, 128, 0.0), ("q8_0", 36, 2, 64, 5.0)])
def test_decode_attention_on_tensor_cores(cuda, oracle, monkeypatch, kv_dtype, heads, kv_heads, dim, softcap):
    """LEAT_CUDA_ATTENTION_TC=1 (flash.cu's attention_tc for decode steps; a prefill keeps flash) at depths up to
    1,200: f16 queries and probabilities, the f16 bar."""
    monkeypatch.setenv("LEAT_CUDA_ATTENTION_TC", "1")
    attend_long_context(cuda, oracle, kv_dtype, heads, kv_heads, dim, dim**-0.5, softcap, 2e-3, 15)


def test_attention_softcap(cuda, oracle):
    rng = np.random.default_rng(6)
    kvs = [b.allocate_kv([KVLayout(2, 32)], slots=1, context=32, dtype="f32") for b in (cuda, oracle)]
    q, k, v = (rng.standard_normal((12, h, 32)) * 3 for h in (4, 2, 2))
    batch = Batch([Row(0, 0, np.zeros(12, int), all_logits=True)])
    want = oracle.attention(q, k, v, kvs[1], 0, batch, 1.0, softcap=5.0)
    got = cuda.attention(*(cuda_array(cuda, t) for t in (q, k, v)), kvs[0], 0, batch, 1.0, softcap=5.0)
    assert relative_error(cuda.to_host(got), want) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64), (8, 8, 64), (4, 2, 128), (20, 4, 64)])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (37, 0.0), (None, 4.0)])
@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
def test_flash_prefill_attention(cuda, oracle, heads, kv_heads, dim, window, softcap, dtype):
    """The tensor-core prefill kernel (an f16 or q8_0 cache, n > 8 tokens): rows of one, several and many tiles,
    decode rows in the same batch, a second chunk over cached positions, windows and soft-capping; against the
    oracle over a cache of the same type (q8_0: the same quants and scales)."""
    rng = np.random.default_rng(12)
    layouts = [KVLayout(kv_heads, dim, window=window)]
    kvs = [b.allocate_kv(layouts, slots=3, context=320, page_size=16, dtype=dtype) for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 2, kv.page_table[2][::-1].copy())
    seqs = {s: [rng.standard_normal((300, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1, 2)}
    steps = [[(0, 0, 150), (1, 0, 3)], [(2, 0, 70), (1, 3, 1), (0, 150, 1)], [(2, 70, 230), (0, 151, 20)]]
    for step in steps:
        batch = Batch([Row(s, start, np.zeros(n, int), all_logits=True) for s, start, n in step])
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(3))
        cap = softcap or None
        want = oracle.attention(q, k, v, kvs[1], 0, batch, dim**-0.5, cap)
        got = cuda.attention(*(cuda_array(cuda, t) for t in (q, k, v)), kvs[0], 0, batch, dim**-0.5, cap)
        # f16 keys, values (a q8_0 cache's decoded into f16), queries and probabilities (as llama.cpp's flash attention)
        assert relative_error(cuda.to_host(got), want) < 3e-3


def test_copy_page(cuda, oracle):
    rng = np.random.default_rng(9)
    kvs = [b.allocate_kv([KVLayout(2, 16)], slots=2, context=32, pages=6, page_size=16) for b in (cuda, oracle)]
    for b, kv in zip((cuda, oracle), kvs):
        b.set_pages(kv, 0, np.array([4, 1]))
    q, k, v = (rng.standard_normal((20, h, 16)) for h in (2, 2, 2))
    prefill = Batch([Row(0, 0, np.zeros(20, int), all_logits=True)])
    for b, kv in zip((cuda, oracle), kvs):
        b.attention(*(cuda_array(cuda, t) if b is cuda else t for t in (q, k, v)), kv, 0, prefill, 0.25)
        b.copy_page(kv, 4, 2)  # slot 1 shares the first page copy-on-write
        b.set_pages(kv, 1, np.array([2, 5]))
    q2, k2, v2 = (rng.standard_normal((1, 2, 16)) for _ in range(3))
    step = Batch([Row(1, 16, np.zeros(1, int))])
    want = oracle.attention(q2, k2, v2, kvs[1], 0, step, 0.25)
    got = cuda.attention(*(cuda_array(cuda, t) for t in (q2, k2, v2)), kvs[0], 0, step, 0.25)
    assert relative_error(cuda.to_host(got), want) < 1e-5


def test_read_and_write_pages(cuda, oracle):
    """Pages read out (a hibernated session) and written back into other page ids attend the same."""
    rng = np.random.default_rng(11)
    kv = cuda.allocate_kv([KVLayout(2, 16), KVLayout(2, 16)], slots=2, context=32, pages=6, page_size=16, dtype="f16")
    cuda.set_pages(kv, 0, np.array([0, 1]))
    q, k, v = (rng.standard_normal((20, 2, 16)) for _ in range(3))
    batch = Batch([Row(0, 0, np.zeros(20, int), all_logits=True)])
    for layer in (0, 1):
        want = cuda.to_host(cuda.attention(*(cuda_array(cuda, t) for t in (q, k, v)), kv, layer, batch, 0.25))
    contents = cuda.read_pages(kv, [0, 1])
    assert len(contents) == 4 and contents[0].shape == (2, 16 * 2 * 16 * 2)
    cuda.write_pages(kv, [4, 3], contents)
    cuda.set_pages(kv, 1, np.array([4, 3]))
    step = Batch([Row(1, 19, np.zeros(1, int))])  # slot 1 re-attends position 19 over the copied pages
    got = cuda.attention(*(cuda_array(cuda, t[19:20]) for t in (q, k, v)), kv, 1, step, 0.25)
    np.testing.assert_allclose(cuda.to_host(got)[0], want[19], rtol=1e-6, atol=1e-6)


def test_elementwise_and_rows(cuda, oracle):
    rng = np.random.default_rng(10)
    g, u = np.linspace(-100, 30, 1001), rng.standard_normal(1001)
    dg, du = cuda_array(cuda, g), cuda_array(cuda, u)
    assert relative_error(cuda.to_host(cuda.silu_mul(dg, du)), oracle.silu_mul(g, u)) < 1e-6
    assert relative_error(cuda.to_host(cuda.gelu_mul(dg, du)), oracle.gelu_mul(g, u)) < 1e-6
    assert relative_error(cuda.to_host(cuda.add(dg, du)), oracle.add(g, u)) < 1e-7
    assert relative_error(cuda.to_host(cuda.scale(dg, 0.3)), oracle.scale(g, 0.3)) < 1e-7
    assert relative_error(cuda.to_host(cuda.softcap(dg, 30.0)), oracle.softcap(g, 30.0)) < 1e-6
    table = rng.standard_normal((7, 3, 5))
    index = np.array([6, 0, 6, 2])
    np.testing.assert_array_equal(
        cuda.to_host(cuda.take_rows(cuda_array(cuda, table), index)), table[index].astype(np.float32)
    )
    assert cuda.reshape(cuda_array(cuda, table), (7, -1)).shape == (7, 15)


def test_argmax(cuda):
    """Row-wise argmax on the device equals numpy's, ties (first index), -inf rows and a vocabulary-sized row."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 128256)).astype(np.float32)
    x[1, [7, 90000]] = 50.0  # a tie: the first wins
    x[2] = -np.inf
    x[3, -1] = 99.0
    np.testing.assert_array_equal(cuda.argmax(cuda_array(cuda, x)), np.argmax(x, axis=-1))
    small = rng.standard_normal((3, 33)).astype(np.float32)
    np.testing.assert_array_equal(cuda.argmax(cuda_array(cuda, small)), np.argmax(small, axis=-1))


def test_allocations_are_counted(cuda):
    cuda.from_host(np.ones(4))
    before, budget = cuda.allocations.weights, cuda.f16_budget
    try:
        cuda.f16_budget = 0
        cuda.upload(Tensor("w", Q.Q6_K, (4, 256), stored(Q.Q6_K, 4, 256, np.random.default_rng(0))))
    finally:
        cuda.f16_budget = budget
    # the GGUF bytes (4 blocks of 210), no dequantized copy; each of the 4 planes padded to 16 bytes
    assert 0 <= cuda.allocations.weights - before - 4 * 210 < 4 * 16
    copies, cuda.f16_budget = cuda.allocations.by_type.get("f16 copies", 0), 1 << 20
    try:
        cuda.upload(Tensor("w", Q.Q6_K, (4, 256), stored(Q.Q6_K, 4, 256, np.random.default_rng(0))))
    finally:
        cuda.f16_budget = budget
    assert cuda.allocations.by_type["f16 copies"] - copies == 2 * 4 * 256  # within the budget: a kept f16 copy
    # the test's own cache: the count must not lean on what other tests on this worker allocated
    kv_before = cuda.allocations.kv
    cuda.allocate_kv([KVLayout(2, 16)], slots=1, context=16, page_size=16, dtype="f16")
    assert cuda.allocations.kv - kv_before >= 2 * 2 * 16 * 16 * 2  # keys and values: 2 heads x 16 dims x 16 tokens, f16
    assert cuda.allocations.scratch > 0
