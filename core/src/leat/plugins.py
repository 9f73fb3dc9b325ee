"""Finding, loading and querying plugins.

Plugins are modules named under the ``leat`` entry-point group. Which ones load:
``LEAT_PLUGINS`` unset = every installed plugin, ``""`` = none, ``"a,b"`` = only those
distributions; ``--plugins`` on the CLI overrides the variable. A plugin that fails to import is
kept in the list with its error (``leat plugins`` shows it) instead of being skipped silently.
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from leat import hookspecs
from leat.errors import PluginError

ENTRY_POINT_GROUP = "leat"
KINDS = ("backends", "architectures", "samplers", "proposers", "commands", "chat_formats")


@dataclass
class Registered:
    """One thing a plugin registered: a lazy ``module:attribute`` reference."""

    name: str
    ref: str
    plugin: str
    options: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        module_name, _, attr = self.ref.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split(".") if attr else []:
                obj = getattr(obj, part)
        except Exception as e:
            raise PluginError(f"plugin {self.plugin}: cannot import {self.ref} ({type(e).__name__}: {e})") from e
        return obj


@dataclass
class PluginInfo:
    name: str
    version: str
    module: str
    status: str = "loaded"  # "loaded" | "failed"
    error: str | None = None
    provides: dict[str, list[str]] = field(default_factory=dict)


def selection_from_env() -> list[str] | None:
    """The plugin names ``LEAT_PLUGINS`` asks for: None means all installed."""
    value = os.environ.get("LEAT_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


class PluginHost:
    """Loads plugins and holds what they registered, by kind and name."""

    def __init__(
        self,
        only: list[str] | None = None,
        extra: dict[str, ModuleType] | None = None,
        kinds: tuple[str, ...] = KINDS,
    ):
        self.only = only
        self.kinds = kinds
        self.manager = pluggy.PluginManager("leat")
        self.manager.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.registry: dict[str, dict[str, Registered]] = {kind: {} for kind in KINDS}
        self._load_entry_points()
        for name, module in (extra or {}).items():
            self._register_module(name, module, version="(in-process)")
        self._check_hooks()
        self._collect()

    def _load_entry_points(self) -> None:
        found = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
        if self.only is not None:
            missing = [name for name in self.only if name not in found]
            if missing:
                raise PluginError(
                    f"plugin(s) not installed: {', '.join(missing)}; installed: {', '.join(sorted(found)) or 'none'}"
                )
        for name in sorted(found):
            if self.only is not None and name not in self.only:
                continue
            ep = found[name]
            version = ep.dist.version if ep.dist else "unknown"
            try:
                module = ep.load()
            except Exception as e:  # noqa: BLE001 - a broken plugin is reported, never skipped silently
                self.plugins[name] = PluginInfo(name, version, ep.value, "failed", f"{type(e).__name__}: {e}")
                continue
            self._register_module(name, module, version)

    def _register_module(self, name: str, module: ModuleType, version: str) -> None:
        self.manager.register(module, name=name)
        self.plugins[name] = PluginInfo(name, version, module.__name__)

    def _check_hooks(self) -> None:
        """pluggy's ``check_pending`` (a hookimpl that matches no hook spec), as one line naming the plugin and hook."""
        known = sorted(name for name in vars(hookspecs) if name.startswith("register_"))
        for name, caller in vars(self.manager.hook).items():
            if not isinstance(caller, pluggy.HookCaller) or caller.spec is not None:
                continue
            for impl in caller.get_hookimpls():
                if impl.optionalhook:
                    continue
                near = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {near[0]}?" if near else f"leat's hooks are {', '.join(known)}"
                raise PluginError(f"plugin {impl.plugin_name}: unknown hook {name} ({hint})")
        self.manager.check_pending()  # anything the loop above missed, in pluggy's words

    def _collect(self) -> None:
        for kind in self.kinds:
            hook = getattr(self.manager.hook, f"register_{kind}")
            for impl in hook.get_hookimpls():
                impl.function(register=self._registrar(kind, impl.plugin_name))

    def _registrar(self, kind: str, plugin: str):
        def register(name: str, ref: str, **options: Any) -> None:
            table = self.registry[kind]
            if name in table:
                raise PluginError(
                    f"{kind[:-1]} {name!r} is registered by two plugins: {table[name].plugin} and {plugin}; "
                    f"uninstall one or choose with LEAT_PLUGINS / --plugins"
                )
            if ":" not in ref:
                raise PluginError(f"plugin {plugin}: {kind[:-1]} {name!r} reference {ref!r} is not 'module:attribute'")
            table[name] = Registered(name, ref, plugin, options)
            self.plugins[plugin].provides.setdefault(kind, []).append(name)

        return register

    def failed(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.status == "failed"]

    def get(self, kind: str, name: str) -> Registered | None:
        return self.registry[kind].get(name)


_host: PluginHost | None = None
_commands: PluginHost | None = None


def host() -> PluginHost:
    """The process-wide plugin host, built on first use from ``LEAT_PLUGINS``."""
    global _host
    if _host is None:
        _host = PluginHost(selection_from_env())
    return _host


def use(only: list[str] | None) -> PluginHost:
    """Replace the process-wide host (the CLI's ``--plugins``)."""
    global _host
    _host = PluginHost(only)
    return _host


def commands() -> dict[str, Registered]:
    """The ``leat`` subcommands plugins register, from every installed plugin (whatever ``LEAT_PLUGINS`` selects:
    a command such as ``serve`` chooses its plugins itself); only the ``register_commands`` hook is asked."""
    global _commands
    if _commands is None:
        _commands = PluginHost(None, kinds=("commands",))
    return _commands.registry["commands"]
