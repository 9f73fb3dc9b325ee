"""`leat pull OWNER/NAME[:QUANT]` against a fake Hugging Face hub on 127.0.0.1 (HF_ENDPOINT) serving the routes
huggingface_hub uses: model info with LFS SHA-256 (``?blobs=true``) and ``resolve/REV/FILE`` with Range, ETag and
X-Repo-Commit."""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat import hf, pull
from leat.errors import PullError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def gguf_bytes(tmp_path: Path, seed: int, size: int = 64 * 1024) -> bytes:
    path = tmp_path / f"m{seed}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor(
        "token_embd.weight", np.random.default_rng(seed).standard_normal((size // 32, 8)).astype(np.float32)
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


class Hub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos: dict[str, dict[str, bytes]] = {}
        self.corrupt: set[str] = set()  # files served with one byte changed
        self.drop_once: set[str] = set()  # files whose first GET stops halfway
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class HubHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Hub

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.handle_request(body=False)

    def do_GET(self) -> None:
        self.handle_request(body=True)

    def send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool = True) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def handle_request(self, body: bool) -> None:
        path = self.path.split("?", 1)[0]
        self.server.requests.append((self.command, path, self.headers.get("Range")))
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path):
            files = self.server.repos.get(m.group(1))
            if files is None:
                return self.send(404, b'{"error":"Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            siblings = [
                {
                    "rfilename": name,
                    "size": len(data),
                    "lfs": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134},
                }
                for name, data in files.items()
            ]
            info = {"id": m.group(1), "modelId": m.group(1), "sha": COMMIT, "siblings": siblings, "private": False}
            return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            data = self.server.repos.get(m.group(1), {}).get(m.group(3))
            if data is None:
                return self.send(404, b"not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, body)
            etag = hashlib.sha256(data).hexdigest()
            if m.group(3) in self.server.corrupt:
                data = data[:100] + bytes([data[100] ^ 0xFF]) + data[101:]
            headers = {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes"}
            start = 0
            if (r := self.headers.get("Range")) and (rm := re.fullmatch(r"bytes=(\d+)-", r)):
                start = int(rm.group(1))
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            part = data[start:]
            if not body:
                return self.send(200, data, headers, send_body=False)
            if m.group(3) in self.server.drop_once:
                self.server.drop_once.discard(m.group(3))
                self.send_response(206 if start else 200)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                self.wfile.write(part[: len(part) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            return self.send(206 if start else 200, part, headers)
        self.send(404, b"unknown route", {}, body)


@pytest.fixture
def hub(tmp_path, monkeypatch, leat_home):
    server = Hub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("LEAT_HOME", str(leat_home(tmp_path / "home")))  # the CPU backend's kernels shared
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.shutdown()
    server.server_close()


def test_choose_files():
    files = ["README.md", "m-Q8_0.gguf", "m-q4_k_m.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf"]
    assert hf.choose_files(files, None) == ("Q4_K_M", ["m-q4_k_m.gguf"])
    assert hf.choose_files(files, "q8_0") == ("Q8_0", ["m-Q8_0.gguf"])
    split = ["Q6_K/m-Q6_K-00002-of-00002.gguf", "Q6_K/m-Q6_K-00001-of-00002.gguf", "m-Q4_K_M.gguf"]
    assert hf.choose_files(split, "Q6_K")[1] == ["Q6_K/m-Q6_K-00001-of-00002.gguf", "Q6_K/m-Q6_K-00002-of-00002.gguf"]
    with pytest.raises(PullError, match="split in 2 parts but the repository has 1"):
        hf.choose_files(split[1:], "Q6_K")
    with pytest.raises(PullError, match="no GGUF file for quantization IQ2_XS.*add :QUANT"):
        hf.choose_files(files, "IQ2_XS")
    assert hf.choose_files(["only-F16.gguf"], None) == ("default", ["only-F16.gguf"])
    assert hf.parse("owner/repo:Q8_0") == hf.HfSpec("owner", "repo", "Q8_0")
    assert hf.parse("hf:owner/repo") == hf.HfSpec("owner", "repo", None)
    assert hf.parse("dir/model.gguf") is None and hf.parse("smollm2") is None


def test_choose_mmproj_as_llamacpp_hf():
    files = ["m-Q4_K_M.gguf", "mmproj-m-F16.gguf", "mmproj-m-Q8_0.gguf", "mmproj-m-BF16.gguf", "README.md"]
    assert hf.choose_mmproj(files, "m-Q4_K_M.gguf") == "mmproj-m-Q8_0.gguf"  # 8 bits is nearest 4
    assert hf.choose_mmproj(files, "m-F32.gguf") == "mmproj-m-BF16.gguf"  # 16 and 16: the first by name
    split = "Q8_0/m-Q8_0-00001-of-00002.gguf"
    assert hf.choose_mmproj([*files, "Q8_0/mmproj-F32.gguf", "other/mmproj-Q8_0.gguf"], split) == "Q8_0/mmproj-F32.gguf"
    assert hf.choose_mmproj(files, split) == "mmproj-m-Q8_0.gguf"  # a folder above the model's
    assert hf.choose_mmproj(["m-Q4_K_M.gguf", "sub/mmproj-F16.gguf"], "m-Q4_K_M.gguf") is None  # not beside it
    assert hf.choose_mmproj(["m-Q4_K_M.gguf"], "m-Q4_K_M.gguf") is None


def test_pull_fetches_the_projector_and_no_mmproj_skips_it(hub, tmp_path):
    model, f16, q8 = (gguf_bytes(tmp_path, seed) for seed in (11, 12, 13))
    hub.repos["someone/vision-GGUF"] = {
        "v-Q4_K_M.gguf": model,
        "v-Q8_0.gguf": model,
        "mmproj-v-F16.gguf": f16,
        "mmproj-v-Q8_0.gguf": q8,
    }
    plain = pull.pull("someone/vision-GGUF:Q8_0", mmproj=False)
    assert pull.projector(plain) is None and sorted(p.name for p in plain.parent.iterdir()) == [
        "manifest.json",
        "v-Q8_0.gguf",
    ]
    hub.requests.clear()
    path = pull.pull("someone/vision-GGUF:Q8_0")  # the same commit, now with its projector: only that is fetched
    assert path == plain and path.read_bytes() == model
    assert pull.projector(path) == path.parent / "mmproj-v-Q8_0.gguf" and pull.projector(path).read_bytes() == q8
    assert [p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p] == [
        f"/someone/vision-GGUF/resolve/{COMMIT}/mmproj-v-Q8_0.gguf"
    ]
    assert pull.verify("someone/vision-GGUF:Q8_0") == path  # the projector is one of the model's files
    default = pull.resolve("someone/vision-GGUF")  # pulled on first use, as `leat run` does: projector included
    assert pull.projector(default).read_bytes() == q8
    rows = {m["name"]: m for m in pull.list_models()}
    assert rows["someone/vision-GGUF:Q8_0"]["mmproj"] == path.parent / "mmproj-v-Q8_0.gguf"
    assert rows["someone/vision-GGUF:Q8_0"]["size"] == len(model) + len(q8)
    assert pull.projector(tmp_path / "m11.gguf") is None  # a file outside the model cache has none


def test_pull_default_quant_and_split(hub, tmp_path):
    q4, q8a, q8b = (gguf_bytes(tmp_path, seed) for seed in (1, 2, 3))
    hub.repos["someone/tiny-GGUF"] = {
        "tiny-Q4_K_M.gguf": q4,
        "Q8_0/tiny-Q8_0-00001-of-00002.gguf": q8a,
        "Q8_0/tiny-Q8_0-00002-of-00002.gguf": q8b,
        "README.md": b"# tiny",
    }
    path = pull.pull("someone/tiny-GGUF")
    assert path.read_bytes() == q4 and path.name == "tiny-Q4_K_M.gguf"
    assert pull.resolve("someone/tiny-GGUF", pull=False) == path  # run, serve and doctor resolve it by name
    assert pull.resolve("someone/tiny-GGUF:q4_k_m", pull=False) == path

    hub.requests.clear()
    split = pull.resolve("someone/tiny-GGUF:Q8_0")
    assert split.name == "tiny-Q8_0-00001-of-00002.gguf" and split.read_bytes() == q8a
    assert (split.parent / "tiny-Q8_0-00002-of-00002.gguf").read_bytes() == q8b
    assert {p for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p} == {
        f"/someone/tiny-GGUF/resolve/{COMMIT}/Q8_0/tiny-Q8_0-0000{i}-of-00002.gguf" for i in (1, 2)
    }
    names = {m["name"] for m in pull.list_models()}
    assert names == {"someone/tiny-GGUF:Q4_K_M", "someone/tiny-GGUF:Q8_0"}
    hub.requests.clear()
    assert pull.resolve("someone/tiny-GGUF:Q8_0") == split
    assert hub.requests == []  # cached: the hub is not asked again
    assert pull.pull("someone/tiny-GGUF:Q8_0") == split  # pull asks for the latest commit: the same one, no download
    assert [m for m, p, _ in hub.requests] == ["GET"] and hub.requests[0][1].startswith("/api/models/")


def test_interrupted_transfer_resumes(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub keeps what it read only in whole chunks (10 MB); smaller ones let a small file resume halfway.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    data = gguf_bytes(tmp_path, 4, size=512 * 1024)
    hub.repos["someone/big-GGUF"] = {"big-Q4_K_M.gguf": data}
    hub.drop_once.add("big-Q4_K_M.gguf")
    seen = []
    path = pull.pull("someone/big-GGUF", progress=lambda done, total, label: seen.append((done, total, label)))
    assert path.read_bytes() == data
    ranges = [r for m, p, r in hub.requests if m == "GET" and "/resolve/" in p]
    assert ranges[0] is None and len(ranges) == 2
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", ranges[1]).group(1))
    assert 0 < resumed_at < len(data)  # the second request asked only for the rest
    assert seen and seen[-1][:2] == (len(data), len(data)) and seen[-1][2] == "download big-Q4_K_M.gguf"


def test_corrupted_file_rejected(hub, tmp_path):
    hub.repos["someone/bad-GGUF"] = {"bad-Q4_K_M.gguf": gguf_bytes(tmp_path, 5)}
    hub.corrupt.add("bad-Q4_K_M.gguf")
    with pytest.raises(PullError, match="has SHA-256 .* but the hub says .*refusing it"):
        pull.pull("someone/bad-GGUF")
    with pytest.raises(PullError, match="not in the model cache"):
        pull.resolve("someone/bad-GGUF", pull=False)
    assert not list((pull.models_dir()).glob("hf--*/*.gguf"))


def test_missing_repo_and_quant(hub, tmp_path):
    with pytest.raises(PullError, match="not a model repository"):
        pull.pull("nobody/nothing")
    hub.repos["someone/tiny-GGUF"] = {"tiny-Q8_0.gguf": gguf_bytes(tmp_path, 6), "tiny-F16.gguf": b"GGUF"}
    with pytest.raises(PullError, match="no GGUF file for quantization Q4_K_M"):
        pull.pull("someone/tiny-GGUF")


def test_cli_pull_then_generate_and_doctor_by_name(hub, tmp_path):
    from click.testing import CliRunner
    from leat.cli import cli
    from leat.testing import write_tiny_gguf

    llama = pytest.importorskip("leat_arch_llama.llama")
    pytest.importorskip("leat_backend_cpu")
    data = write_tiny_gguf(llama.Llama, tmp_path / "tiny.gguf").read_bytes()
    projector = gguf_bytes(tmp_path, 7)  # a GGUF that is no projector: the model still answers text, with a note
    hub.repos["someone/llama-GGUF"] = {"llama-tiny-Q4_K_M.gguf": data, "mmproj-llama-tiny-F16.gguf": projector}
    runner = CliRunner()
    pulled = runner.invoke(cli, ["pull", "someone/llama-GGUF"], catch_exceptions=False)
    assert pulled.exit_code == 0 and Path(pulled.stdout.strip()).read_bytes() == data
    hub.requests.clear()
    args = [
        "generate",
        "-m",
        "someone/llama-GGUF",
        "-p",
        "hi",
        "-n",
        "3",
        "--temperature",
        "0",
        "--json",
        "--backend",
        "cpu",
    ]
    generated = runner.invoke(cli, args, catch_exceptions=False)
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout)["model"] == pulled.stdout.strip()
    assert "note: mmproj-llama-tiny-F16.gguf, the vision projector pulled with the model, is not loaded" in (
        generated.stderr
    )
    doctor = runner.invoke(cli, ["doctor", "-m", "someone/llama-GGUF:Q4_K_M", "--json"], catch_exceptions=False)
    assert doctor.exit_code == 0 and json.loads(doctor.stdout)["model"]
    listed = json.loads(runner.invoke(cli, ["list", "--json"]).stdout)
    assert [m["name"] for m in listed] == ["someone/llama-GGUF:Q4_K_M"]
    assert hub.requests == []  # every command found the pulled model by its name, offline


def test_cli_pulled_projector_is_loaded_by_name(hub, tmp_path):
    """`leat pull` fetches a tiny Gemma 3 repository's projector; `leat generate --image` by the model's name then
    reads the image exactly as with --mmproj FILE, --no-mmproj leaves it out, and `leat list` shows it."""
    from click.testing import CliRunner
    from leat.cli import cli
    from leat.testing import encode_png, write_tiny_gguf, write_tiny_mmproj

    gemma = pytest.importorskip("leat_arch_gemma.gemma")
    pytest.importorskip("leat_backend_cpu")
    params = gemma.Gemma3.tiny()
    model = write_tiny_gguf(gemma.Gemma3, tmp_path / "g.gguf", seed=2, params=params)
    mmproj = write_tiny_mmproj(tmp_path / "mmproj-g-F16.gguf", params.width, gguf.VisionProjectorType.GEMMA3, seed=102)
    image = tmp_path / "noise.png"
    image.write_bytes(encode_png(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)))
    hub.repos["someone/gemma-GGUF"] = {"g-Q4_K_M.gguf": model.read_bytes(), "mmproj-g-F16.gguf": mmproj.read_bytes()}
    runner = CliRunner()
    assert runner.invoke(cli, ["pull", "someone/gemma-GGUF"], catch_exceptions=False).exit_code == 0
    args = ["generate", "-p", "what is it", "-n", "4", "--temperature", "0", "--json", "--backend", "cpu"]
    args += ["--image", str(image)]

    def generate(*extra: str):
        return runner.invoke(cli, [*args, *extra], catch_exceptions=False)

    pulled, explicit = generate("someone/gemma-GGUF"), generate(str(model), "--mmproj", str(mmproj))
    assert pulled.exit_code == 0 and explicit.exit_code == 0, pulled.output + explicit.output
    first, second = json.loads(pulled.stdout), json.loads(explicit.stdout)
    assert first["prompt_ids"] == second["prompt_ids"] and first["ids"] == second["ids"]
    assert len(first["prompt_ids"]) > 16  # the image's 16 positions are in the prompt
    refused = runner.invoke(cli, [*args, "someone/gemma-GGUF", "--no-mmproj"])
    assert refused.exit_code != 0 and "no vision projector" in str(refused.exception)
    listed = runner.invoke(cli, ["list"]).stdout.splitlines()
    assert listed[0].split()[-1] == "PROJECTOR" and listed[1].split()[-1] == "mmproj-g-F16.gguf"
