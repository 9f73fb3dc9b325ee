import gguf
import numpy as np
import pytest

from leat.batch import Batch, Row
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
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 300, 20), rng.integers(0, 300, 11)
    whole_a, _ = run(model, backend, [Row(0, 0, a, all_logits=True)])
    whole_b, _ = run(model, backend, [Row(0, 0, b, all_logits=True)])
    # a in chunks of 7, 7, 6 while b prefills and then decodes token by token in the same batches
    first, kv = run(model, backend, [Row(2, 0, a[:7], all_logits=True), Row(1, 0, b[:8], all_logits=True)])
    np.testing.assert_allclose(first[:7], whole_a[:7], atol=1e-10)
    np.testing.assert_allclose(first[7:], whole_b[:8], atol=1e-10)
    second, kv = run(model, backend, [Row(1, 8, b[8:9]), Row(2, 7, a[7:14], all_logits=True)], kv=kv)
    np.testing.assert_allclose(second[0], whole_b[8], atol=1e-10)
    np.testing.assert_allclose(second[1:], whole_a[7:14], atol=1e-10)
    third, _ = run(model, backend, [Row(2, 14, a[14:]), Row(1, 9, b[9:11])], kv=kv)
    np.testing.assert_allclose(third, whole_a[[-1]].tolist() + whole_b[[-1]].tolist(), atol=1e-10)


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
