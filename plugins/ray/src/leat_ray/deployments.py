"""The two Ray Serve deployments of a leat application and the builder that binds them (``leat_ray:app``).

``LeatIngress`` takes every HTTP request from Serve's proxy, reads its body for the routing key
(:mod:`leat_ray.routing`) and streams it to a ``LeatReplica`` through a deployment handle, whose request router
(:class:`leat_ray.router.PrefixAffinityRouter`) picks the replica. Each ``LeatReplica`` holds a model, an engine
and ``leat serve``'s own ASGI app (:func:`leat_server.build`): every route, check and error of ``leat serve`` is
that app's, run in the replica on the forwarded request. A replica that dies mid-request ends that request with
a 503 (in-band on a stream that had started); Serve starts a new replica in its place.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from leat_server.errors import APIError
from leat_server.openai_api import sse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from leat_ray.config import AppArgs, parse_args
from leat_ray.routing import ProxiedRequest, ResponseStart, owner_of, routing_key

log = logging.getLogger("leat_ray")
REPLICA_HEADER = b"x-leat-replica"  # "<replica id> <pid>" of the replica that answered
LIFESPAN_TIMEOUT = 60.0


class LeatReplica:
    """One engine and ``leat serve``'s app over it; :meth:`handle` runs one forwarded HTTP request through it."""

    def __init__(self, args: dict[str, Any]):
        from leat_server import build, open_keys

        from leat_ray.metrics import MetricsMirror

        parsed: AppArgs = parse_args(args)
        model = parsed.load_model()
        self.app, self.engine = build(parsed.serve, model, open_keys(parsed.serve), log=log.info)
        self.engine.start()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.header = (REPLICA_HEADER, f"{self.name} {os.getpid()}".encode())
        self.metrics = MetricsMirror(self.app.metrics.registry)
        self._lifespan: asyncio.Future | None = None
        self._ready = asyncio.Event()

    async def handle(self, request: ProxiedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The response to ``request``: a :class:`ResponseStart`, then its body's chunks. Closing this generator
        early (the client gone: Serve cancels it) is a disconnect for the app, which cancels the engine request."""
        await self._started()
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        unread = [request.body]

        async def receive() -> dict[str, Any]:
            if unread:
                return {"type": "http.request", "body": unread.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query_string,
            "root_path": "",
            "headers": request.headers,
            "client": request.client,
            "server": None,
        }
        task = asyncio.ensure_future(self.app(scope, receive, messages.put))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    yield ResponseStart(message["status"], [*message.get("headers", []), self.header])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        finally:
            gone.set()  # however it ended: the app's clean-up (and a cancelled request's) runs now
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except Exception:  # noqa: BLE001 - the response is over; what the app does after it is its own
                task.cancel()

    async def _started(self) -> None:
        """Run the app's startup (its session sweeper) once, before the first request."""
        if self._lifespan is None:
            events: asyncio.Queue = asyncio.Queue()
            await events.put({"type": "lifespan.startup"})

            async def send(message: dict[str, Any]) -> None:
                if message["type"].startswith("lifespan.startup."):
                    self._ready.set()

            self._lifespan = asyncio.ensure_future(self.app({"type": "lifespan"}, events.get, send))
        await asyncio.wait_for(self._ready.wait(), LIFESPAN_TIMEOUT)

    def check_health(self) -> None:
        """Serve's health check (every ``health_check_period_s``): the engine answers, and leat's figures are
        copied into Ray's metrics."""
        self.engine.stats()  # raises if the engine cannot answer
        self.metrics.mirror()

    def __del__(self) -> None:
        if hasattr(self, "engine"):
            self.engine.stop()


class LeatIngress:
    """Takes the HTTP requests and streams each to a replica, routed by its prefix or session."""

    def __init__(self, replicas: Any, args: dict[str, Any]):
        self.replicas = replicas.options(stream=True)
        self.prefix_chars = parse_args(args).routing.prefix_chars

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        headers = list(request.scope.get("headers", []))
        path = request.url.path
        proxied = ProxiedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=headers,
            body=body,
            key=routing_key(path, body, owner_of(headers), self.prefix_chars) if request.method != "GET" else None,
            client=tuple(request.client) if request.client else None,
        )
        chunks = self.replicas.handle.remote(proxied)
        try:
            start = await chunks.__anext__()
        except StopAsyncIteration:
            return _error(path, 502, "the replica ended the request without an answer")
        except (RayActorError, ActorUnavailableError) as e:
            return _error(path, 503, _replica_lost(e))
        except Exception:  # the replica's own failure, not the app's answer (that is a response): logged here
            log.exception("a replica failed on %s", path)
            return _error(path, 500, "the replica failed on this request; see the Serve logs")
        stream = dict(start.headers).get(b"content-type", b"").startswith(b"text/event-stream")
        return StreamingResponse(
            _relay(chunks, path, stream), status_code=start.status, headers=_headers(start.headers)
        )


async def _relay(chunks: Any, path: str, stream: bool) -> AsyncIterator[bytes]:
    """The replica's chunks; if the replica dies mid-stream, an error event (an SSE stream) or nothing more."""
    try:
        async for chunk in chunks:
            yield chunk
    except (RayActorError, ActorUnavailableError) as e:
        log.warning("a replica died mid-response on %s: %s", path, e)
        if stream:
            yield _sse_error(path, 503, _replica_lost(e))
    finally:
        chunks.cancel()  # a no-op once it has ended; the client gone: the replica's request ends too


def _replica_lost(e: Exception) -> str:
    return (
        f"the replica serving this request stopped ({type(e).__name__}); Ray Serve is replacing it: retry the request"
    )


def _error(path: str, status: int, message: str) -> Response:
    error = APIError(status, message, type="server_error")
    body = error.anthropic_body() if path.startswith("/v1/messages") else error.body()
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _sse_error(path: str, status: int, message: str) -> bytes:
    error = APIError(status, message, type="server_error")
    if path.startswith("/v1/messages"):
        return sse(error.anthropic_body(), "error")
    return sse(error.body()) + b"data: [DONE]\n\n"


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    skip = {b"content-length", b"transfer-encoding", b"connection"}
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw if k.lower() not in skip}


def app(args: dict[str, Any]) -> Any:
    """The application builder ``serve run leat_ray:app`` uses (a config file's ``deployments:`` then apply)."""
    return build(args)


def build(args: dict[str, Any], deployments: dict[str, dict[str, Any]] | None = None) -> Any:
    """The ingress bound to the replica deployment, whose router is leat's prefix-affinity router, each with
    ``deployments[name]``'s options (``num_replicas``, ``ray_actor_options``, ``autoscaling_config``, ...) over
    leat's defaults. ``args`` are checked here, before Ray deploys anything (:func:`leat_ray.config.parse_args`)."""
    parsed = parse_args(args)
    s, given = parsed.serve, deployments or {}
    router = RequestRouterConfig(
        request_router_class="leat_ray.router:PrefixAffinityRouter",
        request_router_kwargs={"imbalance": parsed.routing.imbalance},
    )
    replica_defaults = {
        "max_ongoing_requests": s.batch_size + s.max_queue,
        "request_router_config": router,
        "health_check_period_s": 5,
    }
    replicas = serve.deployment(LeatReplica, name="LeatReplica", **replica_defaults)
    ingress = serve.deployment(LeatIngress, name="LeatIngress", max_ongoing_requests=4096)
    replicas = replicas.options(**given.get("LeatReplica", {}))
    ingress = ingress.options(**given.get("LeatIngress", {}))
    return ingress.bind(replicas.bind(args), args)
