"""``leat ray``: deploy leat applications on Ray Serve from a Serve config file, or check one."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import click
from leat.errors import LeatError


@click.group()
def ray() -> None:
    """leat replicas on Ray Serve (docs/deploy.md)."""


@ray.command("check")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
def check(config: str) -> None:
    """Check CONFIG (a Ray Serve config file) against Serve's schema and leat's options; print what it deploys."""
    from leat_ray.config import read_config

    document = read_config(config)
    summary = [
        {
            "name": a.get("name", "default"),
            "route_prefix": a.get("route_prefix", "/"),
            "model": (a.get("args") or {}).get("model"),
            "deployments": {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in a.get("deployments", [])},
        }
        for a in document["applications"]
    ]
    click.echo(json.dumps({"valid": True, "applications": summary}, indent=2))


@ray.command("serve")
@click.argument("config", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--address",
    default=None,
    help="a running Ray cluster (auto, or ray://HOST:10001); default: RAY_ADDRESS, else a local Ray started here",
)
@click.option("--num-cpus", type=click.IntRange(1), default=None, help="CPUs of a local Ray (default: all)")
@click.option(
    "--metrics-export-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="where a local Ray serves its Prometheus metrics, leat's per-replica figures among them",
)
def serve_command(config: str, address: str | None, num_cpus: int | None, metrics_export_port: int | None) -> None:
    """Deploy every application in CONFIG (a Ray Serve config file) and serve until Ctrl-C or SIGTERM."""
    from leat_ray.config import read_config

    document = read_config(config)  # checked before Ray starts
    address = address or os.environ.get("RAY_ADDRESS")
    if address and (num_cpus or metrics_export_port):
        raise click.UsageError("--num-cpus and --metrics-export-port set up a local Ray; give them to `ray start`")
    # under `uv run`, Ray would otherwise ship this folder to every worker as its working directory
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray as ray_module
    from ray import serve

    local = {"num_cpus": num_cpus, "_metrics_export_port": metrics_export_port} if not address else {}
    try:
        ray_module.init(address=address, include_dashboard=False, **local)
    except Exception as e:  # noqa: BLE001 - Ray raises a plain Exception for a node that timed out
        where = f"the Ray cluster at {address}" if address else "a local Ray"
        raise LeatError(f"could not start or join {where}: {e}") from None
    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a shell's background job starts with it ignored
        signal.signal(sig, _interrupt)
    http = document.get("http_options") or {}
    serve.start(http_options=http)
    try:
        for application in document["applications"]:
            _deploy(application)
        where = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"
        names = ", ".join(a.get("name", "default") for a in document["applications"])
        click.echo(f"leat: serving {names} on {where} through Ray Serve (Ctrl-C stops)", err=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _deploy(application: dict[str, Any]) -> None:
    from ray import serve

    from leat_ray.deployments import build

    if not str(application.get("import_path", "")).startswith("leat_ray"):
        raise LeatError(
            f"application {application.get('name', 'default')!r} imports {application.get('import_path')!r}; "
            "`leat ray serve` deploys leat_ray:app applications (use `serve deploy` for a mixed config)"
        )
    deployments = {d["name"]: {k: v for k, v in d.items() if k != "name"} for d in application.get("deployments", [])}
    serve.run(
        build(application.get("args") or {}, deployments),
        name=application.get("name", "default"),
        route_prefix=application.get("route_prefix", "/"),
        blocking=False,
    )
