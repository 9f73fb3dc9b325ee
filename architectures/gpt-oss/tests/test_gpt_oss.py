import gguf
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat.testing import assert_generate_is_greedy, assert_plugin_provides, leat_cli, write_tiny_gguf
from leat_arch_gpt_oss.gpt_oss import GptOss
from leat_backend_cpu.backend import CPUBackend

# windows shorter than the chunks below, so chunk boundaries fall inside and across windows
VARIANTS = {
    "gpt-oss": (GptOss, {"window": 5}),
    "odd-heads-top3": (GptOss, {"layers": 3, "heads": 3, "kv_heads": 1, "window": 3, "experts": 6, "experts_used": 3}),
    "pattern-swa-base": (GptOss, {"layers": 3, "sliding": (False, True, True), "rope_base_swa": 1e4}),
    "no-yarn": (GptOss, {"yarn_factor": 0.0, "yarn_context": 0}),
}


def build(tmp_path, variant, precision="f64", mxfp4=False):
    cls, overrides = VARIANTS[variant]
    params = cls.tiny(**overrides)
    experts = {n: gguf.GGMLQuantizationType.MXFP4 for n in cls.tensor_shapes(params) if n.endswith("_exps.weight")}
    path = write_tiny_gguf(cls, tmp_path / f"{variant}.gguf", params=params, types=experts if mxfp4 else None)
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


def test_sliding_window_key_is_required(tmp_path):
    params = GptOss.tiny()
    path = tmp_path / "no-window.gguf"
    writer = gguf.GGUFWriter(path, "gpt-oss")
    GptOss.write_metadata(writer, params)
    writer.kv_data[0].pop(gguf.Keys.Attention.SLIDING_WINDOW.format(arch="gpt-oss"))
    for name, shape in GptOss.tensor_shapes(params).items():
        writer.add_tensor(name, np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="missing metadata key gpt-oss.attention.sliding_window"):
        GptOss(ModelFile(path), CPUBackend("f32"))


PLUGINS = "leat-backend-cpu,leat-arch-gpt-oss,leat-samplers"


def test_leat_plugins_lists_gpt_oss():
    assert_plugin_provides("leat-arch-gpt-oss", "architectures", ["gpt-oss"], plugins=PLUGINS)


@pytest.mark.parametrize("variant", ["gpt-oss"])
def test_cli_doctor_and_generate(tmp_path, variant):
    model, _, path = build(tmp_path, variant, mxfp4=True)
    doctor = leat_cli("doctor", "-m", str(path), "--json", plugins=PLUGINS)
    assert doctor.returncode == 0, doctor.stderr
    assert f'"{model.file.architecture}"' in doctor.stdout
    oracle = lambda ids: run(model, model.backend, [Row(0, 0, ids, all_logits=True)])[0]
    assert_generate_is_greedy(path, oracle, plugins=PLUGINS)
