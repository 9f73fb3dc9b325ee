"""The arguments of a leat application on Ray Serve (``args:`` in a Serve config file), checked before anything
is deployed: the model and how to load it, every ``leat serve`` option (:class:`leat_server.ServeOptions`' fields,
same names, ``api_workers`` aside: Ray runs the processes), and how requests are routed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
from leat.errors import LeatError
from leat_server import ServeOptions, check_bind
from leat_server.security import is_loopback

from leat_ray.routing import IMBALANCE, PREFIX_CHARS

SERVE_PORT = 8000  # Ray Serve's, the default of args.port
LOADING = {"threads", "speculate", "plugins"}  # how each replica loads the model, beside ServeOptions' fields
ROUTING = {"prefix_chars", "imbalance"}
NOT_HERE = {"api_workers": "Ray Serve runs the processes: set num_replicas (or autoscaling_config) instead"}
DEPLOYMENTS = ("LeatIngress", "LeatReplica")


class Loading(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    threads: int | None = None
    speculate: str | None = None
    plugins: str | None = None


class Routing(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prefix_chars: int = PREFIX_CHARS
    imbalance: int = IMBALANCE


@dataclasses.dataclass
class AppArgs:
    serve: ServeOptions
    loading: Loading
    routing: Routing

    def load_model(self) -> Any:
        from leat_server.cli import load_model

        s, load = self.serve, self.loading
        return load_model(s.model, s.backend, s.precision, load.threads, load.speculate, s.draft, load.plugins)


def parse_args(args: dict[str, Any] | None) -> AppArgs:
    """``args`` checked: a LeatError that names the bad key and what it takes."""
    if not isinstance(args, dict) or not args.get("model"):
        raise LeatError("the application's args need 'model': a GGUF path, 'default', or a pulled model's name")
    known = {f.name for f in dataclasses.fields(ServeOptions)} - set(NOT_HERE)
    for name in args:
        if name in NOT_HERE:
            raise LeatError(f"args.{name} does not apply on Ray Serve: {NOT_HERE[name]}")
        if name not in known | LOADING | ROUTING:
            raise LeatError(
                f"args.{name} is not a leat option; the options are: {', '.join(sorted(known | LOADING | ROUTING))}"
            )
    serve = {"port": SERVE_PORT} | {k: v for k, v in args.items() if k in known}
    try:
        options = msgspec.convert(serve, ServeOptions)
        loading = msgspec.convert({k: v for k, v in args.items() if k in LOADING}, Loading)
        routing = msgspec.convert({k: v for k, v in args.items() if k in ROUTING}, Routing)
    except msgspec.ValidationError as e:
        raise LeatError(f"bad application args: {e}".replace("`$.", "`args.")) from None
    if routing.prefix_chars < 1 or routing.imbalance < 0:
        raise LeatError("args.prefix_chars must be >= 1 and args.imbalance >= 0")
    check_bind(options.host, options.api_key_file)  # each replica reads the file; here: that there is one
    if "kv" not in args:
        from leat.cli_options import default_kv

        options.kv = default_kv(options.precision)
    return AppArgs(options, loading, routing)


def read_config(path: str | Path) -> dict[str, Any]:
    """A Ray Serve config file (YAML), checked by Serve's own schema and each leat application's args."""
    import yaml

    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LeatError(f"cannot read the config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise LeatError(f"{path} is not YAML: {e}") from None
    return check_config(document, str(path))


def check_config(document: Any, where: str = "the config") -> dict[str, Any]:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    if not isinstance(document, dict):
        raise LeatError(f"{where} should be a Ray Serve config: a mapping with 'applications'")
    try:
        ServeDeploySchema.model_validate(document)
    except ValidationError as e:
        raise LeatError(f"{where} is not a valid Ray Serve config: {_first_error(e)}") from None
    http = document.get("http_options") or {}
    for i, application in enumerate(document.get("applications") or []):
        if str(application.get("import_path", "")).startswith("leat_ray"):
            try:
                parsed = parse_args(application.get("args"))
            except LeatError as e:
                raise LeatError(f"{where}: applications[{i}] ({application.get('name', 'default')}): {e}") from None
            _check_address(parsed.serve, http, f"{where}: applications[{i}]")
            for deployment in application.get("deployments") or []:
                if deployment.get("name") not in DEPLOYMENTS:
                    raise LeatError(
                        f"{where}: applications[{i}] has no deployment {deployment.get('name')!r}; "
                        f"a leat application's deployments are {', '.join(DEPLOYMENTS)}"
                    )
    return document


def _check_address(serve: ServeOptions, http: dict[str, Any], where: str) -> None:
    """leat serve's Host and Origin checks in each replica use ``args.host`` and ``args.port``: they must be where
    Serve's proxy listens, or requests that name this machine are refused (403)."""
    host, port = http.get("host", "127.0.0.1"), http.get("port", SERVE_PORT)
    if serve.port != port or not (serve.host == host or is_loopback(serve.host) and is_loopback(host)):
        raise LeatError(
            f"{where}: args.host and args.port ({serve.host}:{serve.port}) must be where Serve listens "
            f"(http_options: {host}:{port}): leat serve's Host and Origin checks use them"
        )


def _first_error(error: Any) -> str:
    first = error.errors()[0]
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
