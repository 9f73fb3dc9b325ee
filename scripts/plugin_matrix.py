"""Each plugin's own tests, alone: an environment holding core, that plugin and its test group only.

    python3 scripts/plugin_matrix.py          # run with a plain Python: it re-syncs the workspace's .venv

For every workspace member with a ``test`` dependency group, ``uv sync --package NAME --group test --exact``
then ``pytest`` on the member's tests (slow and gpu tests left out: the full run has them). Prints a table,
restores the full workspace (``uv sync --locked --all-extras``) and exits non-zero if any plugin failed alone.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAILURE_LINES = 40  # of a failing plugin's report, printed (twice at most): CI keeps the end of the log


def members() -> list[tuple[str, Path]]:
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = []
    for member in root["tool"]["uv"]["workspace"]["members"]:
        project = tomllib.loads((ROOT / member / "pyproject.toml").read_text())
        if "test" in project.get("dependency-groups", {}):
            found.append((project["project"]["name"], ROOT / member))
    return found


def run_alone(name: str, folder: Path) -> tuple[str, str, float]:
    started = time.perf_counter()
    sync = subprocess.run(
        ["uv", "sync", "--quiet", "--locked", "--package", name, "--group", "test", "--exact"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
    )
    if sync.returncode:
        return "sync failed", sync.stderr.strip().splitlines()[-1], time.perf_counter() - started
    tests = subprocess.run(
        [
            "uv",
            "run",
            "--no-sync",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",  # the workspace's addopts without pytest-xdist's -n: the environment holds the test group only
            "addopts=--import-mode=importlib -ra",
            "-m",
            "not slow and not gpu",
            str(folder / "tests"),
        ],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
    )
    lines = [line for line in tests.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    summary = lines[-1].strip("= ") if lines else (tests.stdout + tests.stderr).strip().splitlines()[-1]
    status = "ok" if tests.returncode == 0 else "FAILED"
    for line in tests.stdout.splitlines():  # which tests, so that a run's log says what failed alone
        if line.startswith(("FAILED ", "ERROR ")):
            print(f"  {name}: {line}", flush=True)
    if tests.returncode:  # and why: the failures' errors, then the end of their report (what the last one printed)
        report = tests.stdout.split(" FAILURES ", 1)[-1].split(" short test summary info ", 1)[0].splitlines()
        errors = [line for line in report if line.startswith("E ")][:FAILURE_LINES]
        print("\n".join(f"  | {line}" for line in [*errors, "...", *report[-FAILURE_LINES:]]), flush=True)
    return status, summary, time.perf_counter() - started


def main() -> int:
    results = []
    try:
        for name, folder in members():
            status, summary, seconds = run_alone(name, folder)
            results.append((name, status, summary, seconds))
            print(f"{name}: {status} ({summary}, {seconds:.0f} s)", flush=True)
    finally:
        subprocess.run(["uv", "sync", "--quiet", "--locked", "--all-extras"], cwd=ROOT, check=False)
    print("\n| plugin | alone | tests | seconds |\n|---|---|---|---|")
    for name, status, summary, seconds in results:
        print(f"| {name} | {status} | {summary} | {seconds:.0f} |")
    return 0 if all(status == "ok" for _, status, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
