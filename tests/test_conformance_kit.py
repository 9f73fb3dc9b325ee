"""The conformance kit itself: its optional checks pass on the CPU backend (their references agree with the oracle
implementation), a capability a subclass does not declare deselects its checks at collection (never a skip), and a
missing reference fails with a message."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _pytest.outcomes import Failed
from leat.conformance import BackendConformance
from leat.conformance import reference as kit_reference
from leat_backend_cpu.backend import CPUBackend

ALL = frozenset({"windows", "softcap", "sinks", "q8_0_kv", "moe"})


class TestCPUWithEveryCapability(BackendConformance):
    capabilities = ALL
    model_qtypes = ()  # the whole-model checks run in backends/cpu's own conformance test

    @pytest.fixture(params=["f32", "f64"])
    def backend(self, request):
        return CPUBackend(request.param)


class _NoSinks(CPUBackend):
    def attention(self, q, k, v, kv, layer, batch, scale, softcap=None, sinks=None):
        return super().attention(q, k, v, kv, layer, batch, scale, softcap)


def test_a_backend_ignoring_sinks_fails_their_check():
    with pytest.raises(AssertionError):
        TestCPUWithEveryCapability().test_attention_sinks(_NoSinks("f64"))


SUBCLASS = """
import pytest
from leat.conformance import BackendConformance
from leat_backend_cpu.backend import CPUBackend


class TestPlain(BackendConformance):
    capabilities = frozenset({"sinks"})
    model_qtypes = ("F32",)

    @pytest.fixture
    def backend(self):
        return CPUBackend("f64")
"""


def test_capabilities_select_checks_at_collection(tmp_path):
    (tmp_path / "test_plain.py").write_text(SUBCLASS)
    # one run, verbose: a pytest process takes ~6 s to start here (its plugins: hypothesis, schemathesis, Faker)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-v", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 0, out
    assert "leat conformance kit" in out  # the pytest11 plugin loaded itself
    assert "skipped" not in out
    # windows, softcap, softcap with sinks, q8_0_kv, moe's two and recurrent are deselected; sinks and the F32 model
    # check run
    assert "7 deselected" in out, out
    ran = out.replace("::", " ").replace("test_plain.py TestPlain ", "")
    assert "test_attention_sinks PASSED" in ran and "test_tiny_llama_agrees_with_the_float64_oracle[F32] PASSED" in ran


def test_a_missing_reference_fails_with_what_to_install(monkeypatch):
    kit_reference.reference.cache_clear()
    monkeypatch.setattr(kit_reference, "declared", lambda: ["leat-backend-nowhere"])
    try:
        with pytest.raises(Failed, match=r"reference backend \(leat-backend-nowhere\).*install 'leat\[conformance\]'"):
            kit_reference.reference("backends")
    finally:
        kit_reference.reference.cache_clear()


def test_the_references_are_declared_once_in_the_extra():
    assert sorted(kit_reference.declared()) == ["leat-arch-llama", "leat-backend-cpu"]
    assert kit_reference.reference("backends") is CPUBackend
