"""scripts/line_budget.py: core's budget comes from CONTRIBUTING.md, and a package over its budget fails the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("line_budget", ROOT / "scripts" / "line_budget.py")
line_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(line_budget)


def test_core_budget_is_written_in_contributing():
    assert line_budget.budgets()["core"] > 0


def test_over_budget_fails_and_counts_code_lines_only(tmp_path, monkeypatch, capsys):
    package = tmp_path / "src" / "pkg"
    package.mkdir(parents=True)
    (package / "a.py").write_text('"""doc"""\n\n# a comment\nx = 1\n    # indented comment\ny = 2\n')
    assert line_budget.lines(tmp_path) == 3
    core = line_budget.lines(ROOT / "core")
    monkeypatch.setattr(line_budget, "budgets", lambda: {"core": core - 1})
    assert line_budget.main() == 1
    assert f"core: {core} lines, budget {core - 1}" in capsys.readouterr().out
    monkeypatch.setattr(line_budget, "budgets", lambda: {"core": core})
    assert line_budget.main() == 0
