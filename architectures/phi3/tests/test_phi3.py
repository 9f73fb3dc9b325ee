"""Phi-3 through leat's conformance kit, its variants' metadata and batching, and the plugin as the CLI sees it.

Agreement with llama.cpp (what the fused tensors, LongRoPE and the unapplied window mean) is
test_llamacpp_agreement.py's."""

from typing import ClassVar

import gguf
import numpy as np
import pytest
from leat.conformance import ArchitectureConformance
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.model import Model
from leat.modelfile import ModelFile
from leat.testing import assert_generate_is_greedy, assert_plugin_provides, write_tiny_gguf
from leat_arch_phi3.phi3 import Phi3
from leat_backend_cpu.backend import CPUBackend

VARIANTS = {
    "phi3": {},
    "short-factors": {"rope_context": 256, "rope_dims": 16, "sliding_window": 16},
    "unfused-plain-tied": {"fused_qkv": False, "long_rope": False, "tied": True, "heads": 8, "rope_dims": 8},
}


class TestPhi3Conformance(ArchitectureConformance):
    capabilities: ClassVar[frozenset[str]] = frozenset({"embeddings"})

    @pytest.fixture
    def architecture(self):
        return Phi3


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_metadata_round_trips(tmp_path, variant):
    assert_metadata_round_trips(Phi3, Phi3.tiny(**VARIANTS[variant]), tmp_path, floats=("norm_eps", "rope_attn_factor"))


@pytest.mark.parametrize("variant", ["short-factors", "unfused-plain-tied"])
def test_chunked_and_batched_equal_whole(tmp_path, variant):
    path = write_tiny_gguf(Phi3, tmp_path / f"{variant}.gguf", params=Phi3.tiny(**VARIANTS[variant]))
    backend = CPUBackend("f64")
    assert_chunked_and_batched_equal_whole(Phi3(ModelFile(path), backend), backend)


def test_long_factors_only_past_the_original_context(tmp_path):
    """The same weights under a context past the original one run with the long factors, else the short ones: the
    rotation each layer gets is the file's factor tensor, as stored."""
    long = Phi3(ModelFile(write_tiny_gguf(Phi3, tmp_path / "long.gguf")), CPUBackend("f64"))
    short_params = Phi3.tiny(rope_context=256, rope_attn_factor=long.params.rope_attn_factor)
    short = Phi3(ModelFile(write_tiny_gguf(Phi3, tmp_path / "short.gguf", params=short_params)), CPUBackend("f64"))
    stored = {t.name: np.asarray(t.data) for t in long.file.tensors.values() if t.name.startswith("rope_factors")}
    np.testing.assert_array_equal(long.rope.freq_factors, stored["rope_factors_long.weight"])
    np.testing.assert_array_equal(short.rope.freq_factors, stored["rope_factors_short.weight"])
    assert long.rope.attn_factor == short.rope.attn_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))


PLUGINS = "leat-backend-cpu,leat-arch-phi3,leat-samplers"


def test_leat_plugins_lists_phi3():
    assert_plugin_provides("leat-arch-phi3", "architectures", ["phi3"], plugins=PLUGINS)


def test_cli_generate_is_the_oracles_greedy_continuation(tmp_path):
    path = write_tiny_gguf(Phi3, tmp_path / "phi3.gguf", gguf.GGMLQuantizationType.Q8_0)
    file, backend = ModelFile(path), CPUBackend("f64")
    model = Model(file, Phi3(file, backend), backend)
    assert_generate_is_greedy(path, lambda ids: model.logits(ids, native=True), plugins=PLUGINS)
