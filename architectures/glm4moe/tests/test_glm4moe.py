"""GLM-4.5 MoE through leat's conformance kit, its variants' metadata and batching, and the plugin as the CLI sees
it. Agreement with llama.cpp (routing, shared experts, the multi-token-prediction layers left out) is
test_llamacpp_agreement.py's."""

import json
import os
import subprocess
import sys
from typing import ClassVar

import gguf
import numpy as np
import pytest
from leat.compare import top2_gap
from leat.conformance import ArchitectureConformance
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.errors import ModelFileError
from leat.model import Model
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
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


def leat(*args):
    env = dict(os.environ, LEAT_PLUGINS="leat-backend-cpu,leat-arch-glm4moe,leat-samplers")
    return subprocess.run(
        [sys.executable, "-m", "leat", *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def test_leat_plugins_lists_glm4moe():
    result = leat("plugins")
    assert result.returncode == 0, result.stderr
    (plugin,) = [p for p in json.loads(result.stdout) if p["name"] == "leat-arch-glm4moe"]
    assert plugin["status"] == "loaded"
    assert plugin["provides"]["architectures"] == ["glm4moe"]


def test_cli_generate_is_the_oracles_greedy_continuation(tmp_path):
    path = write_tiny_gguf(Glm4Moe, tmp_path / "glm4moe.gguf", gguf.GGMLQuantizationType.Q8_0)
    result = leat("generate", "-m", str(path), "-p", "hi", "-n", "8", "--backend", "cpu", "--temp", "0", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["ids"]) == 8 and out["timings"]["finish_reason"] == "length"
    # greedy: each token is the oracle's argmax after the prompt and the tokens before it (unless near-tied)
    file, backend = ModelFile(path), CPUBackend("f64")
    ids = np.array(out["prompt_ids"] + out["ids"])
    logits = Model(file, Glm4Moe(file, backend), backend).logits(ids, native=True)
    steps = logits[len(out["prompt_ids"]) - 1 : -1]
    decided = top2_gap(steps) >= 1e-3
    assert np.array_equal(np.argmax(steps, axis=-1)[decided], np.array(out["ids"])[decided])
