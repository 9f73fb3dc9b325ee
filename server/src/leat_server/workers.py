"""Blocking work off the event loop: decoding bodies, rendering chat templates, tokenizing, compiling constraints and
the engine's session calls (which wait for its lock) run on a few worker threads, so /health and every stream keep
being served while they run.

The threads are daemons: a render stuck in C code past its budget cannot keep the process from exiting on SIGTERM.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any


class Workers:
    def __init__(self, count: int = 4):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._work, name=f"leat-worker-{i}", daemon=True).start()

    async def run(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on a worker thread; its result or exception, here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, function, args))
        return await future

    def _work(self) -> None:
        while True:
            loop, future, function, args = self._jobs.get()
            result, error = None, None
            try:
                result = function(*args)
            except Exception as e:  # noqa: BLE001 (handed to the waiting request, which raises it)
                error = e
            except BaseException as e:  # noqa: BLE001 (the thread goes on; the request gets an ordinary error)
                error = RuntimeError(f"worker interrupted by {type(e).__name__}")
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                pass  # the loop is closed: the server is shutting down


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the request went away (client disconnected) while this ran
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
