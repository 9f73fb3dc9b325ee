"""Agreement with llama.cpp's recorded logits on a plugin's tiny files: subclass :class:`LlamaCppAgreement` in the
plugin's tests, point it at the references, and state the bars.

The references (``llamacpp.npz`` and its manifest ``llamacpp.json`` in the plugin's ``tests/references``, written by
``scripts/record_llamacpp_tiny.py`` with llama-cpp-python, which CI does not have) hold llama.cpp's logits at every
position. Each file is rebuilt from its configuration (the folder's ``tiny_models.py``, a
:class:`leat.testing.TinyModels` named ``models``) and must hash as it did when recorded, so the comparison is on
the very file llama.cpp ran.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from leat.batch import Batch, Row
from leat.compare import Agreement, compare
from leat.conformance.backend import cpu_oracle
from leat.modelfile import ModelFile
from leat.moe import selection_margin
from leat.testing import TinyModels, sha256


class LlamaCppAgreement:
    """The float64 oracle against llama.cpp on every recorded configuration, and the float32 path against the oracle.

    Bars (leat's design, "what agrees means"): top-1 >= 99% over positions where llama.cpp's top-2 gap is >= 1e-3,
    log-prob error within ``logprob_error[qtype]`` of the logits' spread, mean KL within ``kl[qtype]`` (a bar a bit
    above what was measured); float32 against float64: top-1 >= 99%, mean KL < 1e-3. Tokens whose expert choice in
    some MoE layer is within ``min_margin`` of a tie (:func:`leat.moe.selection_margin` of the oracle's own router)
    are left out like near-tied logits: there either engine's choice is right; at most a tenth of them may be.
    """

    references: ClassVar[Path]
    #: in ``references``: the configurations' file, llama.cpp's logits and their manifest
    tiny_models: ClassVar[str] = "tiny_models.py"
    arrays: ClassVar[str] = "llamacpp.npz"
    manifest: ClassVar[str] = "llamacpp.json"
    kl: ClassVar[dict[str, float]] = {"F32": 1e-6, "F16": 3e-6}  # a qtype left out: no KL bar
    logprob_error: ClassVar[dict[str, float]] = {"F32": 0.02, "F16": 0.05}
    min_margin: ClassVar[float] = 1e-3
    rerecord: ClassVar[str] = (
        "re-record with scripts/record_llamacpp_tiny.py (see its docstring) and commit the new references"
    )

    @classmethod
    def models(cls) -> TinyModels:
        """``models`` of the configurations' file: a :class:`~leat.testing.TinyModels`, or a function returning one
        (where the file is also read without leat)."""
        return _tiny_models(cls.references / cls.tiny_models)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "name" in metafunc.fixturenames:
            metafunc.parametrize("name", list(self.models().configs))

    @pytest.fixture
    def recorded(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The manifest and llama.cpp's arrays: ``NAME/tokens`` and ``NAME/logits`` per configuration."""
        return _recorded(self.references / self.manifest, self.references / self.arrays)

    def rebuild(self, name: str, tmp_path: Path, manifest: dict[str, Any], dequantized: bool = False) -> Path:
        """Configuration ``name``'s file, written again; fails unless it is the one llama.cpp was recorded on."""
        path = self.models().build(name, tmp_path / f"tiny-{name}{'-dequantized' * dequantized}.gguf", dequantized)
        key = "dequantized_sha256" if dequantized else "sha256"
        if name not in manifest["tiny"] or sha256(path) != manifest["tiny"][name].get(key):
            pytest.fail(
                f"{name}: the rebuilt tiny file differs from the one llama.cpp was recorded on (writer, random "
                f"weights or configuration changed): {self.rerecord}"
            )
        return path

    def evaluate(self, name: str, path: Path, tokens: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray]:
        """The oracle backend's logits at every position in ``precision``, and each position's smallest selection
        margin over the MoE layers (inf without any)."""
        backend = _routing_recorder(cpu_oracle())(precision)
        architecture = self.models().architecture(self.models().configs[name])
        model = architecture(ModelFile(path), backend)
        kv = backend.allocate_kv(model.kv_layouts(model.params), 1, len(tokens))
        logits = backend.to_host(model.forward(Batch([Row(0, 0, tokens, all_logits=True)]), kv))
        margins = np.min(backend.margins, axis=0) if backend.margins else np.full(len(tokens), np.inf)
        return logits, margins

    def check_llamacpp(
        self, name: str, oracle: np.ndarray, keep: np.ndarray, recorded: tuple[dict, dict], tmp_path: Path
    ) -> None:
        """The oracle's logits (rows ``keep``) against llama.cpp's, within the bars of the file's ``qtype``."""
        arrays = recorded[1]
        qtype = self.models().configs[name]["qtype"]
        agreement = compare(arrays[f"{name}/logits"][keep], oracle[keep], label=f"{name} f64 vs llama.cpp")
        print(agreement, f"({np.sum(~keep)} near-tie routings left out)" if not keep.all() else "")
        self.assert_within(agreement, top1=0.99, kl=self.kl.get(qtype), logprob_error=self.logprob_error[qtype])

    def prompt(self, name: str, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The token ids llama.cpp was fed: by default as recorded, and the configuration's seeded prompt."""
        tokens = arrays[f"{name}/tokens"]
        np.testing.assert_array_equal(tokens, self.models().tokens(name), err_msg=f"prompt changed: {self.rerecord}")
        return tokens

    @staticmethod
    def assert_within(agreement: Agreement, **bars: float) -> None:
        assert not agreement.failures(**bars), str(agreement)

    def test_oracle_matches_llamacpp_and_f32_matches_oracle(self, name, tmp_path, recorded):
        manifest, arrays = recorded
        path = self.rebuild(name, tmp_path, manifest)
        tokens = self.prompt(name, arrays)
        oracle, margins = self.evaluate(name, path, tokens, "f64")
        keep = margins >= self.min_margin
        assert keep.mean() >= 0.9, (
            f"{name}: {np.sum(~keep)} of {len(keep)} tokens route within {self.min_margin} of a tie"
        )
        self.check_llamacpp(name, oracle, keep, recorded, tmp_path)

        fast, _ = self.evaluate(name, path, tokens, "f32")
        assert fast.dtype == np.float32
        precision = compare(oracle, fast, label=f"{name} f32 vs f64")
        print(precision)
        self.assert_within(precision, top1=0.99, kl=1e-3)


@functools.cache
def _recorded(manifest: Path, arrays: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return json.loads(manifest.read_text()), dict(np.load(arrays))


@functools.cache
def _tiny_models(path: Path) -> TinyModels:
    """The ``models`` of a ``tiny_models.py`` (a script beside the references, not an importable module)."""
    spec = importlib.util.spec_from_file_location(f"leat_tiny_models_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.models() if callable(module.models) else module.models


@functools.cache
def _routing_recorder(backend: type) -> type:
    """``backend``, noting per MoE layer each token's :func:`~leat.moe.selection_margin` in ``margins``."""

    class RoutingRecorder(backend):
        def __init__(self, precision: str):
            super().__init__(precision)
            self.margins: list[np.ndarray] = []

        def moe(self, x: Any, weights: Any, spec: Any) -> Any:
            logits = self.matmul(x, weights.router, weights.router_bias)
            self.margins.append(selection_margin(logits, spec, weights.selection_bias))
            return super().moe(x, weights, spec)

    return RoutingRecorder
