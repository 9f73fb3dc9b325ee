"""The CPU backend's dequantized weights (the reference paths) equal gguf-py's dequantization for every type it
accepts; test_cpu_quantized.py checks the weights it keeps quantized."""

import gguf
import numpy as np
import pytest
from leat.errors import UnsupportedQuantType
from leat.modelfile import Tensor
from leat_backend_cpu.backend import DEQUANTIZABLE, CPUBackend

Q = gguf.GGMLQuantizationType


def random_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Stored bytes of a [rows, cols] tensor: quantized real data where gguf-py can quantize, else random bytes."""
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE, key=int), ids=lambda q: q.name)
@pytest.mark.parametrize("precision", ["f32", "f64"])
def test_upload_equals_gguf_dequantize(qtype, precision):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 3, 512
    data = random_blocks(qtype, rows, cols, rng)
    stored = data if data.dtype == np.uint8 else data.view(np.uint8).reshape(rows, -1)
    expected = gguf.quants.dequantize(stored, qtype).reshape(rows, cols)
    backend = CPUBackend(precision, weights="dequantized")
    weight = backend.upload(Tensor("w", qtype, (rows, cols), stored))
    assert weight.shape == (rows, cols) and weight.dtype == backend.dtype
    np.testing.assert_array_equal(weight, expected.astype(backend.dtype))
    assert backend.allocations.weights == weight.nbytes


def test_every_type_gguf_can_dequantize_is_accepted():
    rng = np.random.default_rng(0)
    for qtype in Q:
        if qtype in (Q.F32, Q.F16) or qtype.name in ("I8", "I16", "I32", "I64", "F64", "Q8_1", "Q8_K"):
            continue
        _, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(rng.integers(0, 256, (1, size), dtype=np.uint8), qtype)
        except NotImplementedError:
            assert qtype not in DEQUANTIZABLE
            continue
        assert qtype in DEQUANTIZABLE, f"{qtype.name} is dequantizable by gguf-py but refused by the cpu backend"


def test_unsupported_type_is_a_clear_error():
    backend = CPUBackend("f32")
    with pytest.raises(UnsupportedQuantType, match="tensor w is Q8_K"):
        backend.upload(Tensor("w", Q.Q8_K, (1, 256), np.zeros((1, 292), np.uint8)))
