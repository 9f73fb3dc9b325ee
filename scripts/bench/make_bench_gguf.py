#!/usr/bin/env python3
"""Write a full-size, random-weight GGUF for speed and memory benchmarks.

The weights are random but valid quantized blocks, laid out as llama.cpp's
Q4_K_M recipe (src/llama-quant.cpp) lays out a real model: Q4_K for most matrices, Q6_K for the
output, and for attn_v / ffn_down (ffn_down_exps too) in the first and last eighth of the layers
and every third layer between; a row length Q4_K / Q6_K cannot split falls back to Q5_0 / Q8_0.
gpt-oss-20b is laid out as the released GGUFs are (MXFP4_MOE: MXFP4 experts, Q8_0 for the other
matrices). Routers (ffn_gate_inp) are small random float32 so tokens spread over the experts;
norms are ones, biases and attention sinks zeros. Numbers produced with it are about speed and
memory, never about quality.

    python make_bench_gguf.py llama3-8b         /tmp/llama3-8b-q4km.gguf
    python make_bench_gguf.py qwen3-8b          /tmp/qwen3-8b-q4km.gguf
    python make_bench_gguf.py llama3-1b         /tmp/llama3-1b-q4km.gguf   # quick runs
    python make_bench_gguf.py qwen3moe-30b-a3b  /tmp/qwen3moe-30b-a3b-q4km.gguf
    python make_bench_gguf.py gpt-oss-20b       /tmp/gpt-oss-20b-mxfp4.gguf
    python make_bench_gguf.py deepseek2-lite    /tmp/deepseek2-lite-q4km.gguf
    python make_bench_gguf.py qwen3moe-30b-a3b  /tmp/small.gguf --layers 2  # same shapes, 2 layers

The tokenizer is a real one, copied from vocabulary-only GGUF files in vocab/ beside this script,
so text prompts tokenize as with the real model: Llama 3's, Qwen2/3's (qwen3, qwen3moe),
DeepSeek-LLM's (deepseek2, as DeepSeek-V2-Lite's). gpt-oss's o200k is not available offline: its
file takes the Qwen2 tokenizer padded with [PADn] tokens to o200k_harmony's 201,088 entries, so
the embedding and output matrices have the real model's size. The vocab files are not kept in this
repository (17 MB): copy ggml-vocab-llama-bpe.gguf, ggml-vocab-qwen2.gguf and
ggml-vocab-deepseek-llm.gguf there from llama.cpp's models/ folder (as shipped in the
llama-cpp-python 0.3.36 sdist on PyPI; MIT).

Needs only numpy and gguf.
"""

from __future__ import annotations

import argparse
import pathlib
from dataclasses import dataclass

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """A model's shapes; the MoE and MLA fields stay 0 where the model has none."""

    arch: str
    layers: int
    embd: int
    heads: int
    kv: int
    ff: int
    vocab: int
    theta: float
    head_dim: int = 0  # 0: embd // heads
    ctx: int = 8192
    experts: int = 0  # routed experts (3-D ffn_*_exps), ``used`` of them per token, ``ff_exp`` wide
    used: int = 0
    ff_exp: int = 0
    shared: int = 0  # shared experts (one ffn_*_shexp of shared * ff_exp)
    dense: int = 0  # leading layers with a dense FFN (ff wide) instead of experts
    kv_lora: int = 0  # MLA (deepseek2, no q lora): the compressed KV width and the per-head dimensions
    nope: int = 0
    rope: int = 0
    v_head: int = 0


SHAPES = {
    "llama3-8b": Shape("llama", 32, 4096, 32, 8, 14336, 128256, 500000.0),
    "llama3-1b": Shape("llama", 16, 2048, 32, 8, 8192, 128256, 500000.0),
    "qwen3-8b": Shape("qwen3", 36, 4096, 32, 8, 12288, 151936, 1e6),
    "qwen3moe-30b-a3b": Shape(
        "qwen3moe", 48, 2048, 32, 4, 6144, 151936, 1e6, head_dim=128, ctx=40960, experts=128, used=8, ff_exp=768
    ),
    "gpt-oss-20b": Shape(
        "gpt-oss", 24, 2880, 64, 8, 2880, 201088, 150000.0, head_dim=64, ctx=131072, experts=32, used=4, ff_exp=2880
    ),
    "deepseek2-lite": Shape(
        "deepseek2",
        27,
        2048,
        16,
        1,
        10944,
        102400,
        10000.0,
        ctx=163840,
        experts=64,
        used=6,
        ff_exp=1408,
        shared=2,
        dense=1,
        kv_lora=512,
        nope=128,
        rope=64,
        v_head=128,
    ),
}

VOCAB = {
    "llama": "ggml-vocab-llama-bpe.gguf",
    "qwen3": "ggml-vocab-qwen2.gguf",
    "qwen3moe": "ggml-vocab-qwen2.gguf",
    "gpt-oss": "ggml-vocab-qwen2.gguf",
    "deepseek2": "ggml-vocab-deepseek-llm.gguf",
}
# Each block's scale field: (byte offset, value); small so activations stay finite through every layer.
SCALES = {
    Q.Q4_K: ((0, 3e-5), (2, 3e-5)),  # d, dmin (f16) lead the block
    Q.Q6_K: ((-2, 1e-5),),  # d (f16) ends the block
    Q.Q5_0: ((0, 1e-3),),
    Q.Q8_0: ((0, 1e-4),),
}
MXFP4_E = 119  # E8M0 exponent byte: largest value 6 * 2^(119-127) ~ 0.023
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama-quant.cpp's tensor_type_fallback


def copy_tokenizer(w: gguf.GGUFWriter, vocab_file: pathlib.Path, n_vocab: int) -> None:
    """Copy every tokenizer.* key of a vocabulary-only GGUF, padding the vocabulary to ``n_vocab`` with
    [PADn] tokens (as llama.cpp's converter pads a tokenizer shorter than the model's embedding)."""
    r = gguf.GGUFReader(vocab_file)
    n_file = len(r.fields["tokenizer.ggml.tokens"].data)
    assert n_file <= n_vocab, vocab_file
    pad = n_vocab - n_file
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype != gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype)
        elif key == "tokenizer.ggml.tokens":
            w.add_array(key, field.contents() + [f"[PAD{n_file + i}]" for i in range(pad)])
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, field.contents() + [int(gguf.TokenType.UNUSED)] * pad)
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, field.contents() + [0.0] * pad)
        else:
            w.add_array(key, field.contents())


class Blocks:
    """Pools of random, valid quantized blocks; tensors are views into them (the file repeats the pool)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.pools: dict[Q, np.ndarray] = {}

    def pool(self, qtype: Q, n_blocks: int) -> np.ndarray:
        have = self.pools.get(qtype)
        if have is None or len(have) < n_blocks:
            block_size = gguf.GGML_QUANT_SIZES[qtype][1]
            have = self.rng.integers(0, 256, size=(n_blocks, block_size), dtype=np.uint8)
            for at, value in SCALES.get(qtype, ()):
                have[:, at : at + 2 if at >= 0 else None] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
            if qtype == Q.MXFP4:
                have[:, 0] = MXFP4_E
            self.pools[qtype] = have
        return have

    def add(self, w: gguf.GGUFWriter, name: str, qtype: Q, rows: int, cols: int, experts: int = 0) -> None:
        """Add ``name`` with ``rows`` x ``cols`` elements (per expert when ``experts``), ``cols`` the row length
        (GGUF's ne[0]); Q4_K / Q6_K fall back as llama.cpp's quantizer does when ``cols`` is no whole block."""
        if qtype in FALLBACK and cols % 256:
            qtype = FALLBACK[qtype]
        block_elems, block_size = gguf.GGML_QUANT_SIZES[qtype]
        n = max(experts, 1) * rows * cols // block_elems
        shape = (experts, rows) if experts else (rows,)
        data = self.pool(qtype, n)[:n].reshape(*shape, cols // block_elems * block_size)
        w.add_tensor(name, data, raw_dtype=qtype)


def more_bits(i: int, n_layer: int) -> bool:
    """llama-quant.cpp's use_more_bits: Q4_K_M's Q6_K layers for attn_v and ffn_down."""
    return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2


def header(w: gguf.GGUFWriter, kind: str, s: Shape, n_layer: int) -> None:
    head_dim = s.head_dim or s.embd // s.heads
    w.add_name(f"bench-{kind}-{'mxfp4' if s.arch == 'gpt-oss' else 'q4_k_m'}-random")
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(s.ff)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv)
    w.add_rope_freq_base(s.theta)
    w.add_layer_norm_rms_eps(1e-5 if s.arch in ("llama", "gpt-oss") else 1e-6)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.used)
        w.add_expert_feed_forward_length(s.ff_exp)
    if s.arch == "deepseek2":  # as the converter writes DeepSeek-V2-Lite's config
        w.add_key_length(s.kv_lora + s.rope)
        w.add_value_length(s.kv_lora)
        w.add_key_length_mla(s.nope + s.rope)
        w.add_value_length_mla(s.v_head)
        w.add_kv_lora_rank(s.kv_lora)
        if n_layer not in (26, 27):  # llama.cpp tells a no-q-lora "lite" model by its layer count
            w.add_q_lora_rank(0)
        w.add_leading_dense_block_count(s.dense)
        w.add_vocab_size(s.vocab)
        w.add_expert_shared_count(s.shared)
        w.add_expert_weights_scale(1.0)
        w.add_rope_dimension_count(s.rope)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(40.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_log_mul(0.1 * 0.707)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
    if s.arch == "gpt-oss":  # as the released GGUFs' metadata says
        w.add_sliding_window(128)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    else:
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)


def f32(w: gguf.GGUFWriter, name: str, *shape: int, value: float = 1.0) -> None:
    w.add_tensor(name, np.full(shape, value, dtype=np.float32))


def attention(w: gguf.GGUFWriter, b: Blocks, s: Shape, i: int, n_layer: int) -> None:
    """One layer's attention: GQA (llama, qwen3, qwen3moe, gpt-oss) or MLA (deepseek2, no q lora)."""
    p, embd, heads = f"blk.{i}.", s.embd, s.heads
    mat = Q.Q8_0 if s.arch == "gpt-oss" else Q.Q4_K
    f32(w, p + "attn_norm.weight", embd)
    if s.arch == "deepseek2":
        lora, nope, v_head = s.kv_lora, s.nope, s.v_head
        b.add(w, p + "attn_q.weight", mat, heads * (nope + s.rope), embd)
        b.add(w, p + "attn_kv_a_mqa.weight", mat, lora + s.rope, embd)
        f32(w, p + "attn_kv_a_norm.weight", lora)
        b.add(w, p + "attn_k_b.weight", mat, lora, nope, experts=heads)  # [heads, lora, nope]: k_b transposed
        b.add(w, p + "attn_v_b.weight", mat, v_head, lora, experts=heads)
        b.add(w, p + "attn_output.weight", mat, embd, heads * v_head)
        return
    head_dim = s.head_dim or embd // heads
    v_type = mat if mat == Q.Q8_0 or not more_bits(i, n_layer) else Q.Q6_K
    if s.arch.startswith("qwen3"):
        f32(w, p + "attn_q_norm.weight", head_dim)
        f32(w, p + "attn_k_norm.weight", head_dim)
    b.add(w, p + "attn_q.weight", mat, heads * head_dim, embd)
    b.add(w, p + "attn_k.weight", mat, s.kv * head_dim, embd)
    b.add(w, p + "attn_v.weight", v_type, s.kv * head_dim, embd)
    b.add(w, p + "attn_output.weight", mat, embd, heads * head_dim)
    if s.arch == "gpt-oss":
        for part, n in (("q", heads), ("k", s.kv), ("v", s.kv)):
            f32(w, p + f"attn_{part}.bias", n * head_dim, value=0.0)
        f32(w, p + "attn_output.bias", embd, value=0.0)
        f32(w, p + "attn_sinks.weight", heads, value=0.0)


def ffn(w: gguf.GGUFWriter, b: Blocks, s: Shape, i: int, n_layer: int) -> None:
    """One layer's MLP: dense, routed experts (3-D ffn_*_exps and a float32 router), or both with shared experts."""
    p, embd = f"blk.{i}.", s.embd
    down = Q.Q6_K if more_bits(i, n_layer) else Q.Q4_K
    f32(w, p + ("post_attention_norm.weight" if s.arch == "gpt-oss" else "ffn_norm.weight"), embd)
    if not s.experts or i < s.dense:
        b.add(w, p + "ffn_gate.weight", Q.Q4_K, s.ff, embd)
        b.add(w, p + "ffn_up.weight", Q.Q4_K, s.ff, embd)
        b.add(w, p + "ffn_down.weight", down, embd, s.ff)
        return
    n, ff = s.experts, s.ff_exp
    w.add_tensor(p + "ffn_gate_inp.weight", (b.rng.standard_normal((n, embd)) * 0.02).astype(np.float32))
    gate_up = Q.MXFP4 if s.arch == "gpt-oss" else Q.Q4_K
    down = Q.MXFP4 if s.arch == "gpt-oss" else down
    b.add(w, p + "ffn_gate_exps.weight", gate_up, ff, embd, experts=n)
    b.add(w, p + "ffn_up_exps.weight", gate_up, ff, embd, experts=n)
    b.add(w, p + "ffn_down_exps.weight", down, embd, ff, experts=n)
    if s.arch == "gpt-oss":
        f32(w, p + "ffn_gate_inp.bias", n, value=0.0)
        for part, m in (("gate", ff), ("up", ff), ("down", embd)):
            f32(w, p + f"ffn_{part}_exps.bias", n, m, value=0.0)
    if s.shared:
        b.add(w, p + "ffn_gate_shexp.weight", Q.Q4_K, ff * s.shared, embd)
        b.add(w, p + "ffn_up_shexp.weight", Q.Q4_K, ff * s.shared, embd)
        b.add(w, p + "ffn_down_shexp.weight", down, embd, ff * s.shared)


def write(kind: str, path: str, layers: int = 0, spec: Shape | None = None, vocab: pathlib.Path | None = None) -> None:
    """Write ``kind`` to ``path``; ``layers`` keeps the shapes with fewer layers (the Q4_K_M recipe's layer
    choices follow the written count, as quantizing such a model would); ``spec`` / ``vocab_dir`` override the
    shapes and the vocab folder (tests)."""
    s = spec or SHAPES[kind]
    n_layer = layers or s.layers
    w = gguf.GGUFWriter(path, s.arch)
    header(w, kind, s, n_layer)
    copy_tokenizer(w, (vocab or pathlib.Path(__file__).with_name("vocab")) / VOCAB[s.arch], s.vocab)
    b = Blocks()
    embd_type, out_type = (Q.Q8_0, Q.Q8_0) if s.arch == "gpt-oss" else (Q.Q4_K, Q.Q6_K)
    b.add(w, "token_embd.weight", embd_type, s.vocab, s.embd)
    f32(w, "output_norm.weight", s.embd)
    b.add(w, "output.weight", out_type, s.vocab, s.embd)
    for i in range(n_layer):
        attention(w, b, s, i, n_layer)
        ffn(w, b, s, i, n_layer)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=SHAPES)
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--layers", type=int, default=0, help="write the same shapes with this many layers")
    args = ap.parse_args(argv)
    if args.layers < 0:
        ap.error("--layers must be at least 1 (0: the model's own count)")
    write(args.kind, args.out, args.layers)


if __name__ == "__main__":
    main()
