"""leat against llama.cpp on tiny gpt-oss files: the CPU float64 oracle matches llama.cpp's recorded logits,
and the float32 path matches the oracle.

The references (``references/llamacpp.npz``, written by ``scripts/record_llamacpp_tiny.py`` with
llama-cpp-python, which CI does not have) hold llama.cpp's logits at every position. Each file is rebuilt
here from its configuration and must hash as it did when recorded, so the comparison is on the very file
llama.cpp ran. Bars (leat's design, "what agrees means"): top-1 >= 99% over positions where llama.cpp's
top-2 gap is >= 1e-3, log-prob error within 2% (F32) / 5% (F16) of the logits' spread, and mean KL within
a bar a bit above what was measured; float32 against
float64: top-1 >= 99%, mean KL < 1e-3. Tokens whose MoE expert choice is within 1e-3 of a tie (router
margin) are left out like near-tied logits: there either engine's choice is right.

Files with MXFP4 experts are compared twice. llama.cpp on the file's ``dequantized`` copy (the same
weights stored as F32) computes in plain float, so the F32 bars apply to it. llama.cpp on the MXFP4 file
itself rounds activations to 8 bits (Q8_0) before each expert product, and in a MoE that noise flips
routing decisions: its float and MXFP4 runs agree on only 92-95% of top-1 tokens here. So against the MXFP4
run leat must be about as close as llama.cpp's own float run (top-1 within 2 points, mean KL within 2x)
and within the design's KL bar for quantized files (6e-3).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare
from leat.modelfile import ModelFile
from leat.moe import router_margin
from leat_backend_cpu.backend import CPUBackend

REFERENCES = Path(__file__).parent / "references"
LOGPROB_ERROR = {"F32": 0.02, "F16": 0.05}
# Measured (llama-cpp-python 0.3.36): mean KL <= 1.6e-7 (F32) and <= 4.6e-7 (F16), log-prob error <= 0.23%;
# these KL bars sit a bit above, to catch a regression long before it would cross the design's bars.
KL = {"F32": 1e-6, "F16": 3e-6}
ROUTER_MIN_MARGIN = 1e-3
RERECORD = "re-record with scripts/record_llamacpp_tiny.py (see its docstring) and commit the new references"


def _tiny_models():
    spec = importlib.util.spec_from_file_location("leat_gpt_oss_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


models = _tiny_models()


@pytest.fixture(scope="module")
def recorded():
    manifest = json.loads((REFERENCES / "llamacpp.json").read_text())
    return manifest, dict(np.load(REFERENCES / "llamacpp.npz"))


class MarginRecorder(CPUBackend):
    """The CPU backend, noting each MoE layer's router margin per token."""

    def __init__(self, precision: str):
        super().__init__(precision)
        self.margins: list[np.ndarray] = []

    def moe(self, x, weights, spec):
        self.margins.append(router_margin(self.matmul(x, weights.router, weights.router_bias), spec.experts_used))
        return super().moe(x, weights, spec)


def evaluate(name: str, path: Path, tokens: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray]:
    """Logits at every position, and each position's smallest router margin over layers (inf: no MoE)."""
    backend = MarginRecorder(precision)
    model = models.architecture()(ModelFile(path), backend)
    kv = backend.allocate_kv(model.kv_layouts(model.params), 1, len(tokens))
    logits = backend.to_host(model.forward(Batch([Row(0, 0, tokens, all_logits=True)]), kv))
    margins = np.min(backend.margins, axis=0) if backend.margins else np.full(len(tokens), np.inf)
    return logits, margins


def rebuild(name: str, tmp_path: Path, manifest: dict, dequantized: bool = False) -> Path:
    path = models.build(name, tmp_path / f"tiny-{name}{'-dequantized' * dequantized}.gguf", dequantized)
    key = "dequantized_sha256" if dequantized else "sha256"
    if name not in manifest["tiny"] or models.sha256(path) != manifest["tiny"][name].get(key):
        pytest.fail(
            f"{name}: the rebuilt tiny file differs from the one llama.cpp was recorded on (writer, random "
            f"weights or configuration changed): {RERECORD}"
        )
    return path


@pytest.mark.parametrize("name", list(models.CONFIGS))
def test_oracle_matches_llamacpp_and_f32_matches_oracle(name, tmp_path, recorded):
    manifest, arrays = recorded
    path = rebuild(name, tmp_path, manifest)
    tokens = arrays[f"{name}/tokens"]
    np.testing.assert_array_equal(tokens, models.tokens(name), err_msg=f"prompt changed: {RERECORD}")
    oracle, margins = evaluate(name, path, tokens, "f64")
    keep = margins >= ROUTER_MIN_MARGIN
    assert keep.mean() >= 0.9, f"{name}: {np.sum(~keep)} of {len(keep)} tokens have near-tied routers"
    config = models.CONFIGS[name]
    if config["experts"]:
        rebuild(name, tmp_path, manifest, dequantized=True)
        exact = compare(arrays[f"{name}/logits_dequantized"][keep], oracle[keep], label=f"{name} f64 vs llama.cpp F32")
        print(exact)
        assert not exact.failures(top1=0.99, kl=KL["F32"], logprob_error=LOGPROB_ERROR["F32"]), str(exact)
        quantized = compare(arrays[f"{name}/logits"][keep], oracle[keep], label=f"{name} f64 vs llama.cpp")
        itself = compare(arrays[f"{name}/logits"][keep], arrays[f"{name}/logits_dequantized"][keep])
        print(quantized, f"(llama.cpp F32 vs llama.cpp: top-1 {itself.top1:.2%}, mean KL {itself.mean_kl:.3g})")
        assert not quantized.failures(kl=6e-3), str(quantized)
        near = quantized.top1 >= itself.top1 - 0.02 and quantized.mean_kl <= 2 * itself.mean_kl + 1e-6
        assert near, f"{quantized}; llama.cpp's float run against its MXFP4 run: {itself}"
    else:
        agreement = compare(arrays[f"{name}/logits"][keep], oracle[keep], label=f"{name} f64 vs llama.cpp")
        print(agreement, f"({np.sum(~keep)} router near-ties left out)")
        assert not agreement.failures(
            top1=0.99, kl=KL[config["qtype"]], logprob_error=LOGPROB_ERROR[config["qtype"]]
        ), str(agreement)

    fast, _ = evaluate(name, path, tokens, "f32")
    assert fast.dtype == np.float32
    precision = compare(oracle, fast, label=f"{name} f32 vs f64")
    print(precision)
    assert not precision.failures(top1=0.99, kl=1e-3), str(precision)
