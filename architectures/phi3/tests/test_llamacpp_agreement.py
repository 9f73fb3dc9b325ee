"""leat against llama.cpp on tiny Phi-3 files: the CPU float64 oracle matches llama.cpp's recorded logits, and the
float32 path matches the oracle.

The references (``references/llamacpp.npz``, written by ``scripts/record_llamacpp_tiny.py`` with llama-cpp-python,
which CI does not have) hold llama.cpp's logits at every position. Each file is rebuilt here from its configuration
and must hash as it did when recorded, so the comparison is on the very file llama.cpp ran. The files cover what is
Phi-3's own: fused attn_qkv and ffn_up (and separate q/k/v), LongRoPE's long and short factors and magnitude, partial
RoPE, a sliding window that llama.cpp does not apply, tied and untied outputs. Bars (leat's design, "what agrees
means"): top-1 >= 99% over positions where llama.cpp's top-2 gap is >= 1e-3, log-prob error within 2% (F32) / 5%
(F16) of the logits' spread, and mean KL within a bar a bit above what was measured; float32 against float64:
top-1 >= 99%, mean KL < 1e-3.
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
from leat_backend_cpu.backend import CPUBackend

REFERENCES = Path(__file__).parent / "references"
LOGPROB_ERROR = {"F32": 0.02, "F16": 0.05}
# Measured (llama-cpp-python 0.3.36): top-1 100% everywhere, mean KL <= 1.2e-7 (F32) and <= 3.5e-7 (F16), log-prob
# error <= 0.098%; these KL bars sit a bit above, to catch a regression long before it would cross the design's bars.
KL = {"F32": 1e-6, "F16": 3e-6}
RERECORD = "re-record with scripts/record_llamacpp_tiny.py (see its docstring) and commit the new references"


def _tiny_models():
    spec = importlib.util.spec_from_file_location("leat_phi3_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


models = _tiny_models()


@pytest.fixture(scope="module")
def recorded():
    manifest = json.loads((REFERENCES / "llamacpp.json").read_text())
    return manifest, dict(np.load(REFERENCES / "llamacpp.npz"))


def evaluate(name: str, path: Path, tokens: np.ndarray, precision: str) -> np.ndarray:
    backend = CPUBackend(precision)
    model = models.architecture(models.CONFIGS[name])(ModelFile(path), backend)
    kv = backend.allocate_kv(model.kv_layouts(model.params), 1, len(tokens))
    return backend.to_host(model.forward(Batch([Row(0, 0, tokens, all_logits=True)]), kv))


def rebuild(name: str, tmp_path: Path, manifest: dict) -> Path:
    path = models.build(name, tmp_path / f"tiny-{name}.gguf")
    if name not in manifest["tiny"] or models.sha256(path) != manifest["tiny"][name]["sha256"]:
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
    oracle = evaluate(name, path, tokens, "f64")
    qtype = models.CONFIGS[name]["qtype"]
    agreement = compare(arrays[f"{name}/logits"], oracle, label=f"{name} f64 vs llama.cpp")
    print(agreement)
    assert not agreement.failures(top1=0.99, kl=KL[qtype], logprob_error=LOGPROB_ERROR[qtype]), str(agreement)

    fast = evaluate(name, path, tokens, "f32")
    assert fast.dtype == np.float32
    precision = compare(oracle, fast, label=f"{name} f32 vs f64")
    print(precision)
    assert not precision.failures(top1=0.99, kl=1e-3), str(precision)
