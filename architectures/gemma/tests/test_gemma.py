import json

import pytest
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.modelfile import ModelFile
from leat.testing import assert_plugin_provides, leat_cli, write_tiny_gguf
from leat_arch_gemma.gemma import Gemma, Gemma2, Gemma3
from leat_backend_cpu.backend import CPUBackend

FAMILY = {"gemma": Gemma, "gemma2": Gemma2, "gemma3": Gemma3}


def build(tmp_path, arch, precision="f64", **overrides):
    path = write_tiny_gguf(arch, tmp_path / f"{arch.names[0]}.gguf", params=arch.tiny(**overrides))
    backend = CPUBackend(precision)
    return arch(ModelFile(path), backend), backend, path


@pytest.mark.parametrize(
    "arch, overrides",
    [
        (Gemma, {"heads": 3, "kv_heads": 1}),
        (Gemma2, {"window": 5, "attn_softcap": 2.0, "final_softcap": 5.0}),
        (Gemma3, {"window": 5, "pattern": 2, "tied": False}),
    ],
    ids=["gemma", "gemma2", "gemma3"],
)
def test_chunked_and_batched_equal_whole(tmp_path, arch, overrides):
    model, backend, _ = build(tmp_path, arch, **overrides)
    assert_chunked_and_batched_equal_whole(model, backend)


def test_sliding_layers_as_llamacpp_computes_them():
    # Gemma 3: every 6th layer is global (il % 6 == 5); Gemma 2: every 2nd (odd layers)
    assert Gemma3.sliding(Gemma3.tiny(layers=18, window=512)) == [i % 6 < 5 for i in range(18)]
    assert Gemma2.sliding(Gemma2.tiny(layers=5)) == [True, False, True, False, True]
    assert Gemma3.sliding(Gemma3.tiny(layers=4, window=8, pattern=(True, False, False, True))) == [
        True,
        False,
        False,
        True,
    ]
    assert Gemma3.sliding(Gemma3.tiny(layers=4, window=8, pattern=0)) == [True] * 4
    assert Gemma3.sliding(Gemma3.tiny(layers=4)) == [False] * 4  # no sliding_window key: all global
    assert Gemma.sliding(Gemma.tiny(layers=3, window=8)) == [False] * 3
    layouts = Gemma2.kv_layouts(Gemma2.tiny(layers=2))
    assert [layout.window for layout in layouts] == [4096, None]  # Gemma 2's default window


def test_query_scale_and_caps_follow_llamacpp():
    assert Gemma3.query_scale(Gemma3.tiny()) == 16**-0.5
    big = Gemma3.tiny(layers=62, width=5376, heads=32, head_dim=128)  # the 27B: 1/sqrt(width / heads)
    assert Gemma3.query_scale(big) == 168**-0.5
    assert Gemma2.caps(Gemma2.tiny()) == (50.0, 30.0)
    assert Gemma3.caps(Gemma3.tiny(attn_softcap=9.0, final_softcap=7.0)) == (None, 7.0)
    assert Gemma.caps(Gemma.tiny(final_softcap=7.0)) == (None, None)
    assert Gemma3.local_rope(Gemma3.tiny(rope_base=1e6, rope_scaling=8.0)) == (10000.0, None)
    assert Gemma2.local_rope(Gemma2.tiny(rope_base=1e6, rope_scaling=8.0)) == (1e6, 8.0)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        (Gemma, {}),
        (Gemma2, {"window": 7, "pattern": 3, "attn_softcap": 2.0, "final_softcap": 5.0, "rope_base_local": 99.0}),
        (Gemma3, {"window": 7, "pattern": (True, False), "rope_scaling": 8.0, "tied": False, "final_softcap": 4.0}),
    ],
    ids=["gemma", "gemma2", "gemma3"],
)
def test_metadata_round_trips(tmp_path, arch, overrides):
    assert_metadata_round_trips(arch, arch.tiny(**overrides), tmp_path)


def test_file_of_another_family_member_is_refused(tmp_path):
    path = write_tiny_gguf(Gemma, tmp_path / "g1.gguf", params=Gemma.tiny())
    with pytest.raises(Exception, match="attn_q_norm|post_attention_norm"):
        Gemma3(ModelFile(path), CPUBackend("f32"))


def test_plugins_lists_gemma():
    assert_plugin_provides("leat-arch-gemma", "architectures", ["gemma", "gemma2", "gemma3"])


@pytest.mark.parametrize("arch", list(FAMILY.values()), ids=list(FAMILY))
def test_cli_doctor_and_generate(tmp_path, arch):
    params = arch.tiny(window=4, pattern=2) if arch is not Gemma else arch.tiny()
    path = write_tiny_gguf(arch, tmp_path / f"{arch.names[0]}.gguf", params=params)
    doctor = leat_cli("doctor", "-m", str(path))
    assert doctor.returncode == 0, doctor.stderr
    assert f"architecture {arch.names[0]}" in doctor.stdout and "backend cpu: all tensor types" in doctor.stdout
    generated = leat_cli("generate", "-m", str(path), "-p", "hi", "-n", "8", "--backend", "cpu", "--json")
    assert generated.returncode == 0, generated.stderr
    out = json.loads(generated.stdout)
    assert out["timings"]["generated_tokens"] == 8 or out["timings"]["finish_reason"] == "stop", out
