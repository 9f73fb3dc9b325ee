"""Core is the engine, its contracts and the CLI: the HTTP server (Litestar, uvicorn, cryptography) is the
leat-server distribution, which adds ``leat serve`` and ``leat receipts`` through the ``register_commands`` hook."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types

import click
import pytest
from click.testing import CliRunner
from leat import cli as leat_cli
from leat import hookimpl, plugins
from leat.errors import PluginError
from leat.plugins import PluginHost

SERVER_ONLY = ("litestar", "uvicorn", "cryptography", "prometheus_client")
HAS_SERVER = importlib.util.find_spec("leat_server") is not None
needs_server = pytest.mark.skipif(not HAS_SERVER, reason="leat-server is not installed")


def test_core_imports_no_server_dependency():
    code = (
        "import sys, json, contextlib, io\n"
        "import leat, leat.engine, leat.engine_process, leat.model, leat.cli\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    leat.cli.cli.main(['--help'], prog_name='leat')\n"
        f"assert (chr(10) + '  serve ' in out.getvalue()) == {HAS_SERVER}, out.getvalue()\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {SERVER_ONLY!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


@needs_server
def test_plugin_commands_are_added_lazily_from_every_installed_plugin(monkeypatch):
    monkeypatch.setenv("LEAT_PLUGINS", "")  # no plugin selected: commands are still there
    monkeypatch.setattr(plugins, "_commands", None)
    entry = plugins.commands()["serve"]
    assert (entry.plugin, entry.ref) == ("leat-server", "leat_server.cli:serve")
    assert "serve" in leat_cli.cli.list_commands(click.Context(leat_cli.cli))


def test_a_registered_command_runs(monkeypatch):
    command_module = types.ModuleType("leat_test_commands")
    command_module.hello = click.Command("hello", callback=lambda: click.echo("hello from a plugin"))
    monkeypatch.setitem(sys.modules, "leat_test_commands", command_module)
    plugin = types.ModuleType("leat_test_plugin")
    plugin.register_commands = hookimpl(lambda register: register("hello", "leat_test_commands:hello"))
    host = PluginHost([], extra={"leat-test": plugin}, kinds=("commands",))
    monkeypatch.setattr(plugins, "_commands", host)
    result = CliRunner().invoke(leat_cli.cli, ["hello"])
    assert result.exit_code == 0, result.output
    assert result.output == "hello from a plugin\n"
    assert host.plugins["leat-test"].provides == {"commands": ["hello"]}


def test_two_plugins_registering_one_command_is_an_error():
    def plugin(name):
        module = types.ModuleType(name)
        module.register_commands = hookimpl(lambda register: register("serve", "leat_server.cli:serve"))
        return module

    with pytest.raises(PluginError, match="command 'serve' is registered by two plugins"):
        PluginHost([], extra={"a": plugin("a"), "b": plugin("b")}, kinds=("commands",))


@pytest.mark.parametrize("command", ["serve", "receipts"])
def test_server_commands_without_leat_server_name_the_distribution(command, monkeypatch):
    monkeypatch.setattr(plugins, "_commands", PluginHost([], kinds=("commands",)))
    result = CliRunner().invoke(leat_cli.cli, [command, "model.gguf", "--port", "9"])
    assert result.exit_code != 0
    assert "leat-server" in str(result.exception)
    assert "not installed" in str(result.exception)
