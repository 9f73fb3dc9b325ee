"""Where ``leat serve``'s start-up time went: the processes stamp their steps (``time.time()``, comparable across
processes), and once every API process serves, the server prints one line with the total since the command started
and its parts, e.g. ``leat: ready in 2.41 s (start 0.35 s, model 1.31 s, engine 0.05 s, API workers 0.70 s after
it: their start 0.00 s, connect 0.00 s, app 0.08 s, warm-up 0.45 s; API workers' start 1.20 s, overlapped with the
load)``."""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from leat.errors import LeatError


def listening_socket(host: str, port: int, listen: bool = True) -> socket.socket:
    """The server's socket, bound to ``host:port`` before the model loads, so that a port in use or a wrong host is a
    clear error at once (not a traceback, or a log line after a long load). ``listen=False`` leaves connections
    refused until uvicorn listens on it, once the model has loaded (one process; API processes accept while it loads).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own: restarts bind at once
        sock.bind((host, port))
        if listen:
            sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        hint = {
            errno.EADDRINUSE: ": another program (or leat serve) is listening there; pick another --port",
            errno.EACCES: ": ports below 1024 need privileges; pick another --port",
            errno.EADDRNOTAVAIL: ": --host must be an address of this machine (0.0.0.0: all of them)",
        }.get(e.errno, "")
        raise LeatError(f"cannot serve on {where}: {e.strerror or e}{hint}") from None
    # accepted connections inherit it; asyncio sets it only on sockets it made, so without it Nagle's algorithm and
    # delayed acknowledgements hold each response ~40 ms
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def process_start(default: float) -> float:
    """When this process started, on ``time.time()``'s clock: from /proc where there is one (the interpreter's own
    start-up and imports count), else ``default``."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default
    now = time.time()
    return min(now, now - uptime + ticks / os.sysconf("SC_CLK_TCK"))


def _parts(parts: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {max(seconds, 0.0):.2f} s" for name, seconds in parts)  # clocks a few ms apart


def one_process_line(start: float, marks: dict[str, float]) -> str:
    """``leat serve --api-workers 0``: ``marks`` has when the load began, ended, the app was built and it served."""
    parts = [
        ("start", marks["loading"] - start),
        ("model", marks["loaded"] - marks["loading"]),
        ("app", marks["built"] - marks["loaded"]),
        ("warm-up", marks["ready"] - marks["built"]),
    ]
    return f"leat: ready in {marks['ready'] - start:.2f} s ({_parts(parts)})"


def processes_line(start: float, engine: dict[str, float], frontends: list[dict[str, float]]) -> str:
    """``--api-workers N``: ``engine``'s marks (entered, loaded, ready) and each API process's (entered, prepared:
    imports, tokenizer and a first build of the app done, connected, built, ready); the line follows the last API
    process to serve. What the API processes did after the engine was ready: the rest of their own start, waiting
    to connect, building the app, and the warm-up before they serve."""
    last = max(frontends, key=lambda marks: marks["ready"])
    prepared = max(last["prepared"], engine["ready"])
    parts = [
        ("start", engine["entered"] - start),
        ("model", engine["loaded"] - engine["entered"]),
        ("engine", engine["ready"] - engine["loaded"]),
    ]
    after = [
        ("their start", prepared - engine["ready"]),
        ("connect", last["connected"] - prepared),
        ("app", last["built"] - last["connected"]),
        ("warm-up", last["ready"] - last["built"]),
    ]
    overlapped = max(marks["prepared"] - marks["entered"] for marks in frontends)
    return (
        f"leat: ready in {last['ready'] - start:.2f} s ({_parts(parts)}, API workers "
        f"{last['ready'] - engine['ready']:.2f} s after it: {_parts(after)}; API workers' start {overlapped:.2f} s, "
        "overlapped with the load)"
    )


class Server(uvicorn.Server):
    """uvicorn's server, calling ``ready()`` once it serves (its lifespan start-up, the app's warm-up, is done)."""

    def __init__(self, config: uvicorn.Config, ready: Callable[[], Any]):
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready()
