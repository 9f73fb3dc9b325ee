"""The ASGI layer in front of every route: Host and Origin checks, API keys, CORS, request counting.

* Host: a server bound to loopback answers only requests whose ``Host`` is exactly a loopback address
  with an optional port (``localhost``, ``127.x.x.x``, ``[::1]``), so a web page whose domain was
  re-pointed at 127.0.0.1 (DNS rebinding) cannot reach it. Anything else there (user info such as
  ``evil.example@127.0.0.1``, a path, two Host headers) is refused too. 403 otherwise.
* Origin: a request carrying a browser ``Origin`` is refused (403) unless that origin is the
  server's own address or was allowed with ``--allow-origin`` (``*`` allows any); allowed origins
  get CORS headers and preflight answers.
* Keys: when keys are configured every path but ``/health`` needs ``Authorization: Bearer KEY``
  or ``x-api-key: KEY``; 401 otherwise. The request then carries the key's owner id (:func:`owner_id`),
  which scopes its sessions, prefix-cache entries and receipts.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from leat_server.errors import APIError

OPEN_PATHS = {"/health", "/"}  # "/": "leat is running", as Ollama's root says it runs (clients check it)
COUNTED_PATHS = {
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/sessions",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/reranking",
    "/rerank",
    "/reranking",
    "/models/load",
    "/models/unload",
    "/openapi.json",
    "/tokenizer_info",
    "/completion",
    "/completions",
    "/infill",
    "/apply-template",
    "/props",
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
    "/api/show",
    "/api/tags",
    "/api/ps",
    "/api/version",
}
CORS_HEADERS = [
    (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
    (b"access-control-allow-headers", b"authorization, x-api-key, content-type, anthropic-version, openai-beta"),
    (b"access-control-max-age", b"600"),
]


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


HOST = re.compile(r"^(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9.-]+))(?::\d{1,5})?$")


def _hostname(host_header: str) -> str | None:
    """``[::1]:8080`` -> ``::1``; ``localhost:8080`` -> ``localhost``; None for anything but a host and a port."""
    match = HOST.match(host_header.strip())
    if match is None:
        return None
    return (match.group("ip6") or match.group("name")).lower()


def owner_id(key: str) -> str:
    """16 hex digits naming what an API key owns; derived from the key, so a new key owns nothing of an old one."""
    return hashlib.sha256(b"leat-owner:" + key.encode()).hexdigest()[:16]


def _normal_origin(origin: str) -> str:
    parts = urlsplit(origin.strip())
    if not parts.scheme or not parts.hostname:
        return origin.strip().lower()
    default = {"http": 80, "https": 443}.get(parts.scheme)
    port = parts.port or default
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


class Guard:
    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        keys: Any,
        host: str,
        port: int,
        allow_origins: list[str] = (),
        metrics: Any = None,
    ):
        self.app = app
        self.keys = keys
        self.loopback_only = is_loopback(host)
        self.metrics = metrics
        self.any_origin = "*" in allow_origins
        own = {host, "localhost", "127.0.0.1", "[::1]"} if self.loopback_only else {host}
        self.origins = {_normal_origin(f"{scheme}://{h}:{port}") for h in own for scheme in ("http", "https")}
        self.origins |= {_normal_origin(o) for o in allow_origins if o != "*"}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status_seen = [500]

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_seen[0] = message["status"]
                if origin and allowed_origin:
                    message = {**message, "headers": [*message.get("headers", []), *self._cors(origin)]}
            await send(message)

        raw = scope.get("headers", [])
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        origin = headers.get("origin")
        allowed_origin = origin is not None and (self.any_origin or _normal_origin(origin) in self.origins)
        try:
            hosts = sum(k.lower() == b"host" for k, _ in raw)
            error = self._check(scope, headers, origin, allowed_origin, hosts)
            if error is not None:
                await self._refuse(send, error, path)
                status_seen[0] = error.status
            elif scope["method"] == "OPTIONS" and origin is not None:
                await send({"type": "http.response.start", "status": 204, "headers": self._cors(origin) + CORS_HEADERS})
                await send({"type": "http.response.body", "body": b""})
                status_seen[0] = 204
            else:
                await self.app(scope, receive, counted_send)
        finally:
            if self.metrics is not None:
                self.metrics.http_request(path if path in COUNTED_PATHS else "other", status_seen[0])

    def _check(
        self, scope: dict, headers: dict[str, str], origin: str | None, allowed_origin: bool, hosts: int = 1
    ) -> APIError | None:
        host = headers.get("host")
        if self.loopback_only and host is not None and (hosts > 1 or not is_loopback(_hostname(host) or "")):
            return APIError(
                403,
                f"Host {host!r} is not this server's loopback address; requests must name "
                "localhost or 127.0.0.1 (start leat serve with --host to serve other names)",
            )
        if origin is not None and not allowed_origin:
            return APIError(
                403,
                f"requests from the web origin {origin} are not allowed; start leat serve with "
                f"--allow-origin {origin} to allow it",
            )
        if self.keys and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            key = headers.get("x-api-key")
            auth = headers.get("authorization", "")
            if not key and auth[:7].lower() == "bearer ":
                key = auth[7:].strip()
            name = self.keys.check(key)
            if name is None:
                what = "an invalid API key" if key else "no API key"
                return APIError(
                    401,
                    f"{what}: send 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                    "(keys are made with `leat keys add NAME`)",
                    code="invalid_api_key",
                )
            scope["leat.client"] = name
            scope["leat.owner"] = owner_id(key)
        return None

    def _cors(self, origin: str) -> list[tuple[bytes, bytes]]:
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    async def _refuse(self, send: Callable, error: APIError, path: str) -> None:
        body = error.anthropic_body() if path.startswith("/v1/messages") else error.body()
        headers = [(b"content-type", b"application/json")]
        if error.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
