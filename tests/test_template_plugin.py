"""A plugin author's first hour, as the plugin docs write it: in a copy of the repository (its tracked and
unignored files, as a fresh clone has them), the first shell block of docs/plugins/architecture.md and of
docs/plugins/backend.md runs word for word: the workspace's wheels are built into a local folder that uv searches,
the template is copied out, a fresh environment installs it with its test extra from there, and `leat plugins`,
the template's conformance-kit tests and `leat generate` / `leat run` on a tiny file follow.

The checks then look at what those environments hold: the plugin listed and loaded, the kit's tests passed with
none skipped, the example backend generating the same tokens as the CPU backend.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def shell_block(doc: Path) -> str:
    """The first ```sh block of a page."""
    match = re.search(r"```sh\n(.*?)```", doc.read_text(), re.DOTALL)
    assert match, f"{doc} has no sh block"
    return match.group(1)


def run(*args, cwd=None, timeout=600) -> str:
    result = subprocess.run(
        [str(a) for a in args], check=False, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def authored(tmp_path_factory, leat_home):
    """Run both docs' blocks, each from the root of its own copy of the repository; returns the two plugin folders
    and the blocks' output."""
    if shutil.which("uv") is None:
        pytest.skip("uv is not installed")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the copy is made from git's list of files")
    files = run("git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", cwd=ROOT).split("\0")
    out = {}
    for doc, folder in (("architecture.md", "leat-myarch"), ("backend.md", "leat-backend-mydevice")):
        base = tmp_path_factory.mktemp(folder)
        clone = base / "leat"
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, clone / name)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_", "LEAT_PLUGINS"))}
        env["LEAT_HOME"] = str(leat_home(base / "home"))  # the CPU kernels compiled once, not in each block
        if "UV_CACHE_DIR" in os.environ:
            env["UV_CACHE_DIR"] = os.environ["UV_CACHE_DIR"]
        script = "set -euo pipefail\n" + shell_block(ROOT / "docs" / "plugins" / doc)
        result = subprocess.run(
            ["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, check=False, timeout=1200
        )
        assert result.returncode == 0, f"docs/plugins/{doc}'s block failed:\n{result.stdout}\n{result.stderr}"
        out[doc] = (base / folder, result.stdout)
    return out


def test_architecture_plugin_by_the_docs(authored):
    folder, output = authored["architecture.md"]
    venv = folder / ".venv"
    core = json.loads(run(venv / "bin" / "python", "-c", "import json, leat; print(json.dumps(leat.__file__))"))
    assert Path(core).is_relative_to(venv), "leat must come from the wheel in the new environment"
    version = run(venv / "bin" / "python", "-c", "from importlib import metadata; print(metadata.version('leat-core'))")
    assert version.strip() == "0.1.0"
    rows = {row["name"]: row for row in json.loads(run(venv / "bin" / "leat", "plugins"))}
    assert rows["leat-example"]["status"] == "loaded" and rows["leat-example"]["provides"]["architectures"] == [
        "example"
    ]
    summary = [line for line in output.splitlines() if re.search(r"\d+ passed", line)]
    assert summary and "failed" not in summary[0] and "skipped" not in summary[0], output
    generated = run(
        venv / "bin" / "leat", "generate", folder / "tiny.gguf", "-p", "hello", "-n", "5", "--temp", "0", "--json"
    )
    described = json.loads(generated)
    assert described["backend"] == "cpu" and len(described["ids"]) == 5
    assert "example" in run(venv / "bin" / "leat", "doctor", folder / "tiny.gguf", "--json")


def test_backend_plugin_by_the_docs(authored):
    folder, output = authored["backend.md"]
    venv = folder / ".venv"
    rows = {row["name"]: row for row in json.loads(run(venv / "bin" / "leat", "plugins"))}
    assert rows["leat-backend-example"]["status"] == "loaded"
    assert rows["leat-backend-example"]["provides"]["backends"] == ["example"]
    summary = [line for line in output.splitlines() if re.search(r"\d+ passed", line)]
    assert summary and "failed" not in summary[0] and "skipped" not in summary[0], output
    args = [folder / "tiny.gguf", "-p", "hello", "-n", "5", "--temp", "0", "--json"]
    example = json.loads(run(venv / "bin" / "leat", "generate", *args, "--backend", "example"))
    cpu = json.loads(run(venv / "bin" / "leat", "generate", *args, "--backend", "cpu"))
    assert example["backend"] == "example" and len(example["ids"]) == 5 and example["ids"] == cpu["ids"]
