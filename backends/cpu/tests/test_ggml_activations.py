"""The CPU backend's activations="ggml": llama.cpp's activation rounding against float64 references, and products
with quantized weights against ggml's integer dot product written out from the blocks and against ggml_mul_mat's
own results (recorded)."""

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.modelfile import Tensor
from leat_backend_cpu import ggml_activations as ga
from leat_backend_cpu.backend import CPUBackend

Q = gguf.GGMLQuantizationType


def reference_q8(x: np.ndarray, block: int, k_style: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per block, in float64: (q, d as the dot product uses it, d as the quantizer used it). Q8_0/Q8_1: d = amax/127,
    q = round half away from zero of x/d, the stored d is fp16. Q8_K: the first value of largest magnitude maps to
    -127, q rounds half to even, d = 1/iscale stays float32."""
    blocks = x.astype(np.float64).reshape(-1, block)
    q, d_used, d_quant = np.zeros_like(blocks), np.zeros(len(blocks)), np.zeros(len(blocks))
    for i, values in enumerate(blocks):
        if k_style:
            peak = values[np.argmax(np.abs(values))]
            if peak == 0:
                continue
            iscale = float(np.float32(-127 / peak))
            q[i] = np.minimum(127, np.round(values * iscale))
            d_used[i] = d_quant[i] = float(np.float32(1 / iscale))
        else:
            d = float(np.float32(np.abs(values).max() / 127))
            scaled = values / d if d else values * 0
            q[i] = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
            d_used[i], d_quant[i] = float(np.float16(d)), d
    return q, d_used, d_quant


def activations(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)  # heavy-tailed, as a transformer's activations
    return (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)


def test_q8_0_and_q8_1_follow_the_reference():
    x = activations((6, 256))
    q, d, d_quant = reference_q8(x, 32, k_style=False)
    want = (q * d[:, None]).reshape(x.shape)
    np.testing.assert_allclose(ga.q8_0(x), want, rtol=1e-6, atol=0)
    rounded, sum_error = ga.q8_1(x)
    np.testing.assert_allclose(rounded, want, rtol=1e-6, atol=0)
    stored_sum = (q.sum(axis=1) * d_quant).astype(np.float32).astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(sum_error.ravel(), stored_sum - q.sum(axis=1) * d, rtol=1e-6, atol=1e-9)
    # gguf-py's Q8_0 quantizer is ggml's reference too: the same values, bit for bit
    stored = gguf.quants.quantize(x, Q.Q8_0)
    np.testing.assert_array_equal(ga.q8_0(x), gguf.quants.dequantize(stored, Q.Q8_0).reshape(x.shape))


def test_q8_k_follows_the_reference():
    x = activations((3, 512), seed=1)
    q, d, _ = reference_q8(x, 256, k_style=True)
    np.testing.assert_allclose(ga.q8_k(x), (q * d[:, None]).reshape(x.shape), rtol=1e-6, atol=0)
    assert not ga.q8_k(np.zeros((1, 256), np.float32)).any()


def test_ties_round_as_ggml():
    # amax 127 gives d = 1: Q8_0's roundf takes halves away from zero, Q8_K's nearest_int to even
    tie = np.zeros(32, np.float32)
    tie[:6] = [127, 0.5, 1.5, -0.5, -2.5, 2.5]
    assert ga.q8_0(tie)[:6].tolist() == [127, 1, 2, -1, -3, 3]
    tie_k = np.zeros(256, np.float32)
    tie_k[:6] = [-127, 0.5, 1.5, -0.5, -2.5, 2.5]  # max -127: iscale = 1
    assert ga.q8_k(tie_k)[:6].tolist() == [-127, 0, 2, 0, -2, 2]


def test_bf16_and_f16():
    x = activations((2, 64), seed=2)
    bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in x.ravel()]
    even = [(b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16 for b in bits]  # ggml_compute_fp32_to_bf16
    want = np.array([struct.unpack("<f", struct.pack("<I", b))[0] for b in even], np.float32).reshape(x.shape)
    np.testing.assert_array_equal(ga.bf16(x), want)
    np.testing.assert_array_equal(ga.f16(x), x.astype(np.float16).astype(np.float32))


def test_each_type_takes_its_vec_dot_type():
    # ggml-cpu.c's type_traits_cpu: vec_dot_type per weight type
    expected = {Q.F32: None, Q.F16: ga.f16, Q.BF16: ga.bf16, Q.Q4_0: ga.q8_0, Q.Q5_0: ga.q8_0, Q.Q8_0: ga.q8_0}
    expected |= {Q.Q4_1: ga.q8_1, Q.Q5_1: ga.q8_1, Q.IQ4_NL: ga.q8_0, Q.MXFP4: ga.q8_0, Q.IQ4_XS: ga.q8_k}
    expected |= {t: ga.q8_k for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ3_S, Q.TQ1_0)}
    assert {t: ga.rounding_for(t) for t in expected} == expected


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q5_1, Q.Q8_0])
def test_product_is_ggmls_integer_dot(qtype):
    """The backend's matmul in ggml mode against ggml's dot written out in float64 from the blocks:
    Q8_0 weights, sum_b d_w d_x sum(q_w q_x); Q4_1/Q5_1, the same plus m_w * s_x, s_x = fp16(d_x * sum(q_x))."""
    rows, cols = 8, 128
    rng = np.random.default_rng(int(qtype))
    stored = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    stored = stored.view(np.uint8).reshape(rows, -1)
    x = activations((5, cols), seed=3)
    backend = CPUBackend("f32", activations="ggml")
    got = backend.matmul(x, backend.upload(Tensor("w", qtype, (rows, cols), stored)))

    q, d, d_quant = reference_q8(x, 32, k_style=False)
    q, d = q.reshape(5, -1, 32), d.reshape(5, -1)
    weights = gguf.quants.dequantize(stored, qtype).reshape(rows, -1, 32).astype(np.float64)
    if qtype == Q.Q8_0:
        want = np.einsum("nbj,rbj->nr", q * d[..., None], weights)
    else:
        minimums = ga.block_minimums(stored, qtype, (rows, cols)).astype(np.float64)  # fp16 m of each block
        s = (q.sum(-1) * d_quant.reshape(5, -1)).astype(np.float32).astype(np.float16).astype(np.float64)
        want = np.einsum("nbj,rbj->nr", q * d[..., None], weights - minimums[..., None]) + s @ minimums.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert not np.allclose(backend.matmul(x, CPUBackend("f32").upload(Tensor("w", qtype, (rows, cols), stored))), want)


def test_the_option():
    assert CPUBackend("f32", activations="ggml").describe()["activations"] == "ggml"
    assert "activations" not in CPUBackend("f32").describe()
    for bad in ({"activations": "q8"}, {"activations": "ggml", "precision": "f64"}):
        with pytest.raises(ValueError, match="activations must be"):
            CPUBackend(**bad)


GGML = np.load(Path(__file__).parent / "references" / "ggml_matmul.npz")


@pytest.mark.parametrize("name", sorted({key.split("/")[0] for key in GGML.files if "/" in key}))
def test_product_equals_ggmls_own_matmul(name):
    """Against ggml_mul_mat itself (references/record_ggml_matmul.py): equal up to float summation order, where the
    float32 product is measurably off."""
    x, stored, want = GGML["x"], GGML[f"{name}/weight"], GGML[f"{name}/y"].astype(np.float64)
    tensor = Tensor("w", Q[name], (want.shape[1], x.shape[1]), stored)
    ggml = CPUBackend("f32", activations="ggml")
    error = np.abs(ggml.matmul(x, ggml.upload(tensor)) - want).max() / np.abs(want).max()
    plain = CPUBackend("f32")
    float_error = np.abs(plain.matmul(x, plain.upload(tensor)) - want).max() / np.abs(want).max()
    assert error < 2e-6 and float_error > 50 * error, (error, float_error)
