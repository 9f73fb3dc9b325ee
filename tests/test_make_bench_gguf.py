"""scripts/bench/make_bench_gguf.py: the MoE and MLA benchmark files, at tiny shapes with a tiny tokenizer, hold
llama.cpp's Q4_K_M / MXFP4_MOE tensor types, decode to small finite weights (gguf's own dequantizer) and run in leat."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from leat import load
from leat.testing import add_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("make_bench_gguf", ROOT / "scripts" / "bench" / "make_bench_gguf.py")
bench = sys.modules["make_bench_gguf"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(bench)

Q = gguf.GGMLQuantizationType
VOCAB = 300
TINY = {  # row lengths below 256 where the real ones are not multiples of 256, so the fallbacks show
    "qwen3moe-30b-a3b": {"embd": 256, "heads": 4, "kv": 2, "head_dim": 64, "ff": 512, "experts": 8, "ff_exp": 256},
    "gpt-oss-20b": {"embd": 96, "heads": 4, "kv": 2, "head_dim": 32, "ff": 96, "experts": 4, "used": 2, "ff_exp": 96},
    "deepseek2-lite": {
        "embd": 256, "heads": 2, "ff": 352, "experts": 4, "used": 2, "ff_exp": 160, "shared": 2,
        "kv_lora": 256, "nope": 32, "rope": 32, "v_head": 32,
    },
}  # fmt: skip
# (tensor, type, GGUF shape) per kind, as llama-quant.cpp picks them for these shapes and 2 layers
EXPECTED = {
    "qwen3moe-30b-a3b": [
        ("token_embd.weight", Q.Q4_K, [256, VOCAB]),
        ("output.weight", Q.Q6_K, [256, VOCAB]),
        ("blk.0.attn_v.weight", Q.Q4_K, [256, 128]),  # use_more_bits: the last eighth (layer 1 of 2) only
        ("blk.1.attn_v.weight", Q.Q6_K, [256, 128]),
        ("blk.0.ffn_gate_inp.weight", Q.F32, [256, 8]),
        ("blk.0.ffn_gate_exps.weight", Q.Q4_K, [256, 256, 8]),
        ("blk.0.ffn_down_exps.weight", Q.Q4_K, [256, 256, 8]),
        ("blk.1.ffn_down_exps.weight", Q.Q6_K, [256, 256, 8]),
    ],
    "gpt-oss-20b": [
        ("token_embd.weight", Q.Q8_0, [96, VOCAB + 8]),  # the tokenizer padded to the model's vocabulary
        ("blk.0.attn_q.weight", Q.Q8_0, [96, 128]),
        ("blk.0.attn_sinks.weight", Q.F32, [4]),
        ("blk.1.ffn_up_exps.weight", Q.MXFP4, [96, 96, 4]),
        ("blk.1.ffn_down_exps.bias", Q.F32, [96, 4]),
    ],
    "deepseek2-lite": [
        ("blk.0.ffn_down.weight", Q.Q5_0, [352, 256]),  # Q4_K falls back: 352 is no whole 256-block
        ("blk.0.attn_k_b.weight", Q.Q5_0, [32, 256, 2]),
        ("blk.0.attn_v_b.weight", Q.Q4_K, [256, 32, 2]),
        ("blk.1.ffn_down_exps.weight", Q.Q8_0, [160, 256, 4]),  # Q6_K falls back
        ("blk.1.ffn_down_shexp.weight", Q.Q8_0, [320, 256]),
        ("blk.1.ffn_gate_shexp.weight", Q.Q4_K, [256, 320]),
    ],
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    for name in set(bench.VOCAB.values()):  # tiny stand-ins for llama.cpp's vocab-only files
        w = gguf.GGUFWriter(tmp / name, "llama")
        add_tiny_tokenizer(w, VOCAB)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
    out = {}
    for kind, shape in TINY.items():
        vocab = VOCAB + 8 if kind == "gpt-oss-20b" else VOCAB
        spec = dataclasses.replace(bench.SHAPES[kind], vocab=vocab, **shape)
        out[kind] = tmp / f"{kind}.gguf"
        bench.write(kind, str(out[kind]), layers=2, spec=spec, vocab=tmp)
    return out


@pytest.mark.parametrize("kind", list(TINY))
def test_tensor_types_shapes_and_values(files, kind):
    reader = gguf.GGUFReader(files[kind])
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields[f"{bench.SHAPES[kind].arch}.block_count"].contents() == 2
    for name, qtype, shape in EXPECTED[kind]:
        assert (name, tensors[name].tensor_type, tensors[name].shape.tolist()) == (name, qtype, shape)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        assert np.isfinite(values).all() and np.abs(values).max() < 1.5, t.name


@pytest.mark.parametrize("kind", list(TINY))
def test_leat_runs_it(files, kind):
    model = load(str(files[kind]), backend="cpu")
    logits = model.logits(model.tokenize("hello world"))
    assert logits.shape[-1] == gguf.GGUFReader(files[kind]).tensors[0].shape[-1]
    assert np.isfinite(logits).all() and logits.std() > 0


def test_layers_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench.main(["qwen3moe-30b-a3b", "/nonexistent.gguf", "--layers", "-1"])
    assert "--layers must be at least 1" in capsys.readouterr().err
