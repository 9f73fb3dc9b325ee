"""GLM-4.5 MoE through leat's conformance kit, its variants' metadata and batching, and the plugin as the CLI sees
it. Agreement with llama.cpp (routing, shared experts, the multi-token-prediction layers left out) is
test_llamacpp_agreement.py's."""

from typing import ClassVar

import gguf
import numpy as np
import pytest
from leat.conformance import ArchitectureConformance
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.errors import ModelFileError
from leat.model import Model
from leat.modelfile import ModelFile
from leat.testing import assert_generate_is_greedy, assert_plugin_provides, write_tiny_gguf
from leat_arch_glm4moe.glm4moe import Glm4Moe
from leat_backend_cpu.backend import CPUBackend

VARIANTS = {
    "glm4moe": {},
    "mtp-qk-norm-softmax": {"layers": 4, "nextn_layers": 1, "qk_norm": True, "gating_func": 1, "weights_norm": False},
    "grouped-tied-no-bias": {"groups": 4, "groups_used": 2, "tied": True, "qkv_bias": False, "dense_layers": 0},
}


class TestGlm4MoeConformance(ArchitectureConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset({"embeddings"})

    @pytest.fixture
    def architecture(self):
        return Glm4Moe


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_round_trips(tmp_path, variant):
    floats = ("norm_eps", "weights_scale")
    assert_metadata_round_trips(Glm4Moe, Glm4Moe.tiny(**VARIANTS[variant]), tmp_path, floats=floats)


@pytest.mark.parametrize("variant", ["mtp-qk-norm-softmax", "grouped-tied-no-bias"])
def test_chunked_and_batched_equal_whole(tmp_path, variant):
    path = write_tiny_gguf(Glm4Moe, tmp_path / f"{variant}.gguf", params=Glm4Moe.tiny(**VARIANTS[variant]))
    backend = CPUBackend("f64")
    assert_chunked_and_batched_equal_whole(Glm4Moe(ModelFile(path), backend), backend)


def test_the_multi_token_prediction_layer_is_accounted_for_and_not_run(tmp_path):
    params = Glm4Moe.tiny(**VARIANTS["mtp-qk-norm-softmax"])
    model = Glm4Moe(ModelFile(write_tiny_gguf(Glm4Moe, tmp_path / "mtp.gguf", params=params)), CPUBackend("f32"))
    assert len(model.layers) == len(model.kv_layouts(model.params)) == 3
    # every tensor consumed (Architecture.__init__ checks it), and those of blk.3 not uploaded
    mtp = [t for t in model.file.tensors.values() if t.name.startswith("blk.3.")]
    assert "blk.3.nextn.eh_proj.weight" in {t.name for t in mtp}
    assert model.backend.allocations.weights == model.file.weight_bytes() - sum(t.nbytes for t in mtp)


def test_moe_keys_are_required(tmp_path):
    path = tmp_path / "no-shared-count.gguf"
    params = Glm4Moe.tiny()
    writer = gguf.GGUFWriter(path, "glm4moe")
    Glm4Moe.write_metadata(writer, params)
    for name, shape in Glm4Moe.tensor_shapes(params).items():
        writer.add_tensor(name, np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = ModelFile(path)
    del file.metadata["glm4moe.expert_shared_count"]
    with pytest.raises(ModelFileError, match="missing metadata key glm4moe.expert_shared_count"):
        Glm4Moe(file, CPUBackend("f32"))


PLUGINS = "leat-backend-cpu,leat-arch-glm4moe,leat-samplers"


def test_leat_plugins_lists_glm4moe():
    assert_plugin_provides("leat-arch-glm4moe", "architectures", ["glm4moe"], plugins=PLUGINS)


def test_cli_generate_is_the_oracles_greedy_continuation(tmp_path):
    path = write_tiny_gguf(Glm4Moe, tmp_path / "glm4moe.gguf", gguf.GGMLQuantizationType.Q8_0)
    file, backend = ModelFile(path), CPUBackend("f64")
    model = Model(file, Glm4Moe(file, backend), backend)
    assert_generate_is_greedy(path, lambda ids: model.logits(ids, native=True), plugins=PLUGINS)
