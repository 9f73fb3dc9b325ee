"""scripts/vs_llamacpp.py: leat bench beside llama-bench and llama-batched-bench, matched test by test.

llama.cpp's outputs here were recorded from its tools (built from the llama-cpp-python 0.3.36 sdist's vendored tree,
CPU) on a tiny Llama file: ``llama-bench -p 8 -n 4 -r 2 -o json -ngl 0`` and ``llama-batched-bench -npp 8 -ntg 4
-npl 1,2 --output-format jsonl -ngl 0``. The end-to-end test runs leat for real (CPU backend) and stands in for the
two tools with scripts that print those recordings and keep their arguments.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "vs_llamacpp.py"
RECORDED = ROOT / "tests" / "references" / "llamacpp_bench"


@pytest.fixture(scope="module")
def script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vs_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded():
    bench = json.loads((RECORDED / "llama-bench.json").read_text())
    batched = [json.loads(line) for line in (RECORDED / "llama-batched-bench.jsonl").read_text().splitlines()]
    return bench, batched


def test_tests_pair_by_name_with_leats_mean_over_llamacpps(script):
    bench, batched = _recorded()
    leat = [
        {"test": "pp8", "tokens_per_second": 1000.0, "stdev": 5.0},
        {"test": "tg4", "tokens_per_second": 919.3021197, "stdev": 0.0},
        {"test": "tg4 x2", "tokens_per_second": 61302.68, "stdev": 1.0},
        {"test": "tg4 x8", "tokens_per_second": 1.0, "stdev": 0.0},  # llama.cpp did not run it: no row
    ]
    rows = script.pairs(leat, bench, batched)
    assert [r["test"] for r in rows] == ["pp8", "tg4", "tg4 x2"]
    # llama-bench's avg_ts (the pp row has n_gen 0, the tg row n_prompt 0); llama-batched-bench's speed_tg at pl = 2
    assert [r["llama.cpp"] for r in rows] == [58041.835094, 18386.042394, 30651.339844]
    assert [r["ratio"] for r in rows] == pytest.approx([1000 / 58041.835094, 0.05, 2.0], rel=1e-6)
    # the batched row also beside llama.cpp's generated tokens over its whole run: 2 x 4 / 0.000561 s
    assert "llama.cpp_with_prompts" not in rows[0]
    assert rows[2]["llama.cpp_with_prompts"] == pytest.approx(8 / 0.000561)
    assert rows[2]["ratio_with_prompts"] == pytest.approx(61302.68 * 0.000561 / 8)
    table = script.table(rows).splitlines()
    assert table[2] == "| pp8 | 1,000.0 ± 5.0 | 58,041.8 | 0.02x |  |  |"
    assert table[4] == "| tg4 x2 | 61,302.7 ± 1.0 | 30,651.3 | 2.00x | 14,260.2 | 4.30x |"


def test_tests_at_depth_pair_with_llama_benchs_rows_at_that_depth(script):
    """With --depth, llama-bench's rows carry n_depth and leat bench names its tests ``pp8 @ d16``: they pair by that
    name, and a depth-0 row of one side does not pair with the other side's row at depth."""
    bench, batched = _recorded()
    deep = [dict(row, n_depth=16, avg_ts=row["avg_ts"] / 2) for row in bench]
    leat = [
        {"test": "pp8 @ d16", "tokens_per_second": 1000.0, "stdev": 5.0},
        {"test": "tg4 @ d16", "tokens_per_second": 919.3021197, "stdev": 0.0},
        {"test": "tg4", "tokens_per_second": 1.0, "stdev": 0.0},  # llama.cpp ran tg4 only at depth 16: no row
    ]
    rows = script.pairs(leat, deep, batched)
    assert [r["test"] for r in rows] == ["pp8 @ d16", "tg4 @ d16"]
    assert [r["llama.cpp"] for r in rows] == [58041.835094 / 2, 18386.042394 / 2]


def test_batched_decode_after_longer_prompts_pairs_too(script):
    """The script's default --batch-prompt 128: leat names the test ``pp128+tg4 x2``, llama-batched-bench's line
    says pp 128; the two are one row (they were not, and the table lost every batched figure)."""
    bench, batched = _recorded()
    longer = [row | {"pp": 128} for row in batched]
    leat = [{"test": "pp128+tg4 x2", "tokens_per_second": 61302.68, "stdev": 1.0}]
    rows = script.pairs(leat, bench, longer)
    assert [(r["test"], r["llama.cpp"]) for r in rows] == [("pp128+tg4 x2", 30651.339844)]


FAKE = """\
#!{python}
import json, sys
from pathlib import Path
calls = Path({calls!r})
with calls.open("a") as log:
    log.write(json.dumps([Path(sys.argv[0]).name, *sys.argv[1:]]) + "\\n")
recorded = Path({recorded!r})
if sys.argv[0].endswith("llama-bench"):
    print((recorded / "llama-bench.json").read_text())
else:
    runs = sum(1 for line in calls.read_text().splitlines() if "llama-batched-bench" in line)
    if runs > 1:  # the first run's lines are lost, as llama.cpp's asynchronous logger may lose them at exit
        wanted = [int(c) for c in sys.argv[sys.argv.index("-npl") + 1].split(",")]
        for line in (recorded / "llama-batched-bench.jsonl").read_text().splitlines():
            if json.loads(line)["pl"] in wanted:
                print(line)
"""


def test_one_run_beside_llamacpps_tools_with_matched_settings(tmp_path):
    from leat.testing import write_tiny_gguf

    llama = pytest.importorskip("leat_arch_llama.llama")
    model = write_tiny_gguf(llama.Llama, tmp_path / "tiny.gguf")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    for name in ("llama-bench", "llama-batched-bench"):
        tool = bin_dir / name
        tool.write_text(FAKE.format(python=sys.executable, calls=str(calls), recorded=str(RECORDED)))
        tool.chmod(0o755)
    out = tmp_path / "out.json"
    command = [sys.executable, str(SCRIPT), str(model), "--llama-bin", str(bin_dir), "--backend", "cpu"]
    command += [
        "--pp",
        "8",
        "--tg",
        "4",
        "--reps",
        "1",
        "--concurrency",
        "1,2",
        "--batch-prompt",
        "8",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rounds"][0]["rows"]
    assert [r["test"] for r in rows] == ["pp8", "tg4", "tg4 x1", "tg4 x2"]
    bench, batched = _recorded()
    want = [bench[0]["avg_ts"], bench[1]["avg_ts"], batched[0]["speed_tg"], batched[1]["speed_tg"]]
    assert [r["llama.cpp"] for r in rows] == want
    assert all(r["leat"] > 0 and r["ratio"] == pytest.approx(r["leat"] / r["llama.cpp"]) for r in rows)
    assert all(r["leat_rates"] == [pytest.approx(r["leat"])] for r in rows)  # one run each: its rate is the mean
    assert "| tg4 x2 |" in done.stdout
    # the tools got the settings leat ran with: llama-bench the same tests and runs on the CPU; llama-batched-bench
    # 8-token prompts, 4 tokens a sequence, room for 2 sequences, and a second run for the counts it lost
    tools = [json.loads(line) for line in calls.read_text().splitlines()]
    assert [t[0] for t in tools] == ["llama-bench", "llama-batched-bench", "llama-batched-bench"]
    assert tools[0][1:] == ["-m", str(model), "-p", "8", "-n", "4", "-r", "1", "-o", "json", "-ngl", "0"]
    first, second = tools[1][1:], tools[2][1:]
    assert first[first.index("-npp") + 1] == "8" and first[first.index("-ntg") + 1] == "4"
    assert int(first[first.index("-c") + 1]) >= 2 * (8 + 4)
    assert first[first.index("-npl") + 1] == "1,2" and second[second.index("-npl") + 1] == "1,2"
    assert "-ngl" in first and first[first.index("-ngl") + 1] == "0"


def test_the_leat_version_says_when_the_checkout_is_not_its_commit(script, tmp_path, monkeypatch):
    """A device machine runs a copy of the working tree beside a git directory that may be older: the version names
    the commit and, where the tracked files differ from it, says so (a run there once printed a commit it did not
    run)."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f.txt").write_text("a")
    subprocess.run([*git, "-C", str(tmp_path), "add", "f.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "one"], check=True)
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    )
    monkeypatch.chdir(tmp_path)
    assert script.leat_version() == head.stdout.strip()
    (tmp_path / "f.txt").write_text("b")
    assert script.leat_version() == head.stdout.strip() + "-dirty"
