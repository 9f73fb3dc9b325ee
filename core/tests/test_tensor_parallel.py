"""Tensor parallelism on the CPU (leat.parallel): two CPU backends as two "devices", against the unsplit model."""

import gguf
import leat
import numpy as np
import pytest
from leat.compare import compare
from leat.doctor import describe_model
from leat.engine import Engine, GenerationRequest
from leat.errors import BackendUnavailable, LeatError
from leat.modelfile import ModelFile
from leat.parallel import NcclCollective, split_of
from leat.testing import write_tiny_gguf

Q8_0 = gguf.GGMLQuantizationType.Q8_0
FAMILIES = {
    "llama": ("leat_arch_llama.llama", "Llama", {}),
    "qwen3": ("leat_arch_qwen3.qwen", "Qwen3", {}),
    "gemma3": ("leat_arch_gemma.gemma", "Gemma3", {"layers": 3, "window": 8, "pattern": 3}),
    "deepseek2": ("leat_arch_deepseek2.deepseek2", "DeepSeek2", {}),  # MLA and MoE with shared experts
    "gpt-oss": ("leat_arch_gpt_oss.gpt_oss", "GptOss", {}),  # sinks by head, biases of row-parallel layers and experts
}


def architecture(family):
    module, name, _ = FAMILIES[family]
    return getattr(pytest.importorskip(module), name)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out, folder = {}, tmp_path_factory.mktemp("tp")
    for family, (_, _, overrides) in FAMILIES.items():
        arch = architecture(family)
        out[family] = write_tiny_gguf(arch, folder / f"{family}.gguf", params=arch.tiny(context=512, **overrides))
    llama = architecture("llama")
    out["llama-q8_0"] = write_tiny_gguf(llama, folder / "q8.gguf", Q8_0, params=llama.tiny(tied=False))
    return out


def logits(path, precision, ranks, ids):
    model = leat.load(str(path), backend="cpu", precision=precision, tensor_parallel=ranks)
    return model, model.logits(ids, native=True)


IDS = np.random.default_rng(0).integers(0, 290, 48)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_equal_one_on_the_f64_oracle_and_within_the_bars_at_f32(files, family):
    _, whole = logits(files[family], "f64", 1, IDS)
    model, split = logits(files[family], "f64", 2, IDS)
    assert model.backend.describe()["tensor_parallel"] == 2
    assert np.abs(split - whole).max() <= 1e-9 * np.abs(whole).max()
    _, whole32 = logits(files[family], "f32", 1, IDS)
    _, split32 = logits(files[family], "f32", 2, IDS)
    for ref, label in ((whole, "f64 TP=1"), (whole32.astype(np.float64), "f32 TP=1")):
        agreement = compare(ref, split32, label=f"{family} f32 TP=2 vs {label}")
        assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def test_quantized_weights_split_in_whole_blocks(files):
    _, whole = logits(files["llama-q8_0"], "f32", 1, IDS)
    model, split = logits(files["llama-q8_0"], "f32", 2, IDS)
    assert model.backend.ranks[0].describe()["weights"] == "quantized"
    agreement = compare(whole.astype(np.float64), split)
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)


def test_a_cut_inside_a_quant_block_is_refused_naming_the_tensor(tmp_path):
    arch = architecture("qwen3")  # ffn 96: down's columns split 48 + 48, not whole blocks of 32
    path = write_tiny_gguf(arch, tmp_path / "q.gguf", Q8_0)
    with pytest.raises(LeatError, match=r"ffn_down.weight .* whole blocks of 32 \(Q8_0\)"):
        leat.load(str(path), backend="cpu", tensor_parallel=2)


@pytest.mark.parametrize("family", ["llama", "deepseek2"])
def test_each_rank_holds_half_of_what_is_split(files, family):
    path = files[family]
    whole = leat.load(str(path), backend="cpu", precision="f64").backend.allocations.weights
    ranks = leat.load(str(path), backend="cpu", precision="f64", tensor_parallel=2).backend.ranks
    file = ModelFile(path)
    # replicated: the embedding, every norm, and (deepseek2) the router and the shared latent projections
    kept = ("token_embd", "norm", "ffn_gate_inp", "exp_probs_b", "attn_kv_a_mqa", "attn_q_a.")
    replicated = sum(8 * t.data.size for name, t in file.tensors.items() if any(k in name for k in kept))
    assert replicated < whole / 2
    for rank in ranks:
        assert rank.allocations.weights == replicated + (whole - replicated) // 2


def test_kv_cache_split_by_kv_head(files):
    for family, per_rank in (("llama", 1), ("qwen3", 1), ("deepseek2", 1)):
        model = leat.load(str(files[family]), backend="cpu", tensor_parallel=2)
        arch = model.architecture
        layouts = arch.kv_layouts(arch.params)
        kv = model.backend.allocate_kv(layouts, 2, 64, dtype="f16")
        for rank_kv in kv.ranks:
            for layer, layout in enumerate(layouts):
                heads = layout.kv_heads if layout.latent else layout.kv_heads // 2
                assert rank_kv.k[layer].shape[2] == heads == per_rank
        assert model.backend.allocations.kv == sum(r.allocations.kv for r in model.backend.ranks)


def test_heads_that_do_not_divide_are_refused_at_load(tmp_path):
    llama = architecture("llama")
    path = write_tiny_gguf(llama, tmp_path / "l.gguf")
    with pytest.raises(LeatError, match=r"4 query heads do not split over --tensor-parallel 3.*one of 1, 2, 4"):
        leat.load(str(path), backend="cpu", tensor_parallel=3)
    one_kv = write_tiny_gguf(llama, tmp_path / "mqa.gguf", params=llama.tiny(kv_heads=1))
    with pytest.raises(LeatError, match=r"1 KV heads \(layer 0\) do not split over --tensor-parallel 2"):
        leat.load(str(one_kv), backend="cpu", tensor_parallel=2)
    assert "do not split" in describe_model(str(one_kv), 2)["tensor_parallel"]["refused"]


def test_engine_decodes_a_batch_to_the_same_greedy_tokens(files):
    prompts = [np.random.default_rng(s).integers(0, 290, n).tolist() for s, n in enumerate((5, 33, 17))]
    out = {}
    for ranks in (1, 2):
        model = leat.load(str(files["qwen3"]), backend="cpu", precision="f32", tensor_parallel=ranks)
        engine = Engine(model, batch_size=3, max_context=128, page_size=8, prefill_chunk=16).start()
        try:
            handles = [engine.submit(GenerationRequest(p, 16, {"temperature": 0})) for p in prompts]
            out[ranks] = [[t for e in h for t in e.ids] for h in handles]
        finally:
            engine.stop()
    assert out[2] == out[1] and all(len(tokens) == 16 for tokens in out[1])


def test_doctor_states_what_each_rank_holds(files):
    fit = describe_model(str(files["llama"]), 2, device_memory=2**30)["tensor_parallel"]["backends"]["cpu"]
    whole = describe_model(str(files["llama"]))["backend_weight_bytes"]["cpu"]
    assert whole / 2 < fit["weight_bytes_per_rank"] < whole and fit["fits"] is True
    tight = describe_model(str(files["llama"]), 2, device_memory=1000)["tensor_parallel"]["backends"]["cpu"]
    assert tight["fits"] is False


def test_roles_come_from_gguf_names_and_nccl_is_a_clear_refusal():
    assert split_of("blk.3.attn_q.weight", 2) == 0 and split_of("blk.3.attn_q.bias", 1) == 0
    assert split_of("blk.3.ffn_down.weight", 2) == 1 and split_of("blk.3.attn_output.bias", 1) == "first"
    assert split_of("blk.3.ffn_up_exps.weight", 3) == 1 and split_of("blk.3.ffn_down_exps.weight", 3) == 2
    assert split_of("token_embd.weight", 2) is None and split_of("blk.0.attn_norm.weight", 1) is None
    with pytest.raises(BackendUnavailable, match="needs 2 GPUs"):
        NcclCollective([None, None])
