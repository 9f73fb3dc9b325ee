"""A line per request at info level, with its timings: ``127.0.0.1 POST /v1/chat/completions 200 in 845 ms
(first byte 12 ms, 2310 bytes; sent at 2 ms, accepted at 3 ms, first token 9 ms after)``. The first byte of a
streamed answer is when its first event left; a generation also says when its job went to the engine (after the body
was read, decoded, templated and tokenized), when the engine accepted it, and how long the engine took from then to
its first token (its queue and prefill), so a slow first byte shows whose it was."""

from __future__ import annotations

import logging
import time
from typing import Any

# uvicorn's own logger: it has a handler and follows --log-level
log = logging.getLogger("uvicorn.error")


def request_log(app: Any) -> Any:
    """ASGI middleware (Litestar's ``middleware=``) that logs each HTTP request as it ends."""

    async def logged(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await app(scope, receive, send)
            return
        start = time.perf_counter()
        seen: dict[str, Any] = {"status": None, "first": None, "bytes": 0}

        async def watch(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and message.get("body"):
                seen["first"] = seen["first"] or time.perf_counter()
                seen["bytes"] += len(message["body"])
            await send(message)

        try:
            await app(scope, receive, watch)
        finally:
            end = time.perf_counter()
            client = (scope.get("client") or ("-",))[0]
            first = f"first byte {1000 * (seen['first'] - start):.0f} ms, " if seen["first"] else ""
            log.info(
                "%s %s %s %s in %.0f ms (%s%d bytes%s)",
                client,
                scope["method"],
                scope["path"],
                seen["status"] or "-",
                1000 * (end - start),
                first,
                seen["bytes"],
                _engine_part(scope.get("leat.job"), start),
            )

    return logged


def _engine_part(job: Any, start: float) -> str:
    """When the request's job went to the engine and when the engine accepted it, and its first token after that
    (the engine's own count)."""
    if getattr(job, "accepted", None) is None:
        return ""
    ttft = job.result.timings.get("ttft_seconds")
    after = f", first token {1000 * ttft:.0f} ms after" if ttft is not None else ""
    sent = f"sent at {1000 * (job.submitted - start):.0f} ms, " if getattr(job, "submitted", None) else ""
    return f"; {sent}accepted at {1000 * (job.accepted - start):.0f} ms{after}"
