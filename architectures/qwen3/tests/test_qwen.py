import gguf
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat.testing import assert_generate_is_greedy, assert_plugin_provides, leat_cli, write_tiny_gguf
from leat_arch_qwen3.qwen import Qwen2, Qwen3, Qwen3Moe
from leat_backend_cpu.backend import CPUBackend

VARIANTS = {
    "qwen3": (Qwen3, {}),
    "qwen3-odd-heads": (Qwen3, {"heads": 3, "kv_heads": 1, "tied": False}),
    "qwen3moe-top3": (Qwen3Moe, {"experts_used": 3}),
    "qwen2": (Qwen2, {}),
    "qwen2-yarn": (Qwen2, {"yarn_factor": 4.0, "yarn_context": 16}),
}


def build(tmp_path, variant, precision="f64", qtype=gguf.GGMLQuantizationType.F32):
    cls, overrides = VARIANTS[variant]
    path = write_tiny_gguf(cls, tmp_path / f"{variant}.gguf", qtype, params=cls.tiny(**overrides))
    backend = CPUBackend(precision)
    return cls(ModelFile(path), backend), backend, path


def run(model, backend, rows, kv=None, slots=3, context=64):
    kv = kv or backend.allocate_kv(model.kv_layouts(model.params), slots, context, page_size=8)
    return backend.to_host(model.forward(Batch(rows), kv)), kv


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_round_trips(tmp_path, variant):
    cls, overrides = VARIANTS[variant]
    assert_metadata_round_trips(cls, cls.tiny(**overrides), tmp_path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_and_batched_equal_whole(tmp_path, variant):
    model, backend, _ = build(tmp_path, variant)
    assert_chunked_and_batched_equal_whole(model, backend)


def test_qwen3moe_requires_its_expert_keys(tmp_path):
    params = Qwen3Moe.tiny()
    path = tmp_path / "no-experts-key.gguf"
    writer = gguf.GGUFWriter(path, "qwen3moe")
    Qwen3.write_metadata(writer, Qwen3.tiny())  # the dense metadata: no expert_count / expert_used_count
    for name, shape in Qwen3Moe.tensor_shapes(params).items():
        writer.add_tensor(name, np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="missing metadata key qwen3moe.expert_count"):
        Qwen3Moe(ModelFile(path), CPUBackend("f32"))


PLUGINS = "leat-backend-cpu,leat-arch-qwen3,leat-samplers"


def test_leat_plugins_lists_the_qwen_architectures():
    assert_plugin_provides("leat-arch-qwen3", "architectures", ["qwen2", "qwen3", "qwen3moe"], plugins=PLUGINS)


@pytest.mark.parametrize("variant", ["qwen3", "qwen3moe-top3", "qwen2"])
def test_cli_doctor_and_generate(tmp_path, variant):
    model, _, path = build(tmp_path, variant, qtype=gguf.GGMLQuantizationType.F16)
    doctor = leat_cli("doctor", "-m", str(path), "--json", plugins=PLUGINS)
    assert doctor.returncode == 0, doctor.stderr
    assert f'"{model.file.architecture}"' in doctor.stdout
    oracle = lambda ids: run(model, model.backend, [Row(0, 0, ids, all_logits=True)])[0]
    assert_generate_is_greedy(path, oracle, plugins=PLUGINS)
