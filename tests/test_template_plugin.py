"""Third-party plugins built from the templates, installed from wheels into a fresh environment beside core (built
from core/, not the workspace): an architecture from plugins/_template and a backend from plugins/_template_backend.
`leat plugins` lists both, `leat generate` / `leat run` use them on tiny files, and each template's own tests (the
conformance kit) pass there. One environment holds both, so the wheels are built and installed once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the backend kit's model checks need the CPU backend (the float64 oracle) and the llama architecture (tiny files)
DISTRIBUTIONS = ["core", "backends/cpu", "architectures/llama", "plugins/samplers", "plugins/_template"]
DISTRIBUTIONS += ["plugins/_template_backend"]

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


def write_tiny(venv, architecture: str, path: Path) -> Path:
    """A tiny random-weight GGUF of ``architecture`` ("module:Class"), written by the environment's own leat."""
    module, cls = architecture.split(":")
    script = f"import sys; from leat.testing import write_tiny_gguf; from {module} import {cls}; "
    run(venv / "bin" / "python", "-c", script + f"write_tiny_gguf({cls}, sys.argv[1])", path)
    return path


def run_template_tests(venv, template: str, tmp_path: Path) -> None:
    """A template's tests, copied out of the work tree so that they import the installed wheel: all must pass."""
    shutil.copytree(ROOT / "plugins" / template / "tests", tmp_path / "tests")
    out = run(venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=tmp_path)
    assert "passed" in out and "skipped" not in out and "failed" not in out


def test_plugins_lists_the_templates(venv):
    rows = json.loads(run(venv / "bin" / "leat", "plugins"))
    by_name = {row["name"]: row for row in rows}
    assert by_name["leat-example"]["status"] == "loaded", by_name["leat-example"]
    assert by_name["leat-example"]["provides"]["architectures"] == ["example"]
    assert by_name["leat-backend-example"]["status"] == "loaded", by_name["leat-backend-example"]
    assert by_name["leat-backend-example"]["provides"]["backends"] == ["example"]
    assert Path(
        json.loads(run(venv / "bin" / "python", "-c", "import json, leat; print(json.dumps(leat.__file__))"))
    ).is_relative_to(venv)


def test_generate_uses_the_template_architecture(venv, tmp_path):
    path = write_tiny(venv, "leat_example.architecture:Example", tmp_path / "tiny-example.gguf")
    out = json.loads(
        run(venv / "bin" / "leat", "generate", "-m", path, "-p", "hello", "-n", "5", "--temperature", "0", "--json")
    )
    assert out["backend"] == "cpu" and len(out["ids"]) == 5
    run(venv / "bin" / "leat", "run", path, "hello", "-n", "3", "--temperature", "0")  # chat, the fallback template
    doctor = run(venv / "bin" / "leat", "doctor", "-m", path, "--json")
    assert "example" in doctor


def test_template_tests_pass_with_the_kit(venv, tmp_path):
    run_template_tests(venv, "_template", tmp_path)


def test_run_uses_the_template_backend(venv, tmp_path):
    path = write_tiny(venv, "leat_arch_llama.llama:Llama", tmp_path / "tiny-llama.gguf")
    leat = venv / "bin" / "leat"
    args = ["-m", path, "-p", "hello", "-n", "5", "--temperature", "0", "--json"]
    out = json.loads(run(leat, "generate", *args, "--backend", "example"))
    assert out["backend"] == "example" and len(out["ids"]) == 5
    assert out["ids"] == json.loads(run(leat, "generate", *args, "--backend", "cpu"))["ids"]
    assert run(leat, "run", path, "hello", "-n", "3", "--temperature", "0", "--backend", "example").strip()


def test_template_backend_passes_the_kit(venv, tmp_path):
    run_template_tests(venv, "_template_backend", tmp_path)
