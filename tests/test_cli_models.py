"""`leat list`, `rm`, `show`, `ps`, the progress lines of long jobs, and `leat serve`'s request log."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from leat.cli import cli
from leat.cli_progress import plain_lines
from leat.testing import write_tiny_gguf

llama = pytest.importorskip("leat_arch_llama.llama")
pytest.importorskip("leat_backend_cpu")


@pytest.fixture
def home(tmp_path, monkeypatch, leat_home):
    monkeypatch.setenv("LEAT_HOME", str(leat_home(tmp_path / "home")))
    return tmp_path / "home"


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_gguf(llama.Llama, tmp_path / "tiny-Q8_0.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)


def place_pulled(home: Path, source: Path) -> Path:
    """A model in the cache as `leat pull` leaves it (the layout leat.pull documents): a directory per package
    holding the GGUF file and its manifest."""
    directory = home / "models" / "llm-tiny"
    directory.mkdir(parents=True)
    target = directory / source.name
    target.write_bytes(source.read_bytes())
    size = target.stat().st_size
    manifest = {
        "name": "tiny",
        "package": "llm-tiny",
        "version": "1.0",
        "source": "pypi:llm-tiny==1.0",
        "size": size,
        "primary": target.name,
        "files": [{"name": target.name, "sha256": "", "size": size}],
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_list_is_a_table_with_human_sizes_and_json(home, tiny):
    runner = CliRunner()
    empty = runner.invoke(cli, ["list"])
    assert empty.exit_code == 0 and empty.stdout == "" and "no pulled models" in empty.stderr
    path = place_pulled(home, tiny)
    table = runner.invoke(cli, ["list"])
    assert table.exit_code == 0, table.output
    head, row = table.stdout.splitlines()
    assert head.split() == ["NAME", "SIZE", "SOURCE", "MODIFIED"]
    size_kib = path.stat().st_size / 1024
    assert row.split()[:4] == ["tiny-Q8_0", f"{size_kib:.1f}", "KiB", "pypi:llm-tiny==1.0"]
    rows = json.loads(runner.invoke(cli, ["list", "--json"]).stdout)
    assert [(r["model"], r["name"], r["size"], r["path"]) for r in rows] == [
        ("tiny-Q8_0", "tiny", path.stat().st_size, str(path))
    ]


def test_rm_removes_a_pulled_model_and_refuses_what_is_missing_or_served(home, tiny):
    from leat.cli_models import running_server

    path = place_pulled(home, tiny)
    runner = CliRunner()
    with running_server({"model": "tiny-Q8_0", "path": str(path), "address": "http://127.0.0.1:1", "size": 1}):
        served = runner.invoke(cli, ["rm", "tiny-Q8_0"], standalone_mode=False)
        assert "served by process" in str(served.exception) and path.exists()
    removed = runner.invoke(cli, ["rm", "tiny-Q8_0"])
    assert removed.exit_code == 0 and removed.stdout.startswith("removed tiny-Q8_0 (")
    assert not path.parent.exists()
    again = runner.invoke(cli, ["rm", "tiny-Q8_0"], standalone_mode=False)
    assert "tiny-Q8_0" in str(again.exception)


def test_show_reports_the_quant_mix_metadata_and_template(tiny):
    reader = gguf.GGUFReader(tiny)
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        counts[name] = counts.get(name, 0) + 1
        sizes[name] = sizes.get(name, 0) + int(t.n_bytes)
    result = CliRunner().invoke(cli, ["show", str(tiny), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["model"] == "tiny-Q8_0" and shown["architecture"] == "llama"
    assert {q["type"]: q["tensors"] for q in shown["quant_mix"]} == counts
    assert {q["type"]: q["bytes"] for q in shown["quant_mix"]} == sizes
    assert set(counts) == {"F32", "Q8_0"}
    assert shown["metadata"]["general.name"] == reader.fields["general.name"].contents()
    text = CliRunner().invoke(cli, ["show", str(tiny)]).stdout
    assert re.search(r"^Q8_0\s+\d+\s+[\d.]+ KiB\s+[\d.]+%$", text, re.MULTILINE), text
    template = CliRunner().invoke(cli, ["show", "-m", str(tiny), "--template"]).stdout
    assert template.strip() and template.strip() == shown["chat_template"].strip()


def test_pull_progress_is_plain_lines_when_not_a_terminal(capsys):
    now = [0.0]
    update = plain_lines(every=5.0, clock=lambda: now[0])
    for t, done in ((0, 0), (1, 2**20), (6, 3 * 2**20), (7, 4 * 2**20), (7.5, 4 * 2**20)):
        now[0] = t
        update(done, 4 * 2**20, "download x.whl")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "download x.whl: 0.0 MiB of 4.0 MiB (0%)",
        "download x.whl: 3.0 MiB of 4.0 MiB (75%)",
        "download x.whl: 4.0 MiB of 4.0 MiB (100%)",
    ]


def test_bench_prints_each_test_as_it_runs(tiny):
    args = ["bench", str(tiny), "-p", "8", "-n", "4", "--concurrency", "", "-r", "1", "--json", "--backend", "cpu"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.startswith("bench: ")]
    assert lines[0] == "bench: pp8 (1/2): 1 runs after a warm-up" and lines[2].startswith("bench: tg4 (2/2)")
    assert lines[1] == f"bench: pp8 (1/2): {rows[0]['tokens_per_second']:.2f} t/s"
    assert lines[3] == f"bench: tg4 (2/2): {rows[1]['tokens_per_second']:.2f} t/s"


def test_perplexity_prints_each_chunk(tiny, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    args = ["perplexity", str(tiny), "-f", str(text), "-c", "32", "--chunks", "3", "--json", "--backend", "cpu"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    final = json.loads(result.stdout)
    lines = [line for line in result.stderr.splitlines() if line.startswith("perplexity: chunk")]
    assert [line.split(",")[0] for line in lines] == [f"perplexity: chunk {i}/3" for i in (1, 2, 3)]
    running = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert running == pytest.approx([round(p, 4) for p in final["running_perplexity"]], abs=1e-4)
    assert running[-1] == pytest.approx(final["perplexity"], abs=1e-4)


def test_serve_logs_loading_and_each_request_and_is_listed_by_ps(home, tiny):
    from leat_server.testing import ServerProcess

    pytest.importorskip("leat_server")
    with ServerProcess(tiny, ["--backend", "cpu", "--batch-size", "1"], env={"LEAT_HOME": str(home)}) as server:
        ps = json.loads(CliRunner().invoke(cli, ["ps", "--json"]).stdout)
        assert [(p["model"], p["address"], p["path"]) for p in ps] == [("tiny-Q8_0", server.url, str(tiny))]
        assert CliRunner().invoke(cli, ["ps"]).stdout.splitlines()[1].split()[:2] == ["tiny-Q8_0", server.url]
        body = json.dumps({"model": "tiny-Q8_0", "prompt": "hello", "max_tokens": 3}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = response.read()
        deadline = time.monotonic() + 10  # the line is written as the response ends, just after the client has it
        while "POST /v1/completions" not in (log := server.output()) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert json.loads(answer)["model"] == "tiny-Q8_0"
    assert re.search(r"leat: loading \S*tiny-Q8_0\.gguf", log) and "leat: loaded tiny-Q8_0 on cpu (f32) in" in log
    logged = re.search(
        r"POST /v1/completions 200 in (\d+) ms \(first byte (\d+) ms, (\d+) bytes; "
        r"sent at (\d+) ms, accepted at (\d+) ms, first token (\d+) ms after\)",
        log,
    )
    assert logged, log
    total, first, size, sent, accepted, engine = (int(g) for g in logged.groups())
    # the engine counts its first token from its own queueing, between `sent` and `accepted` (its submit call
    # returns after it: a clean-clone CI run under load logged accepted 25 ms, first token 6 ms after, total 28)
    assert size == len(answer) and sent <= accepted <= first <= total and sent + engine <= total + 1
    assert json.loads(CliRunner().invoke(cli, ["ps", "--json"]).stdout) == []


def test_llama_server_key_file_format(tmp_path):
    from leat.errors import LeatError
    from leat.keys import KeyStore

    path = tmp_path / "keys.txt"
    path.write_text("first-key\n\nsecond-key\n")
    store = KeyStore(path)
    assert store.check("second-key") == "line 2" and store.check("first-key") == "line 1"
    assert store.check("third-key") is None and store.check("first-key\nsecond-key") is None
    with pytest.raises(LeatError, match="one per line"):
        store.add("more")
    assert path.read_text() == "first-key\n\nsecond-key\n"


def test_serve_api_key_is_required_of_clients(home, tiny):
    from leat_server.testing import ServerProcess

    def status(server: ServerProcess, key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(server.url + "/v1/models", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code

    args = ["--backend", "cpu", "--api-key", "sk-one", "--api-key", "sk-two"]
    with ServerProcess(tiny, args, env={"LEAT_HOME": str(home)}) as server:
        assert [status(server, key) for key in (None, "sk-three", "sk-one", "sk-two")] == [401, 401, 200, 200]


def test_doctor_says_which_extra_to_install(monkeypatch):
    from leat.doctor import install_hints

    monkeypatch.setenv("CC", "no-such-compiler-here")
    cuda, tinygrad = install_hints({"cpu": {}}, nvidia_driver=True)
    assert "leat-backend-cuda" in cuda and "uv sync --extra cuda" in cuda
    assert "uv sync --extra tinygrad" in tinygrad and "needs clang" in tinygrad
    assert not any("cuda" in hint for hint in install_hints({"cpu": {}}, nvidia_driver=False))
    assert install_hints({"cpu": {}, "cuda": {}, "tinygrad": {}}, nvidia_driver=True) == []
    monkeypatch.setenv("CC", "sh")  # a command that exists: no clang note
    assert "clang" not in install_hints({"cpu": {}, "cuda": {}}, nvidia_driver=False)[0]
    report = json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).stdout)
    assert report["machine"]["install"] == install_hints(
        report["machine"]["backends"], report["machine"]["nvidia_driver"]
    )


def test_doctor_states_the_cpu_backends_weights_as_loading_counts_them(tiny):
    """Q8_0 matrices and float32 norms: the figure ``leat doctor`` gives before loading is what the cpu backend
    counts once it has uploaded every tensor (the matrices as stored, so less than float32 copies)."""
    import leat

    report = json.loads(CliRunner().invoke(cli, ["doctor", "-m", str(tiny), "--json"]).stdout)
    model = leat.load(str(tiny), backend="cpu")
    assert report["model"]["backend_weight_bytes"]["cpu"] == model.backend.allocations.weights
    assert model.backend.allocations.weights < sum(4 * int(np.prod(t.shape)) for t in model.file.tensors.values())
