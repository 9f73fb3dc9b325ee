import json

import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.conformance.architecture import assert_chunked_and_batched_equal_whole, assert_metadata_round_trips
from leat.modelfile import ModelFile
from leat.testing import assert_plugin_provides, leat_cli, write_tiny_gguf
from leat_arch_deepseek2.deepseek2 import DeepSeek2
from leat_backend_cpu.backend import CPUBackend

VARIANTS = {
    "v2": {},
    "lite-kv-b": {"q_rank": 0, "split_kv_b": False, "heads": 3},
    "v3-yarn": {
        "gating": "sigmoid",
        "selection_bias": True,
        "groups": 4,
        "groups_used": 2,
        "weights_norm": True,
        "weights_scale": 2.5,
        "rope_scaling": "yarn",
        "rope_factor": 4.0,
        "yarn_context": 16,
        "yarn_log_mul": 0.0707,
    },
}


def build(tmp_path, precision="f64", **overrides):
    path = write_tiny_gguf(DeepSeek2, tmp_path / "ds.gguf", params=DeepSeek2.tiny(**overrides))
    backend = CPUBackend(precision)
    return DeepSeek2(ModelFile(path), backend), backend, path


def run(model, backend, rows, kv=None):
    kv = kv or backend.allocate_kv(model.kv_layouts(model.params), 3, 64, page_size=4)
    return backend.to_host(model.forward(Batch(rows), kv)), kv


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_chunked_and_batched_equal_whole(tmp_path, overrides):
    model, backend, _ = build(tmp_path, **overrides)
    assert_chunked_and_batched_equal_whole(model, backend)


def test_kv_cache_holds_the_latent_only():
    p = DeepSeek2.tiny()
    layouts = DeepSeek2.kv_layouts(p)
    assert layouts == [KVLayout(1, p.kv_rank + p.rope, p.kv_rank, latent=True)] * p.layers
    assert layouts[0].bytes_per_token(2) == (32 + 8) * 2  # one latent and one rope key per token
    kv = CPUBackend("f32").allocate_kv(layouts, 1, 8)
    assert kv.k[0].shape[-1] == 40 and kv.v[0].size == 0


def test_split_and_unsplit_kv_b_are_the_same_model(tmp_path):
    """attn_kv_b split and transposed at load equals the converter's attn_k_b / attn_v_b."""
    split, backend, path = build(tmp_path)
    import gguf
    from leat.blocks import layer_tensor

    T = gguf.MODEL_TENSOR
    p = split.params
    old = tmp_path / "kv_b.gguf"
    writer = gguf.GGUFWriter(old, "deepseek2")
    DeepSeek2.write_metadata(writer, DeepSeek2.tiny(split_kv_b=False))
    source = ModelFile(path)
    for name, tensor in source.tensors.items():
        if ".attn_k_b." in name or ".attn_v_b." in name:
            continue
        writer.add_tensor(name, np.asarray(tensor.data))
    for i in range(p.layers):
        k_b = source.tensor(layer_tensor(T.ATTN_K_B, i)).data  # [heads, kv_rank, nope]
        v_b = source.tensor(layer_tensor(T.ATTN_V_B, i)).data  # [heads, v, kv_rank]
        kv_b = np.concatenate([np.asarray(k_b).transpose(0, 2, 1), np.asarray(v_b)], axis=1)
        writer.add_tensor(layer_tensor(T.ATTN_KV_B, i), kv_b.reshape(-1, p.kv_rank))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    unsplit = DeepSeek2(ModelFile(old), backend)
    ids = np.arange(1, 30)
    np.testing.assert_allclose(
        run(unsplit, backend, [Row(0, 0, ids, all_logits=True)])[0],
        run(split, backend, [Row(0, 0, ids, all_logits=True)])[0],
        atol=1e-9,
    )


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_metadata_round_trips(tmp_path, overrides):
    assert_metadata_round_trips(DeepSeek2, DeepSeek2.tiny(**overrides), tmp_path, ("norm_eps", "yarn_log_mul"))


def test_yarn_scale_as_llamacpp():
    # DeepSeek-V2 style: factor 40, mscale_all_dim 0.707 (stored x0.1): kq scale mscale^2 / sqrt(192)
    p = DeepSeek2.tiny(nope=128, rope=64, rope_scaling="yarn", rope_factor=40.0, yarn_context=4096, yarn_log_mul=0.0707)
    spec, scale = DeepSeek2.rope_and_scale(p)
    mscale = 1 + 0.1 * 0.707 * np.log(40.0)
    assert scale == pytest.approx(mscale**2 / np.sqrt(192), rel=1e-6)
    assert spec.attn_factor == pytest.approx(1.0)  # the rotation's magnitude nets to 1
    _, plain = DeepSeek2.rope_and_scale(DeepSeek2.tiny())
    assert plain == pytest.approx(24**-0.5)


def test_plugins_lists_deepseek2():
    assert_plugin_provides("leat-arch-deepseek2", "architectures", ["deepseek2"])


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_cli_doctor_and_generate(tmp_path, overrides):
    path = write_tiny_gguf(DeepSeek2, tmp_path / "ds.gguf", params=DeepSeek2.tiny(**overrides))
    doctor = leat_cli("doctor", "-m", str(path))
    assert doctor.returncode == 0, doctor.stderr
    assert "architecture deepseek2" in doctor.stdout and "KV bytes per token: f32 480," in doctor.stdout
    generated = leat_cli("generate", "-m", str(path), "-p", "hi", "-n", "8", "--backend", "cpu", "--json")
    assert generated.returncode == 0, generated.stderr
    out = json.loads(generated.stdout)
    assert out["timings"]["generated_tokens"] == 8 or out["timings"]["finish_reason"] == "stop", out
