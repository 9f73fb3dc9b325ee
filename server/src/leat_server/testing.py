"""Start ``leat serve`` as a real process on a free loopback port, for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self


def greedy_text(model: str | Path, prompt: str | list[int], max_tokens: int) -> str:
    """What ``model`` answers to ``prompt`` greedily on the CPU in this process: the text a server must equal."""
    import leat

    loaded = leat.load(str(model), backend="cpu", precision="f32")
    return "".join(t.text for t in loaded.generate(prompt, max_tokens=max_tokens, sampling={"temperature": 0}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``leat serve MODEL ARGS`` on 127.0.0.1; ``url`` once /health answers. Use as a context manager."""

    def __init__(self, model: str | Path, args: list[str] = (), env: dict[str, str] | None = None, timeout: float = 60):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"leat-serve-{self.port}.log"
        command = [sys.executable, "-m", "leat", "serve", str(model), "--port", str(self.port), *args]
        self._log_file = open(self.log, "w")  # noqa: SIM115 (open for the life of the process)
        self.process = subprocess.Popen(
            command, stdout=self._log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"leat serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"leat serve did not answer within {timeout} s:\n{self.output()}") from None
                time.sleep(0.1)

    def output(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
