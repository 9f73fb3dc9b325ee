"""`leat serve` says when it is ready and where its start-up time went, in one process and with API processes."""

import re
import time

import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.startup import processes_line
from leat_server.testing import ServerProcess

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
