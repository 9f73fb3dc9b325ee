"""leat on Ray Serve: leat engines as Serve replicas behind ``leat serve``'s OpenAI and Anthropic routes, requests
routed by prompt prefix or session and by load. ``serve run leat_ray:app`` or ``leat ray serve CONFIG``; see
docs/deploy.md. Importing this package imports nothing of Ray (``leat plugins`` imports it to list the command)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "app":
        from leat_ray.deployments import app

        return app
    raise AttributeError(f"module 'leat_ray' has no attribute {name!r}")
