"""leat's Gemma against llama.cpp's recorded logits (references/record_llamacpp.py regenerates them).

Tiny random-weight files are rebuilt bit for bit (:class:`leat.conformance.llamacpp.LlamaCppAgreement`); Gemma 3
270M Q4_K_M is pulled from PyPI. The bars are DESIGN.md's: the float64 oracle against llama.cpp (F32 files: top-1
>= 99%, log-prob error <= 2% of the logits' spread, 5% on F16; the real quantized file: top-1 >= 94%, mean KL <=
6e-3), and the float32 path against the oracle (top-1 >= 99%, mean KL < 1e-3, the same greedy continuation up to the
first near-tie).
"""

import importlib.util
import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import DEFAULT_MIN_GAP, TopK, compare, first_near_tie, top2_gap
from leat.conformance.llamacpp import LlamaCppAgreement
from leat.modelfile import ModelFile
from leat_backend_cpu.backend import CPUBackend

REFERENCES = Path(__file__).parent / "references"
spec = importlib.util.spec_from_file_location("tiny_gemma", REFERENCES / "tiny_gemma.py")
tiny_gemma = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_gemma)
MANIFEST = json.loads((REFERENCES / "llamacpp_gemma.json").read_text())
CHUNK = 512  # prefill chunk, as leat.model does


def load(path, precision):
    file = ModelFile(path)
    arch = tiny_gemma.architecture(file.architecture)
    backend = CPUBackend(precision)
    return arch(file, backend), backend


def prefill(model, backend, tokens, room=0):
    """All logits of ``tokens`` in chunks, and the KV cache (with ``room`` positions to spare)."""
    kv = backend.allocate_kv(model.kv_layouts(model.params), 1, len(tokens) + room)
    out = []
    for start in range(0, len(tokens), CHUNK):
        batch = Batch([Row(0, start, tokens[start : start + CHUNK], all_logits=True)])
        out.append(backend.to_host(model.forward(batch, kv)))
    return np.concatenate(out), kv


class TestTinyAgreesWithLlamaCpp(LlamaCppAgreement):
    references = REFERENCES
    tiny_models = "tiny_gemma.py"
    arrays = "llamacpp_gemma_tiny.npz"
    manifest = "llamacpp_gemma.json"
    kl: ClassVar[dict[str, float]] = {}  # the design's bars only
    rerecord = "re-record with references/record_llamacpp.py (see its docstring)"

    def prompt(self, name, arrays):
        return arrays[f"{name}/tokens"].astype(np.int64)  # llama.cpp's tokens of PROMPT_TEXT


def merge(parts):
    """One summary of chunk-wise comparisons: (agreeing, counted, mean KL, worst chunk)."""
    agreeing = sum(a.agreeing for a in parts)
    counted = sum(a.counted for a in parts)
    mean_kl = sum(a.mean_kl * a.positions for a in parts) / sum(a.positions for a in parts)
    return agreeing / max(counted, 1), mean_kl, " | ".join(map(str, parts))


def greedy(model, backend, kv, start, logits, steps):
    tokens, gaps = [], []
    for step in range(steps):
        tokens.append(int(np.argmax(logits)))
        gaps.append(float(top2_gap(logits[None])[0]))
        if step + 1 < steps:
            batch = Batch([Row(0, start + step, np.array([tokens[-1]]))])
            logits = backend.to_host(model.forward(batch, kv))[-1]
    return tokens, np.array(gaps)


@pytest.mark.slow
def test_gemma3_270m_agrees_with_llamacpp():
    from leat.pull import resolve

    recorded = MANIFEST["gemma3_270m"]
    path = resolve(tiny_gemma.GEMMA3_270M)
    file = ModelFile(path)
    assert file.sha256() == recorded["sha256"], "the pulled Gemma 3 270M is not the file recorded on: re-record"
    with np.load(REFERENCES / "llamacpp_gemma3_270m.npz") as refs:
        tokens = refs["tokens"].astype(np.int64)
        reference = TopK.from_arrays(refs)
        llamacpp_greedy = refs["greedy"].tolist()
    steps = 16  # greedy steps compared (llama.cpp recorded 64): ~0.2 s each in float64 and again in float32
    gemma3 = tiny_gemma.architecture("gemma3")
    assert len(tokens) > gemma3.window(gemma3.read_params(file)) == 512

    oracle_model, oracle_backend = load(path, "f64")
    oracle, oracle_kv = prefill(oracle_model, oracle_backend, tokens, room=steps)
    parts = [
        compare(
            TopK(*(a[s : s + CHUNK] for a in (reference.ids, reference.logprobs, reference.gap, reference.spread))),
            oracle[s : s + CHUNK],
            label=f"f64 vs llama.cpp @{s}",
        )
        for s in range(0, len(tokens), CHUNK)
    ]
    top1, kl, text = merge(parts)
    print(f"f64 vs llama.cpp: top-1 {top1:.2%}, mean KL {kl:.3g}")
    assert top1 >= 0.94 and kl <= 6e-3, text
    want, want_gaps = greedy(oracle_model, oracle_backend, oracle_kv, len(tokens), oracle[-1], steps)
    del oracle_kv, oracle_model
    same = next((i for i, (a, b) in enumerate(zip(want, llamacpp_greedy)) if a != b), steps)
    print(f"greedy: f64 equals llama.cpp's own continuation over its first {same} of {steps} steps (not a bar)")

    fast_model, fast_backend = load(path, "f32")
    fast, fast_kv = prefill(fast_model, fast_backend, tokens, room=steps)
    parts = [
        compare(oracle[s : s + CHUNK], fast[s : s + CHUNK], label=f"f32 vs f64 @{s}")
        for s in range(0, len(tokens), CHUNK)
    ]
    top1, kl, text = merge(parts)
    print(f"f32 vs f64: top-1 {top1:.2%}, mean KL {kl:.3g}")
    assert top1 >= 0.99 and kl < 1e-3, text
    got, _ = greedy(fast_model, fast_backend, fast_kv, len(tokens), fast[-1], steps)
    # where the oracle's top-2 gap is below min_gap the pick may go either way: compare only the steps before it
    tie = first_near_tie(want_gaps, DEFAULT_MIN_GAP)
    upto = steps if tie is None else tie
    print(f"greedy: f32 equals f64 over {upto} of {steps} steps (first near-tie: {tie})")
    assert got[:upto] == want[:upto], (got, want, tie)
