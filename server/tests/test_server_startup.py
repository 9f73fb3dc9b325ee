"""`leat serve` says when it is ready and where its start-up time went, in one process and with API processes."""

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server import testing
from leat_server.startup import processes_line
from leat_server.testing import ServerProcess, free_port

READY = re.compile(r"^leat: ready in (\d+\.\d\d) s \((.+)\)$", re.MULTILINE)
PART = re.compile(r"([A-Za-z' -]+?) (\d+\.\d\d) s")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_tiny_gguf(Llama, tmp_path_factory.mktemp("startup") / "tiny.gguf", params=Llama.tiny(context=256))


def ready_line(server: ServerProcess) -> re.Match:
    """The ready line, which comes once every API process serves (/health answers with the first)."""
    deadline = time.monotonic() + 30
    while (found := READY.search(server.output())) is None:
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.05)
    return found


def parts(text: str) -> dict[str, float]:
    """``name N.NN s`` pieces of the line's parenthesis, by name (``after it:`` and ``;`` start new names)."""
    return {name.split(":")[-1].strip(): float(value) for name, value in PART.findall(text.replace(";", ","))}


@pytest.mark.parametrize("workers", [0, 2])
def test_serve_prints_when_it_is_ready_and_where_the_time_went(model_path, workers):
    args = ["--backend", "cpu", "--batch-size", "2", "--api-workers", str(workers)]
    with ServerProcess(model_path, args, timeout=120) as server:
        found = ready_line(server)
    total, named = float(found.group(1)), parts(found.group(2))
    path = ["start", "model", "app", "warm-up"] + (["engine", "their start", "connect"] if workers else [])
    assert set(path) <= set(named), found.group(0)
    assert all(seconds >= 0 for seconds in named.values())
    # the parts on the way to the first request add up to the total (each rounded to 10 ms)
    assert abs(sum(named[name] for name in path) - total) <= 0.01 * len(path), found.group(0)


def test_the_line_follows_the_last_api_process_and_the_engine():
    engine = {"entered": 100.5, "loaded": 102.0, "ready": 102.25}
    first = {"entered": 100.6, "prepared": 101.5, "connected": 102.3, "built": 102.5, "ready": 102.75}
    last = {"entered": 100.7, "prepared": 102.5, "connected": 102.5, "built": 102.75, "ready": 103.0}
    line = processes_line(100.0, engine, [last, first])
    assert line.startswith("leat: ready in 3.00 s (start 0.50 s, model 1.50 s, engine 0.25 s, API workers 0.75 s")
    named = parts(READY.search(line).group(2))
    assert (named["their start"], named["connect"], named["app"], named["warm-up"]) == (0.25, 0.0, 0.25, 0.25)
    assert named["API workers' start"] == 1.8  # the slower one's, though it was not the last


class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("workers", "answers"), [(0, True), (0, False), (2, False)])
def test_a_port_taken_before_the_server_binds_it_is_given_up_for_another(model_path, monkeypatch, workers, answers):
    """A port found free can be taken before ``leat serve`` binds it: by a server whose /health answers (the test
    would have taken it for this one's) or by any socket, which the server's bind then fails on with a clear error.
    Either way the test server starts again on another port."""
    other = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), Healthy if answers else http.server.BaseHTTPRequestHandler
    )
    threading.Thread(target=other.serve_forever, daemon=True).start()
    taken = other.server_address[1]
    ports = [taken]
    monkeypatch.setattr(testing, "free_port", lambda: ports.pop() if ports else free_port())
    try:
        with ServerProcess(model_path, ["--backend", "cpu", "--api-workers", str(workers)], timeout=120) as server:
            assert ports == [] and server.port != taken
            assert testing._listens(server.process.pid, server.port) and not testing._listens(server.process.pid, taken)
            assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        other.shutdown()
        other.server_close()


def test_listens_tells_a_process_own_port_from_anothers_while_its_fds_change(monkeypatch):
    """_listens (ServerProcess's check that the server answering /health is the one it started) says True for a port
    this process listens on and False for one another process listens on, also while fds close under it (a starting
    server's do; an fd gone between the listing and its readlink once made it answer True for anything), and False
    for a process that is gone."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc")
    listen = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()"
    child = subprocess.Popen(
        [sys.executable, "-c", f"{listen}; print(s.getsockname()[1], flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        theirs = int(child.stdout.readline())
        with socket.socket() as own:
            own.bind(("127.0.0.1", 0))
            own.listen()
            mine = own.getsockname()[1]
            assert testing._listens(os.getpid(), mine) and not testing._listens(os.getpid(), theirs)
            readlink, fds = os.readlink, sorted(os.listdir("/proc/self/fd"), key=int)

            def closing(path, *args, **kwargs):  # the first two fds closed after the listing
                if path.rsplit("/", 1)[-1] in fds[:2]:
                    raise FileNotFoundError(path)
                return readlink(path, *args, **kwargs)

            monkeypatch.setattr(os, "readlink", closing)
            assert testing._listens(os.getpid(), mine) and not testing._listens(os.getpid(), theirs)
    finally:
        child.kill()
        child.wait()
    assert not testing._listens(child.pid, theirs)


def test_a_port_in_use_is_a_clear_error_before_the_model_loads(model_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        for workers in (0, 2):
            args = ["serve", str(model_path), "--port", str(port), "--backend", "cpu", "--api-workers", str(workers)]
            command = [sys.executable, "-m", "leat", *args]
            done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
            assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
            assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in done.stderr
            assert "pick another --port" in done.stderr and "leat: serving" not in done.stdout  # before the load
