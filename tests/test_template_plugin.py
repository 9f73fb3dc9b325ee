"""A third-party architecture plugin built from plugins/_template, installed from wheels into a fresh environment
beside core (built from core/, not the workspace): `leat plugins` lists it, `leat generate` runs a tiny file of its
architecture, and its own tests (the conformance kit) pass there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ["core", "backends/cpu", "plugins/samplers", "plugins/_template"]

pytestmark = pytest.mark.slow


def run(*args, cwd=None, timeout=300) -> str:
    result = subprocess.run(
        [str(a) for a in args], check=False, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    tmp = tmp_path_factory.mktemp("template")
    wheels = tmp / "wheels"
    for dist in DISTRIBUTIONS:
        source = tmp / "src" / dist  # a copy, so the build leaves nothing in the work tree
        shutil.copytree(ROOT / dist, source, ignore=shutil.ignore_patterns("__pycache__", "dist", ".venv"))
        run(uv, "build", "--wheel", "--no-sources", "--out-dir", wheels, source)
    env = tmp / "venv"
    run(uv, "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", env)
    python = env / "bin" / "python"
    run(uv, "pip", "install", "--python", python, *sorted(wheels.glob("*.whl")), "pytest")
    return env


def test_plugins_lists_the_template(venv):
    rows = json.loads(run(venv / "bin" / "leat", "plugins"))
    by_name = {row["name"]: row for row in rows}
    assert by_name["leat-example"]["status"] == "loaded", by_name["leat-example"]
    assert by_name["leat-example"]["provides"]["architectures"] == ["example"]
    assert Path(
        json.loads(run(venv / "bin" / "python", "-c", "import json, leat; print(json.dumps(leat.__file__))"))
    ).is_relative_to(venv)


def test_generate_uses_the_template_architecture(venv, tmp_path):
    path = tmp_path / "tiny-example.gguf"
    script = "import sys; from leat.testing import write_tiny_gguf; from leat_example.architecture import Example; "
    script += "write_tiny_gguf(Example, sys.argv[1])"
    run(venv / "bin" / "python", "-c", script, path)
    out = json.loads(
        run(venv / "bin" / "leat", "generate", "-m", path, "-p", "hello", "-n", "5", "--temperature", "0", "--json")
    )
    assert out["backend"] == "cpu" and len(out["ids"]) == 5
    run(venv / "bin" / "leat", "run", path, "hello", "-n", "3", "--temperature", "0")  # chat, the fallback template
    doctor = run(venv / "bin" / "leat", "doctor", "-m", path, "--json")
    assert "example" in doctor


def test_template_tests_pass_with_the_kit(venv, tmp_path):
    shutil.copytree(ROOT / "plugins" / "_template" / "tests", tmp_path / "tests")
    out = run(venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=tmp_path)
    assert "passed" in out and "skipped" not in out and "failed" not in out
