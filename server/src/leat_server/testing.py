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


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on ``port`` (from /proc: True where there is none; False
    where the process is gone). A starting server opens and closes files as this reads them: an fd closed between
    the listing and its readlink is skipped, not taken for "no /proc" (which let another process's server on the
    port pass for this one's)."""
    if not os.path.isdir("/proc/self/fd"):
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    held = set()
    for fd in fds:
        try:
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue  # closed meanwhile
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
            listening = [row[9] for row in rows if row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port]
            if any(f"socket:[{inode}]" in held for inode in listening):
                return True
    except (OSError, ValueError, IndexError):
        return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``leat serve MODEL ARGS`` on 127.0.0.1; ``url`` once /health answers. Use as a context manager.

    The port is picked free, then bound by the server a moment later: another process can take it in between (a
    parallel test run's server, a connection's local port). A server that finds it taken exits, and one that answers
    /health there may be the other process's; either way this one starts again on another port."""

    def __init__(self, model: str | Path, args: list[str] = (), env: dict[str, str] | None = None, timeout: float = 60):
        self.arguments = [sys.executable, "-m", "leat", "serve", str(model), "--port"], list(args)
        self.env = {**os.environ, **(env or {})}
        for _ in range(3):
            if self._start(timeout):
                return
            self.stop()
        self._fail("leat serve found its port taken three times")

    def _start(self, timeout: float) -> bool:
        """Start on a free port; True once this process answers /health there, False if the port was taken."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"leat-serve-{self.port}.log"
        command, rest = self.arguments
        self._log_file = open(self.log, "w")  # noqa: SIM115 (open for the life of the process)
        self.process = subprocess.Popen(
            [*command, str(self.port), *rest], stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                if "address already in use" in self.output().lower():
                    return False
                self._fail(f"leat serve exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return _listens(self.process.pid, self.port)
            except OSError:
                if time.monotonic() > deadline:
                    self._fail(f"leat serve did not answer within {timeout} s")
                time.sleep(0.1)

    def _fail(self, why: str) -> None:
        self.stop()
        raise RuntimeError(f"{why}:\n{self.log.read_text(errors='replace')}")

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

    def __exit__(self, kind, *exc) -> None:
        self.stop()
        if kind is not None:  # a failing test shows what the server printed (pytest reports a failure's stdout)
            print(f"--- leat serve's output ({self.log}):\n{self.log.read_text(errors='replace')}")
