"""`leat bench --json` on a tiny random llama file: every test row is there with its fields, and rates are positive."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from leat.cli import cli
from leat.testing import write_tiny_gguf

pytest.importorskip("leat_arch_llama")
pytest.importorskip("leat_backend_cpu")


def test_bench_json(tmp_path):
    from leat_arch_llama.llama import Llama

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf")
    args = [
        "bench",
        str(path),
        "-p",
        "16,32",
        "-n",
        "8",
        "--concurrency",
        "1,4",
        "-r",
        "2",
        "--json",
        "--backend",
        "cpu",
    ]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["test"] for row in rows] == ["pp16", "pp32", "tg8", "tg8 x1", "tg8 x4"]
    for row in rows:
        assert row["model"] == path.stem and row["architecture"] == "llama" and row["backend"] == "cpu"
        assert row["size"] == path.stat().st_size and row["repetitions"] == 2 and len(row["rates"]) == 2
        assert row["tokens_per_second"] > 0 and row["stdev"] >= 0 and row["warmup_seconds"] > 0
    assert rows[0]["n_tokens"] == 16 and rows[-1]["n_tokens"] == 32


def test_bench_table(tmp_path):
    from leat_arch_llama.llama import Llama

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf")
    args = ["bench", str(path), "-p", "8", "-n", "4", "--concurrency", "", "-r", "1", "--backend", "cpu"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "| model | size | backend | precision | kv | test | t/s |"
    assert [line.split("|")[5].strip() for line in lines[2:]] == ["f16", "f16"]  # llama-bench's default cache
    assert [line.split("|")[6].strip() for line in lines[2:]] == ["pp8", "tg4"]
    assert "±" in lines[2]


@pytest.mark.parametrize("speculate", [["--speculate", "ngram"], ["--draft", "DRAFT"]])
def test_bench_speculative_json(tmp_path, speculate):
    from leat_arch_llama.llama import Llama

    pytest.importorskip("leat_speculative")
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", params=Llama.tiny(context=512))
    draft = write_tiny_gguf(Llama, tmp_path / "draft.gguf", params=Llama.tiny(context=512, layers=1), seed=7)
    speculate = [str(draft) if arg == "DRAFT" else arg for arg in speculate]
    args = ["bench", str(path), "-n", "24", "-r", "2", "--workloads", "quote,story", "--json", "--backend", "cpu"]
    result = CliRunner().invoke(cli, args + speculate, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [row["test"] for row in rows] == ["quote tg24", "story tg24"]
    for row in rows:
        assert row["proposer"] == ("ngram" if "ngram" in speculate else "draft") and row["backend"] == "cpu"
        assert row["identical_output"] is True and 2 <= row["n_tokens"] <= 24
        assert len(row["rates"]) == len(row["plain_rates"]) == 2
        assert row["tokens_per_second"] > 0 and row["plain_tokens_per_second"] > 0
        assert row["speedup"] == pytest.approx(row["tokens_per_second"] / row["plain_tokens_per_second"])
        assert 0 <= row["accepted"] <= row["proposed"] and row["verifications"] <= row["proposed"]
        assert 0 <= row["acceptance"] <= 1 and row["tokens_per_verification"] >= 1
        if row["verifications"]:
            steps = (row["accepted"] + row["verifications"]) / row["verifications"]
            assert row["tokens_per_verification"] == pytest.approx(steps)


def test_bench_speculative_table(tmp_path):
    from leat_arch_llama.llama import Llama

    pytest.importorskip("leat_speculative")
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", params=Llama.tiny(context=512))
    args = ["bench", str(path), "--speculate", "ngram", "-n", "16", "-r", "1", "--workloads", "code"]
    result = CliRunner().invoke(cli, args + ["--backend", "cpu"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("| model | size | backend | precision | test | proposer | plain t/s |")
    assert lines[2].split("|")[5].strip() == "code tg16" and lines[2].split("|")[-2].strip() == "yes"
    bad = CliRunner().invoke(cli, args[:-1] + ["poem", "--backend", "cpu"])
    assert bad.exit_code == 2 and "choose from quote, code, story" in bad.output


def test_bench_at_depth(tmp_path, monkeypatch):
    """``-d`` runs each pp and tg test after that many positions of context, as llama-bench's: rows ``pp8 @ d24`` and
    ``tg4 @ d24`` with ``n_depth``; the depth is prefilled once per test (untimed), the timed tokens go at positions
    24 and on. The batched tests run once, at depth 0. A depth past the model's context is a clear error."""
    from leat_arch_llama.llama import Llama
    from leat_backend_cpu.backend import CPUBackend

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf")
    starts: list[tuple[int, int]] = []
    run = CPUBackend.run

    def recorded(self, forward, batch, kv):
        starts.extend((row.start, len(row.tokens)) for row in batch.rows)
        return run(self, forward, batch, kv)

    monkeypatch.setattr(CPUBackend, "run", recorded)
    args = ["bench", str(path), "-p", "8", "-n", "4", "-d", "0,24", "--concurrency", "2", "-r", "2", "--json"]
    result = CliRunner().invoke(cli, [*args, "--backend", "cpu"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(row["test"], row["n_depth"]) for row in rows] == [
        ("pp8", 0),
        ("tg4", 0),
        ("pp8 @ d24", 24),
        ("tg4 @ d24", 24),
        ("tg4 x2", 0),
    ]
    assert all(row["tokens_per_second"] > 0 for row in rows)
    # pp8 (3 runs: a warm-up and 2), tg4 (3 x 4 steps), then the depth's prefill once for each test at depth 24
    assert starts[:15] == [(0, 8)] * 3 + [(p, 1) for _ in range(3) for p in range(4)]
    assert starts[15:19] == [(0, 24), (24, 8), (24, 8), (24, 8)]
    assert starts[19:32] == [(0, 24)] + [(24 + p, 1) for _ in range(3) for p in range(4)]
    long = CliRunner().invoke(cli, ["bench", str(path), "-p", "8", "-n", "0", "-d", "250", "--backend", "cpu"])
    assert "at depth 250 reaches 258: past the context of 256" in str(long.exception)  # main() says it
