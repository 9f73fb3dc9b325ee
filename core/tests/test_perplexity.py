"""`leat perplexity`: the llama-perplexity KL-base reader, and SmolLM2 scored against llama.cpp's own logits.

perplexity_refs/ holds two KL bases recorded by llama.cpp's `llama-perplexity --kl-divergence-base` (see
record_kl_base.py there): one on the Q4_1 file as llama.cpp computes it (8-bit activations in every quantized
product) and one on a copy dequantized to F32 by llama.cpp (the same weights in float).
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from leat import perplexity as ppl
from leat.cli import cli
from leat.errors import LeatError, PullError

REFS = Path(__file__).parent / "perplexity_refs"


def test_read_kl_base_layout(tmp_path):
    # a file laid out as perplexity.cpp writes it: 1 chunk of 6 tokens, vocab 3 (nv = 2*2 + 4 = 8), 2 scored rows
    n_ctx, n_vocab = 6, 3
    logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]], dtype=np.float32)
    data = b"_logits_" + struct.pack("<3i", n_ctx, n_vocab, 1) + struct.pack("<6i", *range(6))
    for row in logits:
        top, low = row.max(), max(row.min(), row.max() - 16)
        log_sum = np.log(np.exp(row - top).sum())
        scale = (top - low) / 65535
        q = np.where(row > low, np.rint((row - low) / scale), 0).astype("<u2")
        data += struct.pack("<2f", scale, low - top - log_sum) + q.tobytes() + b"\0\0"
    (tmp_path / "base.bin").write_bytes(data)
    (tmp_path / "base.bin.gz").write_bytes(gzip.compress(data))
    for name in ("base.bin", "base.bin.gz"):
        base = ppl.read_kl_base(tmp_path / name)
        assert (base.n_ctx, base.n_vocab, base.n_chunk) == (6, 3, 1)
        assert base.tokens.tolist() == [list(range(6))]
        expected = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        np.testing.assert_allclose(base.log_probs(0), expected, atol=1e-4)
    (tmp_path / "short.bin").write_bytes(data[:-2])
    with pytest.raises(LeatError, match="its header .* says"):
        ppl.read_kl_base(tmp_path / "short.bin")
    (tmp_path / "text.bin").write_bytes(b"not a kl base")
    with pytest.raises(LeatError, match="does not start with _logits_"):
        ppl.read_kl_base(tmp_path / "text.bin")


def test_recorded_bases():
    for name in ("smollm2_f32_kl_base.bin.gz", "smollm2_q4_1_kl_base.bin.gz"):
        base = ppl.read_kl_base(REFS / name)
        assert (base.n_ctx, base.n_vocab, base.n_chunk) == (128, 49152, 1)
        probs = np.exp(base.log_probs(0).astype(np.float64))
        # normalized log-probabilities; tokens clipped up to 16 below the top add up to a few 1e-3
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-2)


@pytest.fixture(scope="module")
def smollm2():
    import leat

    try:
        return leat.load("default", backend="cpu", precision="f32")
    except PullError as error:  # offline and not cached
        pytest.skip(f"SmolLM2 is not cached and could not be pulled: {error}")


def run_cli(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["perplexity", "default", "--backend", "cpu", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_kl_against_llamacpp_f32(smollm2):
    # The same weights computed in float by both engines: measured KL ~1e-6 (its sign is noise from the base's
    # 16-bit log-probs), top-1 100%, perplexity equal to 5 digits.
    result = run_cli("--kl-base", str(REFS / "smollm2_f32_kl_base.bin.gz"))
    assert result["tokens_scored"] == 63
    assert abs(result["kl_divergence_mean"]) < 1e-3 and result["kl_divergence_max"] < 1e-3
    assert result["top1_agreement"] == 1.0
    assert result["perplexity"] == pytest.approx(result["base_perplexity"], rel=1e-3)
    assert result["base_perplexity"] == pytest.approx(20.6922, rel=1e-4)  # what llama-perplexity printed


def test_kl_against_llamacpp_quantized(smollm2):
    # llama.cpp's Q4_1 compute rounds activations to 8 bits; an exact float engine is measured 3.0e-3 mean KL and
    # 95.2% top-1 away from it (DESIGN.md's table: 1.8e-3 - 4.7e-3). Copying that rounding (--activations ggml,
    # below) does not bring it under 1e-3 either, and nothing short of llama.cpp's exact float arithmetic can: the
    # rounding makes the logits depend chaotically on the last bits of every input (one ulp of noise before each
    # product moves leat's own ggml-rounded logits 3.5e-3 KL), so llama.cpp differs from itself by as much when a
    # setting changes its float order. Measured on 30 chunks of 128 (GPL-3 and GFDL-1.3 texts, SmolLM2 Q4_1): mean
    # KL llama.cpp default vs llama.cpp -fa off 4.5e-3, vs -fa off -ctk f32 -ctv f32 4.7e-3, vs leat with ggml
    # rounding 4.7e-3, vs leat in f32 3.9e-3. So this checks the documented bar for quantized files instead.
    result = ppl.kl_divergence(smollm2, ppl.read_kl_base(REFS / "smollm2_q4_1_kl_base.bin.gz"))
    assert result["kl_divergence_mean"] < 6e-3 and result["top1_agreement"] >= 0.94
    assert result["base_perplexity"] == pytest.approx(20.7915, rel=1e-4)  # what llama-perplexity printed


def test_kl_with_llamacpp_activation_rounding(smollm2):
    # --activations ggml: each product's activations rounded as ggml's CPU matmul rounds them (checked against
    # ggml's integer dot in backends/cpu/tests/test_ggml_activations.py). Measured: KL 3.5e-3, top-1 98.4%, as far
    # from llama.cpp as llama.cpp with flash attention off is from itself (3.5e-3 on this chunk).
    result = run_cli("--kl-base", str(REFS / "smollm2_q4_1_kl_base.bin.gz"), "--activations", "ggml")
    assert result["kl_divergence_mean"] < 6e-3 and result["top1_agreement"] >= 0.94
    assert result["perplexity"] != pytest.approx(20.6921, rel=1e-3)  # leat in f32; measured 20.9237 here


def test_perplexity_on_text(smollm2):
    tokens = smollm2.tokenize((REFS / "text.txt").read_text())
    assert len(tokens) >= 256
    result = ppl.perplexity(smollm2, tokens, ctx=128, chunks=1)
    # the first chunk of text.txt is the one the KL bases score, so this is llama.cpp's F32 perplexity
    assert result["chunks"] == 1 and result["tokens_scored"] == 63
    assert result["perplexity"] == pytest.approx(20.6922, rel=1e-3)
    with pytest.raises(LeatError, match="fewer than one chunk"):
        ppl.perplexity(smollm2, tokens[:100], ctx=128)
