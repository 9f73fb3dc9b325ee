import json
import subprocess
import sys
import types

import pytest
from leat import hookimpl
from leat.errors import PluginError
from leat.plugins import PluginHost


def leat(*args, env=None):
    return subprocess.run([sys.executable, "-m", "leat", *args], check=False, capture_output=True, text=True, env=env)


def test_all_installed_plugins_load_and_list_what_they_provide():
    host = PluginHost(None)
    assert host.get("backends", "cpu").plugin == "leat-backend-cpu"
    assert host.get("architectures", "llama").plugin == "leat-arch-llama"
    assert not host.failed(), [p.error for p in host.failed()]


def test_registration_is_lazy():
    code = (
        "import sys; from leat.plugins import PluginHost; PluginHost(None); "
        "print(any(m.startswith(('leat_backend_cpu.backend', 'leat_arch_llama.llama')) for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, {"leat-backend-cpu", "leat-arch-llama", "leat-samplers"}),
        ("", set()),
        ("leat-backend-cpu", {"leat-backend-cpu"}),
    ],
)
def test_leat_plugins_variable_selects(value, expected, monkeypatch):
    import os

    env = dict(os.environ)
    env.pop("LEAT_PLUGINS", None)
    if value is not None:
        env["LEAT_PLUGINS"] = value
    result = leat("plugins", env=env)
    assert result.returncode == 0, result.stderr
    names = {row["name"] for row in json.loads(result.stdout)}
    assert expected <= names if value is None else names == expected


def test_plugins_option_overrides_variable_and_check_probes():
    import os

    env = dict(os.environ, LEAT_PLUGINS="")
    result = leat("plugins", "--check", "--plugins", "leat-backend-cpu", env=env)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["provides"] == {"backends": ["cpu"]}
    assert row["checks"] == {"cpu": {"usable": True, "reason": None}}


def test_unknown_plugin_name_is_an_error():
    with pytest.raises(PluginError, match="not installed: leat-nope"):
        PluginHost(["leat-nope"])


def _plugin(**hooks):
    module = types.ModuleType("fake_plugin")
    for name, fn in hooks.items():
        setattr(module, name, hookimpl(fn))
    return module


def test_name_clash_names_both_plugins():
    clash = _plugin(register_backends=lambda register: register("cpu", "somewhere:Else"))
    with pytest.raises(PluginError, match="registered by two plugins: leat-backend-cpu and fake"):
        PluginHost(["leat-backend-cpu"], extra={"fake": clash})


def test_bad_reference_is_reported_when_used():
    broken = _plugin(register_architectures=lambda register: register("nothing", "no_such_module:Arch"))
    host = PluginHost([], extra={"broken": broken})
    with pytest.raises(PluginError, match="plugin broken: cannot import no_such_module:Arch"):
        host.get("architectures", "nothing").load()


def test_failing_plugin_import_is_reported(tmp_path, monkeypatch):
    dist = tmp_path / "leat_broken-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: leat-broken\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[leat]\nleat-broken = leat_broken_plugin\n")
    (tmp_path / "leat_broken_plugin.py").write_text("raise RuntimeError('kaput')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    host = PluginHost(None)
    failed = {p.name: p for p in host.failed()}
    assert "RuntimeError: kaput" in failed["leat-broken"].error


def test_misspelled_hookimpl_is_an_error_naming_plugin_and_hook():
    typo = _plugin(register_sampler=lambda register: register("mine", "somewhere:Stage"))
    with pytest.raises(
        PluginError, match=r"^plugin typo: unknown hook register_sampler \(did you mean register_samplers\?\)$"
    ):
        PluginHost([], extra={"typo": typo})


def test_misspelled_hookimpl_stops_the_command_line_with_one_line(tmp_path):
    import os

    dist = tmp_path / "leat_typo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: leat-typo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[leat]\nleat-typo = leat_typo_plugin\n")
    (tmp_path / "leat_typo_plugin.py").write_text(
        "from leat import hookimpl\n\n@hookimpl\ndef register_backend(register):\n    pass\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("LEAT_PLUGINS", None)
    result = leat("plugins", env=env)
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        "error: plugin leat-typo: unknown hook register_backend (did you mean register_backends?)"
    ]
