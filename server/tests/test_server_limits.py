"""What ``leat serve`` refuses: a remote bind without keys, and work beyond its free slots and queue (429 with
Retry-After)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_server.testing import ServerProcess


def test_remote_bind_without_keys_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "leat", "serve", str(tmp_path / "never-loaded.gguf"), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env={"LEAT_HOME": str(tmp_path), "PATH": ""},
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "leat keys add" in result.stderr and "0.0.0.0" in result.stderr


@pytest.fixture(scope="module")
def full_server(leat_home):
    home = leat_home()
    model = write_tiny_gguf(Llama, home / "tiny.gguf", params=Llama.tiny(context=1024))
    # One slot and no room to wait: while a request runs, every other one is refused at once.
    args = ["--backend", "cpu", "--batch-size", "1", "--max-queue", "0"]
    with ServerProcess(model, args, env={"LEAT_HOME": str(home)}) as proc:
        yield proc


def test_overload_is_429_with_retry_after(full_server):
    held = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", full_server.url + "/v1/completions", json=held, timeout=60) as running:
        assert running.status_code == 200  # a free slot takes it, --max-queue 0 or not
        lines = running.iter_lines()  # kept: letting it go closes the stream, which cancels the request
        next(lines)
        r = httpx.post(full_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "overloaded"
        client = openai.OpenAI(base_url=full_server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert full_server.process.poll() is None
