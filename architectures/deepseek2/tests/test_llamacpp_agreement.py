"""leat's DeepSeek2 against llama.cpp's recorded logits (references/record_llamacpp.py regenerates them).

The tiny files are rebuilt here bit for bit (a SHA-256 mismatch means the generator drifted: re-record).
Bars as DESIGN.md: the float64 oracle against llama.cpp (top-1 >= 99%, log-prob error <= 2% of the logits'
spread on F32 files, 5% on F16), the float32 path against the oracle (top-1 >= 99%, mean KL < 1e-3).

Positions where some layer's expert choice is within 1e-3 of a tie (:func:`leat.moe.selection_margin` of the
oracle's own router) are left out of the llama.cpp comparison: there either engine's choice is right, as
where the output's top-2 gap is below 1e-3.
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare
from leat.modelfile import ModelFile
from leat.moe import selection_margin
from leat_arch_deepseek2.deepseek2 import DeepSeek2
from leat_backend_cpu.backend import CPUBackend

REFERENCES = Path(__file__).parent / "references"
spec = importlib.util.spec_from_file_location("tiny_deepseek2", REFERENCES / "tiny_deepseek2.py")
tiny = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny)
MANIFEST = json.loads((REFERENCES / "llamacpp_deepseek2.json").read_text())
MIN_MARGIN = 1e-3


class RoutingRecorder(CPUBackend):
    """The CPU backend, recording each MoE layer's selection margin per token."""

    def __init__(self, precision):
        super().__init__(precision)
        self.margins = []

    def moe(self, x, weights, spec):
        logits = self.matmul(x, weights.router, weights.router_bias)
        self.margins.append(selection_margin(logits, spec, weights.selection_bias))
        return super().moe(x, weights, spec)


def logits(path, precision, tokens):
    backend = RoutingRecorder(precision)
    model = DeepSeek2(ModelFile(path), backend)
    kv = backend.allocate_kv(model.kv_layouts(model.params), 1, len(tokens))
    out = backend.to_host(model.forward(Batch([Row(0, 0, tokens, all_logits=True)]), kv))
    return out, np.min(backend.margins, axis=0)


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_tiny_agrees_with_llamacpp(tmp_path, name):
    recorded = MANIFEST["tiny"].get(name)
    assert recorded is not None, f"{name} has no llama.cpp recording: re-record (references/record_llamacpp.py)"
    path = tiny.build(name, tmp_path / f"{name}.gguf")
    assert tiny.sha256(path) == recorded["sha256"], f"{name}: the tiny file changed: re-record"
    with np.load(REFERENCES / "llamacpp_deepseek2_tiny.npz") as refs:
        tokens, reference = refs[f"{name}/tokens"].astype(np.int64), refs[f"{name}/logits"]

    oracle, margin = logits(path, "f64", tokens)
    keep = margin >= MIN_MARGIN
    assert keep.mean() >= 0.9, f"{name}: {np.sum(~keep)} of {len(keep)} positions route within {MIN_MARGIN} of a tie"
    agreement = compare(
        reference[keep], oracle[keep], label=f"{name} f64 vs llama.cpp ({np.sum(~keep)} near-tie routings left out)"
    )
    print(agreement)
    band = 0.02 if recorded["qtype"] == "F32" else 0.05
    assert not agreement.failures(top1=0.99, logprob_error=band), str(agreement)

    fast, _ = logits(path, "f32", tokens)
    assert fast.dtype == np.float32
    agreement = compare(oracle, fast, label=f"{name} f32 vs f64")
    print(agreement)
    assert not agreement.failures(top1=0.99, kl=1e-3), str(agreement)
