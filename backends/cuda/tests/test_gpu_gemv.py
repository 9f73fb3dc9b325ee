"""gemv_q for one token: any grid and the first loads issued before x is quantized or after give the same bits, every
instantiation (rows per warp, units in flight per lane) the same values (a row's sums run in the same order in all of
them; only FMA contraction may differ), and the float64 oracle's within x's int16 rounding: three segments with the
norm taken in (q, k and v) and one with a residual (o), rows shorter than a warp's units and longer."""

import gguf
import numpy as np
import pytest
from leat.modelfile import Tensor
from leat.testing import relative_error

pytestmark = pytest.mark.gpu
Q = gguf.GGMLQuantizationType
SHAPES = [None, (8, 1), (4, 1), (2, 2), (4, 2), (2, 4)]  # None: quants.gemv_q_shape's choice


def quantized(rng, qtype, rows, cols):
    values = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    if qtype in (Q.Q4_K, Q.Q6_K):  # gguf-py cannot quantize K types: random blocks with small scales
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        scale = rng.uniform(0.002, 0.02, len(data)).astype(np.float16).view(np.uint8).reshape(-1, 2)
        for offset in (0, 2) if qtype == Q.Q4_K else (208,):
            data[:, offset : offset + 2] = scale
        return data.reshape(rows, -1)
    return gguf.quants.quantize(values, qtype).view(np.uint8).reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [256, 4096])
def test_gemv_q_shapes_grids_and_early_loads_give_the_same_bits(cuda, oracle, monkeypatch, qtype, cols):
    rng = np.random.default_rng(int(qtype) + cols)
    stored = {name: quantized(rng, qtype, rows, cols) for name, rows in (("q", 300), ("k", 75), ("v", 75), ("o", 90))}
    weights = {name: cuda.upload(Tensor(name, qtype, (len(d), cols), d)) for name, d in stored.items()}
    refs = {name: oracle.upload(Tensor(name, qtype, (len(d), cols), d)) for name, d in stored.items()}
    x, norm, residual = rng.standard_normal((1, cols)), rng.uniform(0.5, 1.5, cols), rng.standard_normal((1, 90))
    bias = rng.standard_normal(75)
    device = {a: cuda.from_host(v) for a, v in (("x", x), ("norm", norm), ("residual", residual), ("bias", bias))}

    def products():
        pending = cuda.rms_norm(device["x"], device["norm"], 1e-5)  # taken in by the kernel (mode NORM)
        qkv = cuda._gemv_q(pending, [(weights["q"], None), (weights["k"], None), (weights["v"], device["bias"])])
        o = cuda._gemv_q(device["x"], [(weights["o"], None)], residual=device["residual"])
        return [cuda.to_host(a) for a in (*qkv, *o)]

    first = products()
    for shape in SHAPES:
        with monkeypatch.context() as m:
            m.setattr(cuda, "gemv_shape", shape)
            own = products()
            for got, want in zip(own, first, strict=True):  # another instantiation: FMA contraction may differ
                assert relative_error(got, want) < 1e-6, f"shape {shape}"
            for blocks, ahead in ((None, False), (1, True), (1, False), (3, True)):  # the same kernel: the same bits
                m.setattr(cuda, "gemv_blocks", blocks)
                m.setattr(cuda, "gemv_ahead", ahead)
                for got, want in zip(products(), own, strict=True):
                    np.testing.assert_array_equal(got, want, err_msg=f"shape {shape}, blocks {blocks}, ahead {ahead}")
    h = oracle.rms_norm(x, norm, 1e-5)
    wants = [oracle.matmul(h, refs[n], b) for n, b in (("q", None), ("k", None), ("v", bias))]
    wants.append(oracle.matmul(x, refs["o"]) + residual)
    for got, want in zip(first, wants, strict=True):
        assert relative_error(got, want) < 2e-4
