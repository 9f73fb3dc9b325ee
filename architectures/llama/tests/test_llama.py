import gguf
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_backend_cpu.backend import CPUBackend


def build(tmp_path, precision="f64", file="tiny.gguf", **overrides):
    path = write_tiny_gguf(Llama, tmp_path / file, params=Llama.tiny(**overrides))
    backend = CPUBackend(precision)
    return Llama(ModelFile(path), backend), backend


def run(model, backend, rows, slots=3, context=64, kv=None):
    kv = kv or backend.allocate_kv(model.kv_layouts(model.params), slots, context)
    return backend.to_host(model.forward(Batch(rows), kv)), kv


@pytest.mark.parametrize(
    "overrides",
    [{}, {"heads": 3, "kv_heads": 1, "head_dim": 8}, {"kv_heads": 4}, {"tied": False}, {"rope_freqs": True}],
    ids=["gqa2", "odd-heads", "mha", "untied", "rope-freqs"],
)
def test_chunked_and_batched_equal_whole(tmp_path, overrides):
    model, backend = build(tmp_path, **overrides)
    assert_chunked_and_batched_equal_whole(model, backend)


def test_f32_follows_f64(tmp_path):
    f64, b64 = build(tmp_path, "f64")
    f32, b32 = build(tmp_path, "f32")
    ids = np.random.default_rng(1).integers(0, 300, 30)
    want, _ = run(f64, b64, [Row(0, 0, ids, all_logits=True)])
    got, _ = run(f32, b32, [Row(0, 0, ids, all_logits=True)])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_rope_freqs_change_the_result(tmp_path):
    plain, backend = build(tmp_path, file="plain.gguf")
    scaled, _ = build(tmp_path, file="scaled.gguf", rope_freqs=True)
    ids = np.arange(40) % 300
    x, _ = run(plain, backend, [Row(0, 0, ids, all_logits=True)])
    y, _ = run(scaled, backend, [Row(0, 0, ids, all_logits=True)])
    assert np.abs(x[1:] - y[1:]).max() > 1e-3  # position 0 has no rotation, later ones must differ


def test_unused_tensor_is_an_error(tmp_path):
    params = Llama.tiny()
    path = tmp_path / "extra.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    Llama.write_metadata(writer, params)
    for name, shape in Llama.tensor_shapes(params).items():
        writer.add_tensor(name, np.ones(shape, np.float32))
    writer.add_tensor("blk.0.mystery.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="tensors not used by the llama loader: blk.0.mystery.weight"):
        Llama(ModelFile(path), CPUBackend("f32"))
