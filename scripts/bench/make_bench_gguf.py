#!/usr/bin/env python3
"""Write a full-size, random-weight GGUF for speed and memory benchmarks.

The weights are random but valid quantized blocks, laid out as llama.cpp's
Q4_K_M recipe lays out a real model (Q4_K for most matrices, Q6_K for the
output, and for attn_v / ffn_down in the first and last eighth of the layers
and every third layer between).  Numbers produced with it are about speed and
memory, never about quality.

    python make_bench_gguf.py llama3-8b  /tmp/llama3-8b-q4km.gguf
    python make_bench_gguf.py qwen3-8b   /tmp/qwen3-8b-q4km.gguf
    python make_bench_gguf.py llama3-1b  /tmp/llama3-1b-q4km.gguf   # quick runs

The tokenizer is the real Llama 3 or Qwen2/3 one, copied from vocabulary-only GGUF files in
vocab/ beside this script, so text prompts tokenize as with the real model. They are not kept in
this repository (14 MB): copy ggml-vocab-llama-bpe.gguf and ggml-vocab-qwen2.gguf there from
llama.cpp's models/ folder (as shipped in the llama-cpp-python 0.3.36 sdist on PyPI; MIT).

Needs only numpy and gguf.
"""

from __future__ import annotations

import pathlib
import sys

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SHAPES = {
    #            layers embd  heads kv  ff     vocab   qk_norm rope_theta
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256, False, 500000.0),
    "llama3-1b": (16, 2048, 32, 8, 8192, 128256, False, 500000.0),
    "qwen3-8b": (36, 4096, 32, 8, 12288, 151936, True, 1000000.0),
}


VOCAB = {"llama": "ggml-vocab-llama-bpe.gguf", "qwen3": "ggml-vocab-qwen2.gguf"}


def copy_tokenizer(w: gguf.GGUFWriter, vocab_file: pathlib.Path, n_vocab: int) -> None:
    """Copy every tokenizer.* key of a vocabulary-only GGUF into the file being written."""
    r = gguf.GGUFReader(vocab_file)
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), vtype)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == n_vocab, vocab_file


def block_pool(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with small, finite scales so activations stay sane."""
    block_size = gguf.GGML_QUANT_SIZES[qtype][1]
    pool = rng.integers(0, 256, size=(n_blocks, block_size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin (f16) lead the block
        pool[:, 0:2] = np.frombuffer(np.float16(3e-5).tobytes(), np.uint8)
        pool[:, 2:4] = np.frombuffer(np.float16(3e-5).tobytes(), np.uint8)
    elif qtype == Q.Q6_K:  # d (f16) ends the block
        pool[:, -2:] = np.frombuffer(np.float16(1e-5).tobytes(), np.uint8)
    return pool


def quantized(pools, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """A (rows, bytes_per_row) view into the pool: GGUF's byte shape."""
    block_elems, block_size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_elems
    return pools[qtype][:n].reshape(rows, cols // block_elems * block_size)


def write(kind: str, path: str) -> None:
    n_layer, n_embd, n_head, n_kv, n_ff, n_vocab, qk_norm, theta = SHAPES[kind]
    arch = "qwen3" if kind.startswith("qwen3") else "llama"
    head_dim = n_embd // n_head
    rng = np.random.default_rng(0)
    biggest = n_vocab * n_embd // 256
    pools = {Q.Q4_K: block_pool(Q.Q4_K, biggest, rng), Q.Q6_K: block_pool(Q.Q6_K, biggest, rng)}

    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"bench-{kind}-q4_k_m-random")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6 if arch == "qwen3" else 1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    copy_tokenizer(w, pathlib.Path(__file__).with_name("vocab") / VOCAB[arch], n_vocab)

    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", quantized(pools, Q.Q4_K, n_vocab, n_embd), raw_dtype=Q.Q4_K)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", quantized(pools, Q.Q6_K, n_vocab, n_embd), raw_dtype=Q.Q6_K)
    for i in range(n_layer):
        more_bits = i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2
        vd = Q.Q6_K if more_bits else Q.Q4_K
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "ffn_norm.weight", ones)
        if qk_norm:
            w.add_tensor(p + "attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", quantized(pools, Q.Q4_K, n_head * head_dim, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "attn_k.weight", quantized(pools, Q.Q4_K, n_kv * head_dim, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "attn_v.weight", quantized(pools, vd, n_kv * head_dim, n_embd), raw_dtype=vd)
        w.add_tensor(p + "attn_output.weight", quantized(pools, Q.Q4_K, n_embd, n_head * head_dim), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "ffn_gate.weight", quantized(pools, Q.Q4_K, n_ff, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "ffn_up.weight", quantized(pools, Q.Q4_K, n_ff, n_embd), raw_dtype=Q.Q4_K)
        w.add_tensor(p + "ffn_down.weight", quantized(pools, vd, n_embd, n_ff), raw_dtype=vd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SHAPES:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(SHAPES)}}} OUT.gguf")
    write(sys.argv[1], sys.argv[2])
