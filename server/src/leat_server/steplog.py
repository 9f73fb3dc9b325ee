"""``leat serve --step-log FILE``: a JSON line per engine step, for finding where a request's time went.

Each line is one :class:`~leat.engine.StepProfile`: ``time`` (when the step began, Unix seconds), ``rows``,
``tokens``, ``prompt_tokens`` (of those, prompt chunks), and the step's ``prepare`` / ``wait`` / ``finish`` /
``device`` seconds. A thread appends what the engine recorded twice a second, so the engine's step never writes a
file, and a process ended by a signal loses at most the last half second."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from typing import Any

INTERVAL = 0.5  # seconds between writes


class StepLog:
    def __init__(self, engine: Any, path: str):
        self.engine, self.path = engine, path
        self.origin = time.time() - time.perf_counter()  # perf_counter -> Unix seconds
        open(path, "a").close()  # a path that cannot be written fails here, at start-up, not in the thread

    def start(self) -> None:
        threading.Thread(target=self._run, name="leat-step-log", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(INTERVAL)
            self.write()

    def write(self) -> None:
        """Append the steps recorded since the last write, and drop them from the engine's list."""
        profile = self.engine.profile
        count = len(profile)
        if not count:
            return
        steps, lines = profile[:count], []
        del profile[:count]  # the engine only appends: what it added meanwhile stays for the next write
        for step in steps:
            entry = asdict(step)
            entry["time"] = round(self.origin + entry.pop("at"), 6)
            lines.append(json.dumps(entry))
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
