"""The documentation cannot drift: docs/cli.md is the CLI's own help, docs/plugins/hooks.md documents exactly the
hooks in leat.hookspecs with their signatures, and the site builds with `mkdocs build --strict`."""

from __future__ import annotations

import importlib.util
import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from leat import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def load_generator():
    spec = importlib.util.spec_from_file_location("leat_docs_gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_matches_the_cli():
    expected = load_generator().cli_markdown()
    assert (DOCS / "cli.md").read_text() == expected, "docs/cli.md is stale: run `uv run python docs/gen_cli.py`"


def test_cli_reference_covers_every_command():
    import click
    from leat.cli import cli

    text = (DOCS / "cli.md").read_text()
    names = cli.list_commands(click.Context(cli))
    assert "serve" in names, "leat serve (leat-server's register_commands hook) is missing"
    for name in names:
        assert f"## `leat {name}`" in text


def hookspec_signatures() -> dict[str, str]:
    specs = {}
    for name, function in inspect.getmembers(hookspecs, inspect.isfunction):
        if hasattr(function, "leat_spec"):
            params = ", ".join(inspect.signature(function).parameters)
            specs[name] = f"{name}({params})"
    return specs


def test_hook_reference_matches_hookspecs():
    specs = hookspec_signatures()
    assert specs, "found no hookspecs"
    documented = re.findall(r"^## `(\w+\([^)]*\))`$", (DOCS / "plugins" / "hooks.md").read_text(), re.MULTILINE)
    by_name = {signature.split("(")[0]: signature for signature in documented}
    assert len(by_name) == len(documented), "a hook is documented twice"
    missing = sorted(set(specs) - set(by_name))
    extra = sorted(set(by_name) - set(specs))
    assert not missing, f"hooks in leat/hookspecs.py missing from docs/plugins/hooks.md: {missing}"
    assert not extra, f"docs/plugins/hooks.md documents hooks that leat/hookspecs.py does not have: {extra}"
    for name, signature in specs.items():
        assert by_name[name] == signature, f"docs/plugins/hooks.md has {by_name[name]}, the hookspec is {signature}"


def test_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (it is in the dev dependency group)")
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "cli" / "index.html").is_file()
