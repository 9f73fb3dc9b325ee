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
    rows = json.loads(result.output)
    assert [row["test"] for row in rows] == ["pp16", "pp32", "tg8", "tg8 x1", "tg8 x4"]
    for row in rows:
        assert row["model"] == str(path) and row["architecture"] == "llama" and row["backend"] == "cpu"
        assert row["size"] == path.stat().st_size and row["repetitions"] == 2 and len(row["rates"]) == 2
        assert row["tokens_per_second"] > 0 and row["stdev"] >= 0
    assert rows[0]["n_tokens"] == 16 and rows[-1]["n_tokens"] == 32


def test_bench_table(tmp_path):
    from leat_arch_llama.llama import Llama

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf")
    args = ["bench", str(path), "-p", "8", "-n", "4", "--concurrency", "", "-r", "1", "--backend", "cpu"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == "| model | size | backend | precision | test | t/s |"
    assert [line.split("|")[5].strip() for line in lines[2:]] == ["pp8", "tg4"]
    assert "±" in lines[2]
