"""MoE, MLA and sink models through the backend's host side against test_plumbing's fake driver (no GPU):
every launch matches its kernel's PTX signature, decode is captured as one graph (so nothing reads
device values back on the host mid-forward) and then replayed with one launch."""

import importlib.util
import re
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
from leat_backend_cuda import driver

Q = gguf.GGMLQuantizationType
_spec = importlib.util.spec_from_file_location("cuda_test_plumbing", Path(__file__).with_name("test_plumbing.py"))
plumbing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plumbing)


def architectures():
    qwen = pytest.importorskip("leat_arch_qwen3.qwen")
    gpt_oss = pytest.importorskip("leat_arch_gpt_oss.gpt_oss")
    deepseek = pytest.importorskip("leat_arch_deepseek2.deepseek2")
    return {
        "qwen3moe": (qwen.Qwen3Moe, {}, None),
        "gpt-oss-mxfp4": (gpt_oss.GptOss, {}, Q.MXFP4),
        "deepseek2-v3": (
            deepseek.DeepSeek2,
            {"gating": "sigmoid", "selection_bias": True, "groups": 4, "groups_used": 2, "weights_norm": True},
            None,
        ),
        "deepseek2-lite": (deepseek.DeepSeek2, {"q_rank": 0, "split_kv_b": False, "heads": 3}, None),
    }


@pytest.fixture
def fake(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("LEAT_HOME", str(tmp_path_factory.getbasetemp() / "leat-home"))
    fake = plumbing.FakeDriver()
    monkeypatch.setattr(driver, "_cu", lambda: fake)
    monkeypatch.setattr(driver, "_local", types.SimpleNamespace())
    original = driver.Kernel.__call__

    def checked(self, grid, block, *args, smem=0):
        plumbing._check_types(self, args)
        return original(self, grid, block, *args, smem=smem)

    monkeypatch.setattr(driver.Kernel, "__call__", checked)
    return fake


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss-mxfp4", "deepseek2-v3", "deepseek2-lite"])
def test_forward_prefill_decode_and_graph(fake, tmp_path, name):
    from leat_backend_cuda.backend import CUDABackend

    cls, overrides, expert_type = architectures()[name]
    params = cls.tiny(**overrides)
    types_ = {n: expert_type for n in cls.tensor_shapes(params) if n.endswith("_exps.weight")} if expert_type else None
    path = write_tiny_gguf(cls, tmp_path / f"{name}.gguf", Q.Q8_0, params=params, types=types_)
    backend = CUDABackend()
    model = cls(ModelFile(path), backend)
    kv = backend.allocate_kv(cls.kv_layouts(model.params), slots=10, context=64, dtype="f16")
    logits = model.forward(Batch([Row(0, 0, np.arange(20) % 300), Row(1, 0, np.arange(3))]), kv)
    assert logits.shape == (2, model.params.vocab)
    launched = {f for f, _, _ in fake.launches}
    # 23 tokens: grouped by expert; MXFP4 experts on tensor cores (gemm_grouped), the F32 ones in float32
    grouped = "gemm_grouped" if expert_type else "gemv_grouped"
    assert "moe_route" in launched and any(grouped in f for f in launched)
    fake.launches.clear()
    decode = Batch([Row(0, 20, np.array([5])), Row(1, 3, np.array([7]))])
    out = backend.run(model.forward, decode, kv)
    assert not backend.graph_failures and out.shape == (2, model.params.vocab)
    assert len(fake.captured) == 1 and "moe_route" in fake.captured[0]
    # a decode step's quantized experts (and per-head matrices) take the integer dot products (gemv_id_q); only
    # float matrices take gemv_id's float32 decode
    assert any(f.startswith("_Z9gemv_id_q") for f in fake.captured[0])
    assert all(re.match(r"_Z7gemv_idI(4TF32|4TF16|5TBF16)", f) for f in fake.captured[0] if f.startswith("_Z7gemv_id"))
    if name == "qwen3moe":  # the q/k norms and RoPE run inside the cache write; the residual adds inside the products
        step, layers = fake.captured[0], model.params.layers
        fused = "_Z13rope_kv_writeItLb1EEvPKfS1_S1_S1_S1_ffPfPT_S4_PtS5_PKiS7_S7_S7_PKdiiiiiifii"  # <u16, true>
        assert step.count(fused) == layers and not {"rope", "rope_norm"} & set(step)
        assert not [f for f in step if f.startswith("_Z8kv_write")]
        assert (
            step.count("rms_norm") == 2 * layers + 1
        )  # the blocks' two (float products take no pending norm), the output's
        assert step.count("moe_combine") == layers and "add" not in step
    fake.launches.clear()
    backend.run(model.forward, Batch([Row(1, 4, np.array([1])), Row(0, 21, np.array([2]))]), kv)
    assert [f for f, _, _ in fake.launches] == ["graph"]
    # ten rows (bucket 12): the grouped expert products, grouping kernel included, inside a graph
    wide = Batch(
        [Row(s, 0, np.array([s])) for s in range(2, 10)] + [Row(0, 22, np.array([3])), Row(1, 5, np.array([4]))]
    )
    backend.run(model.forward, wide, kv)
    assert not backend.graph_failures and len(fake.captured) == 2
    assert any(grouped in f for f in fake.captured[1]) and "moe_group" in fake.captured[1]


def test_latent_decode_attention_cuts_each_tokens_range(fake, tmp_path, monkeypatch):
    """As the GQA kernel (test_plumbing's test_decode_attention_cuts_each_tokens_range_not_the_launchs): a captured
    one-token step over a 32,768-position latent cache launches mla_attention with 256 splits (two blocks a
    multiprocessor, rounded to splits of 128) and passes it MLA_SPLIT_KEYS, the unit it cuts each token's own range
    by, not the launch's 128; attention_combine merges the 256 splits, a block a head and up to 128 latent values."""
    from leat_backend_cuda.backend import CUDABackend
    from leat_backend_cuda.mla import MLA_SPLIT_KEYS

    cls, overrides, _ = architectures()["deepseek2-lite"]
    path = write_tiny_gguf(cls, tmp_path / "ds.gguf", Q.Q8_0, params=cls.tiny(**overrides))
    backend = CUDABackend()
    model = cls(ModelFile(path), backend)
    kv = backend.allocate_kv(cls.kv_layouts(model.params), slots=1, context=32768, dtype="f16")
    launch, seen, merged = driver.Kernel.__call__, [], []

    def call(self, grid, block, *args, **kw):
        if self.name.startswith("mla_attention"):  # (..., window, keys, scale)
            seen.append((grid[2], args[-2]))
        if self.name == "attention_combine":  # (part_ml, part_acc, out, nsplit, dv, sinks, heads)
            merged.append((tuple(grid), block, args[3], args[4]))
        return launch(self, grid, block, *args, **kw)

    monkeypatch.setattr(driver.Kernel, "__call__", call)
    backend.run(model.forward, Batch([Row(0, 100, np.array([5]))]), kv)
    assert not backend.graph_failures and len(seen) == 2 * model.params.layers  # the eager pass, then the capture
    assert set(seen) == {(256, MLA_SPLIT_KEYS)}, seen
    heads, rank = model.params.heads, model.params.kv_rank
    threads = min(128, -(-rank // 32) * 32)
    assert set(merged) == {((heads, -(-rank // threads)), threads, 256, rank)}, merged


def test_latent_decode_attention_on_tensor_cores_launches(fake, tmp_path, monkeypatch):
    """By default at DeepSeek's latent shape (512 + 64), a captured one-token step launches mla_attention_tc, a block
    of 16 heads (20 heads: two), with its signature's arguments (the fake driver checks them against the PTX) and
    MLA_TC_KEYS as the unit of its splits; attention_combine merges them. A captured step of 12 one-token rows and
    a prefill chunk of 12 tokens (past GEMV_MAX_TOKENS, short of the cuBLAS prefill's MLA_GEMM_MIN_TOKENS) keep
    mla_attention, as does a decode step with LEAT_CUDA_MLA_TC=0."""
    from leat_backend_cuda.backend import CUDABackend
    from leat_backend_cuda.mla import MLA_TC_KEYS

    monkeypatch.delenv("LEAT_CUDA_MLA_TC", raising=False)
    cls, overrides, _ = architectures()["deepseek2-lite"]
    params = cls.tiny(**{**overrides, "heads": 20, "kv_rank": 512, "rope": 64})
    path = write_tiny_gguf(cls, tmp_path / "ds.gguf", Q.Q8_0, params=params)
    backend = CUDABackend()
    model = cls(ModelFile(path), backend)
    kv = backend.allocate_kv(cls.kv_layouts(model.params), slots=1, context=4096, dtype="f16")
    launch, seen, merged = driver.Kernel.__call__, [], []

    def call(self, grid, block, *args, **kw):
        if self.name.startswith("mla_attention"):
            seen.append((self.name, tuple(grid), args[-2]))
        if self.name == "attention_combine":
            merged.append(args[3])
        return launch(self, grid, block, *args, **kw)

    monkeypatch.setattr(driver.Kernel, "__call__", call)
    backend.run(model.forward, Batch([Row(0, 100, np.array([5]))]), kv)
    assert not backend.graph_failures and len(seen) == 2 * model.params.layers
    splits = {grid[2] for _, grid, _ in seen}
    assert {(name, grid[:2], keys) for name, grid, keys in seen} == {
        ("mla_attention_tc<u16, 512, 64>", (1, 2), MLA_TC_KEYS)
    }
    assert len(splits) == 1 and splits.pop() > 1 and set(merged) == {seen[0][1][2]}
    seen.clear()
    backend.run(model.forward, Batch([Row(0, 101, np.arange(12))]), kv)
    assert len(seen) == 2 * model.params.layers and {name.split("<")[0] for name, *_ in seen} == {"mla_attention"}
    seen.clear()
    model.forward(Batch([Row(0, 113, np.arange(12))]), kv)
    monkeypatch.setenv("LEAT_CUDA_MLA_TC", "0")
    model.forward(Batch([Row(0, 125, np.array([5]))]), kv)
    assert len(seen) == 2 * model.params.layers and {name.split("<")[0] for name, *_ in seen} == {"mla_attention"}
