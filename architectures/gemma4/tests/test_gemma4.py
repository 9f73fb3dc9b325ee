"""Gemma 4 through leat's conformance kit, its variants' metadata and batching, what it refuses, and the plugin as the
CLI sees it. Agreement with llama.cpp is test_llamacpp_agreement.py's."""

from typing import ClassVar

import gguf
import pytest
from leat.conformance import ArchitectureConformance
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.errors import ModelFileError
from leat.gguf_check import check_value
from leat.model import Model
from leat.modelfile import ModelFile
from leat.testing import assert_generate_is_greedy, assert_plugin_provides, write_tiny_gguf
from leat_arch_gemma4.gemma4 import Gemma4
from leat_backend_cpu.backend import CPUBackend

VARIANTS = {
    "e2b": {},
    "dense-k-as-v": {
        "layers": 3, "ffn": 96, "kv_heads": 2, "pattern": (True, True, False), "shared_kv_layers": 0, "per_layer": 0,
        "final_softcap": None, "output_scale": False, "separate_v": False, "tied": False,
    },
}  # fmt: skip
PLUGINS = "leat-backend-cpu,leat-arch-gemma4,leat-samplers"


class TestGemma4Conformance(ArchitectureConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset()  # its logits are capped: not an affine map of the states

    @pytest.fixture
    def architecture(self):
        return Gemma4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_round_trips(tmp_path, variant):
    assert_metadata_round_trips(Gemma4, Gemma4.tiny(**VARIANTS[variant]), tmp_path, floats=("norm_eps",))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_and_batched_equal_whole(tmp_path, variant):
    """Past the window of 8 in chunks, with the shared-KV layers reading their sources' cache."""
    path = write_tiny_gguf(Gemma4, tmp_path / f"{variant}.gguf", params=Gemma4.tiny(**VARIANTS[variant]))
    backend = CPUBackend("f64")
    assert_chunked_and_batched_equal_whole(Gemma4(ModelFile(path), backend), backend)


def test_the_kv_cache_holds_only_the_layers_that_compute_kv():
    p = Gemma4.tiny()
    layouts = Gemma4.kv_layouts(p)
    assert len(layouts) == 4  # of 6: the last two read layers 2 (sliding) and 3 (full)
    assert [p.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    assert [(x.kv_heads, x.head_dim, x.window) for x in layouts] == [(2, 16, 8), (1, 32, None)] * 2


def test_refuses_moe_files_and_shared_layers_without_their_sources(tmp_path):
    file = ModelFile(write_tiny_gguf(Gemma4, tmp_path / "e2b.gguf"))
    assert Gemma4.read_params(file).shared_kv_layers == 2
    file.tensors["blk.1.ffn_gate_inp.weight"] = file.tensors["blk.1.ffn_up.weight"]  # as a 26B-A4B file has
    with pytest.raises(ModelFileError, match="MoE model"):
        Gemma4.read_params(file)
    bad = Gemma4.tiny(shared_kv_layers=3)  # layers 3.. shared: the two before them are full, then sliding
    with pytest.raises(ModelFileError, match="sliding then a full layer"):
        Gemma4(ModelFile(write_tiny_gguf(Gemma4, tmp_path / "bad.gguf", params=bad)), CPUBackend("f32"))


def test_per_layer_widths_and_kv_heads_are_read_and_range_checked():
    """llama.cpp reads feed_forward_length and head_count_kv as one value or one per layer; each value is checked."""
    check_value("gemma4", "gemma4.feed_forward_length", [128, 256])
    with pytest.raises(ModelFileError, match="gemma4.attention.head_count_kv is \\[2, 0\\], outside 1 to"):
        check_value("gemma4", "gemma4.attention.head_count_kv", [2, 0])
    with pytest.raises(ModelFileError, match="must be an integer"):
        check_value("gemma4", "gemma4.embedding_length", [64, 64])  # never per layer


def test_leat_plugins_lists_gemma4():
    assert_plugin_provides("leat-arch-gemma4", "architectures", ["gemma4", "gemma4-assistant"], plugins=PLUGINS)


def test_cli_generate_is_the_oracles_greedy_continuation(tmp_path):
    path = write_tiny_gguf(Gemma4, tmp_path / "gemma4.gguf", gguf.GGMLQuantizationType.Q8_0, seed=1)
    file, backend = ModelFile(path), CPUBackend("f64")
    model = Model(file, Gemma4(file, backend), backend)
    assert_generate_is_greedy(path, lambda ids: model.logits(ids, native=True), plugins=PLUGINS)
