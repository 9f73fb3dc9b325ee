"""scripts/tinygrad_step_parts.py: kernel kinds from tinygrad's names, and a captured decode step with a kind left out
(on tinygrad's default device, the CPU in CI: its kernels are real, its times not the point)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tinygrad_step_parts", ROOT / "scripts" / "tinygrad_step_parts.py")
parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parts)


def test_a_kind_is_the_name_up_to_its_sizes():
    assert parts.kind("gemv_q4_k_1_14336_16_glu") == "gemv_q4_k"
    assert parts.kind("rms_norm_1_4096") == "rms_norm"
    assert parts.kind("attn_scores_1_32_640") == "attn_scores"
    assert (
        parts.kind("r\x1b[90m_\x1b[0m\x1b[91m16\x1b[0m\x1b[90m_\x1b[0m\x1b[31m256\x1b[0m") == "r"
    )  # tinygrad's colours
    assert parts.kind("E_32_32_4") == "E"


def test_the_step_runs_with_a_kind_left_out(tmp_path, monkeypatch, capsys):
    pytest.importorskip("leat_backend_tinygrad")
    from leat_backend_tinygrad.backend import probe_reason

    if probe_reason() is not None:
        pytest.skip(f"tinygrad cannot run here: {probe_reason()}")
    from leat import plugins
    from leat.testing import write_tiny_gguf

    entry = plugins.host().get("architectures", "llama")
    if entry is None:
        pytest.skip("no installed plugin serves llama")
    path = str(write_tiny_gguf(entry.load(), tmp_path / "tiny-llama.gguf"))
    monkeypatch.setattr("sys.argv", ["x", path, "--capacity", "32", "--context", "9", "--steps", "2", "--rounds", "1"])
    parts.main()
    lines = capsys.readouterr().out.splitlines()
    total = int(lines[0].split(", ")[-1].split()[0])
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines if line.startswith("| ")}
    assert int(rows["whole step"][1]) == total > 0
    left_out = [label for label in rows if label.startswith("without ")]
    assert left_out and all(int(rows[label][1]) < total for label in left_out)
    assert all(float(row[2]) > 0 for label, row in rows.items() if label not in ("variant", "---"))


def test_leaving_a_kind_out_takes_exactly_its_kernels(tmp_path):
    pytest.importorskip("leat_backend_tinygrad")
    from leat_backend_tinygrad.backend import probe_reason

    if probe_reason() is not None:
        pytest.skip(f"tinygrad cannot run here: {probe_reason()}")
    import leat
    import numpy as np
    from leat import plugins
    from leat.batch import Batch, Row
    from leat.testing import write_tiny_gguf

    entry = plugins.host().get("architectures", "llama")
    if entry is None:
        pytest.skip("no installed plugin serves llama")
    model = leat.load(str(write_tiny_gguf(entry.load(), tmp_path / "tiny-llama.gguf")), backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    kv = model.new_kv(32, slots=1, dtype="f16")
    for p in range(3):
        backend.to_host(backend.run(forward, Batch([Row(0, p, np.array([5 + p]))]), kv))
    jit = next(j for key, j in backend._jits.items() if key[1:] == (id(kv), 1))
    counted = parts.kinds(jit.captured._linear)
    assert len(counted) >= 3
    name = max(counted, key=counted.get)
    left = parts.kinds(parts.without(jit.captured._linear, {name}.__contains__))
    assert name not in left and left == {k: n for k, n in counted.items() if k != name}
