"""A plugin built from plugins/_template, installed from wheels into a fresh environment beside core (built from
core/, not the workspace), adds a sampler stage, a chat format and a ``leat`` command with no change to core; its
tests (the conformance kit included) pass there, and fail with a message, not a skip, once leat-backend-cpu (the
kit's reference) is uninstalled."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("template_helpers", HERE / "test_template_plugin.py")
helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(helpers)
run, ROOT = helpers.run, helpers.ROOT

DISTRIBUTIONS = ["core", "backends/cpu", "architectures/llama", "plugins/samplers", "plugins/_template"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    uv = shutil.which("uv")
    assert uv is not None, "uv is not installed (pip install uv)"
    tmp = tmp_path_factory.mktemp("extensions")
    wheels = tmp / "wheels"
    for dist in DISTRIBUTIONS:
        source = tmp / "src" / dist  # a copy, so the build leaves nothing in the work tree
        shutil.copytree(ROOT / dist, source, ignore=shutil.ignore_patterns("__pycache__", "dist", ".venv"))
        run(uv, "build", "--wheel", "--no-sources", "--out-dir", wheels, source)
    env = tmp / "venv"
    run(uv, "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", env)
    run(uv, "pip", "install", "--python", env / "bin" / "python", *sorted(wheels.glob("*.whl")), "pytest")
    return env


def template_tests(venv, tmp_path) -> subprocess.CompletedProcess:
    shutil.copytree(ROOT / "plugins" / "_template" / "tests", tmp_path / "tests")
    command = [venv / "bin" / "python", "-m", "pytest", "-rs", "-p", "no:cacheprovider", "tests"]
    return subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_the_plugin_adds_a_stage_a_format_and_a_command(venv, tmp_path):
    rows = {row["name"]: row for row in json.loads(run(venv / "bin" / "leat", "plugins"))}
    provides = rows["leat-example"]["provides"]
    assert provides["samplers"] == ["top_a"] and provides["chat_formats"] == ["example"]
    assert provides["commands"] == ["example-tiny"]
    path = tmp_path / "tiny.gguf"
    assert run(venv / "bin" / "leat", "example-tiny", path).strip() == str(path) and path.stat().st_size > 1000
    script = (
        "import json, sys, leat\n"
        "from leat.chatformat import choose\n"
        "from leat.sampling import Sampler, SamplingParams\n"
        "params = SamplingParams.resolve({'top_a': 0.5, 'temperature': 1.0, 'seed': 3}, {})\n"
        "model = leat.load(sys.argv[1])\n"
        "text = ''.join(t.text for t in model.generate('hello', max_tokens=4, sampling={'top_a': 0.5, 'seed': 3}))\n"
        "print(json.dumps({'stages': [s.name for s in Sampler.build(params).stages], 'top_a': params.top_a,\n"
        "                  'format': choose('', [], model.file.architecture), 'text': text}))\n"
    )
    out = json.loads(run(venv / "bin" / "python", "-c", script, path))
    assert out["stages"] == ["top_k", "top_p", "min_p", "top_a", "temperature"] and out["top_a"] == 0.5
    assert out["format"] == "example" and isinstance(out["text"], str)
    bad = subprocess.run(
        [venv / "bin" / "python", "-c", "from leat.sampling import SamplingParams; SamplingParams(top_a=2.0)"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert "top_a must be `float` <= 1" in bad.stderr


def test_template_tests_pass_then_fail_without_the_reference_backend(venv, tmp_path):
    result = template_tests(venv, tmp_path / "with")
    assert result.returncode == 0 and "skipped" not in result.stdout, result.stdout + result.stderr
    assert "leat conformance kit" in result.stdout
    run(shutil.which("uv"), "pip", "uninstall", "--python", venv / "bin" / "python", "leat-backend-cpu")
    result = template_tests(venv, tmp_path / "without")
    assert result.returncode != 0 and "skipped" not in result.stdout, result.stdout
    assert "leat's conformance kit needs its reference backend (leat-backend-cpu)" in result.stdout, result.stdout
    assert "install 'leat[conformance]'" in result.stdout
