"""Hugging Face pulls: ``OWNER/NAME[:QUANT]`` -> the GGUF file(s) of that quantization, as llama.cpp's ``-hf`` takes it.

The repository's file listing (with each LFS file's SHA-256) comes from the hub's model-info route; the files matching
the quantization (every part of a split GGUF) are downloaded with ``huggingface_hub``, which resumes an interrupted
transfer from its ``.incomplete`` file, and each is then hashed and compared with the hub's SHA-256 before it enters
the cache. ``HF_ENDPOINT`` (read at every call) points it at another hub or a mirror; ``HF_TOKEN`` is used as usual.

Cache layout, beside PyPI pulls (see :mod:`leat.pull`)::

    models/hf--<owner>--<name>--<quant>/<file>.gguf      (manifest.json beside them)
    models/.hf-partial/<owner>--<name>--<quant>/          (downloads in progress; kept so a later pull resumes)

A repository's vision projector (``mmproj*.gguf``) comes along as llama.cpp's ``-hf`` picks it (:func:`choose_mmproj`),
into the model's directory, named by the manifest's ``mmproj``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from leat.errors import PullError

DEFAULT_QUANT = "Q4_K_M"
_SPEC = re.compile(r"^(?:hf:|huggingface:)?([A-Za-z0-9][\w.-]*)/([\w.-]+?)(?::([\w.-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_TAG = re.compile(r"[-.][A-Za-z_]*(\d+)[A-Za-z0-9_]*\.gguf$", re.IGNORECASE)
_BLOCK = 1 << 20


@dataclass(frozen=True)
class HfSpec:
    owner: str
    name: str
    quant: str | None = None  # None: Q4_K_M, or the repository's only GGUF

    @property
    def repo(self) -> str:
        return f"{self.owner}/{self.name}"

    def __str__(self) -> str:
        return self.repo + (f":{self.quant}" if self.quant else "")

    def directory(self, quant: str) -> str:
        return f"hf--{self.owner}--{self.name}--{quant}".lower()


def parse(text: str) -> HfSpec | None:
    """``OWNER/NAME[:QUANT]`` (optionally prefixed ``hf:``); None for anything else, such as a path to a .gguf file."""
    text = text.strip()
    match = _SPEC.match(text)
    if not match or text.lower().endswith(".gguf") or Path(text).expanduser().exists():
        return None
    return HfSpec(match.group(1), match.group(2), match.group(3))


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or "https://huggingface.co"


def cached(spec: HfSpec, models_dir: Path) -> Path | None:
    """The primary GGUF of a pulled ``spec``, or None."""
    quants = [spec.quant] if spec.quant else [DEFAULT_QUANT]
    if spec.quant is None:  # a repository with a single unnamed quantization was pulled as "default"
        quants.append("default")
    for quant in quants:
        directory = models_dir / spec.directory(quant)
        try:
            manifest = json.loads((directory / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        path = directory / manifest["primary"]
        if path.is_file():
            return path
    return None


def choose_files(files: list[str], quant: str | None) -> tuple[str, list[str]]:
    """The GGUF files of one quantization (case-insensitive, all parts of a split file) and the quant's name.

    Projector files (``mmproj``) are never chosen. Without ``quant``, Q4_K_M is taken, or the only GGUF there is.
    """
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in PurePosixPath(f).name.lower())
    if not ggufs:
        raise PullError("the repository has no GGUF file")
    wanted = quant or DEFAULT_QUANT
    tag = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(wanted)}([^A-Za-z0-9]|$)", re.IGNORECASE)
    chosen = [f for f in ggufs if tag.search(f)]
    if not chosen and quant is None and len(_groups(ggufs)) == 1:
        chosen, wanted = ggufs, "default"
    if not chosen:
        names = ", ".join(ggufs[:20]) + (" ..." if len(ggufs) > 20 else "")
        raise PullError(f"no GGUF file for quantization {wanted} (found: {names}); add :QUANT to the name")
    groups = _groups(chosen)
    if len(groups) > 1:
        raise PullError(f"{wanted} matches several models ({', '.join(sorted(groups))}); name the quantization fully")
    parts = sorted(chosen)
    if match := _SPLIT.search(parts[0]):
        expected = int(match.group(2))
        if len(parts) != expected:
            raise PullError(f"{parts[0]} is split in {expected} parts but the repository has {len(parts)} of them")
    return wanted.upper() if wanted != "default" else wanted, parts


def choose_mmproj(files: list[str], model: str) -> str | None:
    """The projector llama.cpp's ``-hf`` takes for ``model``: of the ``mmproj`` GGUFs in its folder or one above it, one
    in the deepest such folder, then the one whose bits are nearest the model's (``Q4_K_M`` 4, ``Q8_0`` 8, ``F16`` 16:
    the first number of the name's last tag, 0 without one), then the first by name."""
    here = PurePosixPath(model).parent.parts
    found = [
        PurePosixPath(f) for f in files if f.lower().endswith(".gguf") and "mmproj" in PurePosixPath(f).name.lower()
    ]
    found = [f for f in found if here[: len(f.parent.parts)] == f.parent.parts]
    best = min(found, key=lambda f: (-len(f.parent.parts), abs(_bits(str(f)) - _bits(model)), str(f)), default=None)
    return str(best) if best else None


def _bits(name: str) -> int:
    match = _TAG.search(_SPLIT.sub(".gguf", PurePosixPath(name).name))
    return int(match.group(1)) if match else 0


def _groups(ggufs: list[str]) -> set[str]:
    return {_SPLIT.sub(".gguf", f) for f in ggufs}


def pull(spec: HfSpec, models_dir: Path, progress=None, mmproj: bool = True) -> Path:
    """Download ``spec`` (and the repository's projector, if it has one and ``mmproj``) into ``models_dir``
    (resuming a partial download) and return its primary GGUF path."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    api = HfApi(endpoint=endpoint())
    try:
        info = api.model_info(spec.repo, files_metadata=True)
    except RepositoryNotFoundError:
        raise PullError(f"{spec.repo} is not a model repository on {endpoint()} (or it needs HF_TOKEN)") from None
    except Exception as e:  # noqa: BLE001 - HTTP status, connection and protocol errors alike
        raise PullError(f"cannot list {spec.repo} on {endpoint()}: {e}") from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    try:
        quant, names = choose_files(list(siblings), spec.quant)
    except PullError as e:
        raise PullError(f"{spec.repo}: {e}") from None
    projector = choose_mmproj(list(siblings), names[0]) if mmproj else None
    destination = models_dir / spec.directory(quant)
    try:
        manifest = json.loads((destination / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    here = destination / manifest.get("primary", "")
    if manifest.get("version") == info.sha and here.is_file() and (manifest.get("mmproj") or not projector):
        return here  # this commit is already here (with its projector, when one is asked for)
    kept = {f["name"]: f["sha256"] for f in manifest.get("files", [])}  # an earlier pull's files, reused if unchanged
    partial = models_dir / ".hf-partial" / spec.directory(quant)
    partial.mkdir(parents=True, exist_ok=True)
    files = []
    for name in names + ([projector] if projector else []):
        lfs = siblings[name].lfs
        sha256 = lfs.sha256 if lfs else None
        if not sha256:
            raise PullError(f"{spec.repo}: the hub gives no SHA-256 for {name}; refusing to download it")
        local = partial / PurePosixPath(name).name
        if kept.get(local.name) == sha256.lower() and (destination / local.name).is_file():
            local.unlink(missing_ok=True)
            os.link(destination / local.name, local)  # hashed again below
        else:
            local = Path(_download(spec, name, info.sha, partial, progress))
        got, size = _sha256(local)
        if got != sha256.lower():
            local.unlink(missing_ok=True)
            raise PullError(f"{name} from {spec.repo} has SHA-256 {got}, but the hub says {sha256}; refusing it")
        with open(local, "rb") as f:
            if f.read(4) != b"GGUF":
                raise PullError(f"{name} from {spec.repo} is not a GGUF file")
        files.append({"name": PurePosixPath(name).name, "path": local, "sha256": got, "size": size})

    staging = partial / "model"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for entry in files:
        os.replace(entry.pop("path"), staging / entry["name"])
    primary = files[0]["name"]
    manifest = {
        "name": str(HfSpec(spec.owner, spec.name, quant if quant != "default" else None)),
        "source": f"hf:{spec.repo}:{quant}" if quant != "default" else f"hf:{spec.repo}",
        "package": spec.directory(quant),
        "version": info.sha,
        "primary": primary,
        "files": files,
        "mmproj": PurePosixPath(projector).name if projector else None,
        "size": sum(f["size"] for f in files),
        "endpoint": endpoint(),
        "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if destination.exists():
        shutil.rmtree(destination)
    staging.rename(destination)
    shutil.rmtree(partial, ignore_errors=True)
    return destination / primary


def _download(spec: HfSpec, name: str, revision: str, partial: Path, progress) -> str:
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(
            spec.repo,
            name,
            revision=revision,
            local_dir=partial,
            endpoint=endpoint(),
            tqdm_class=_tqdm_for(progress, name),
        )
    except Exception as e:  # noqa: BLE001 - the hub's and httpx's errors; the partial file stays for a resume
        raise PullError(f"downloading {name} from {spec.repo} failed: {e}; run the pull again to resume") from None


def _sha256(path: Path) -> tuple[str, int]:
    import hashlib  # here: its import loads OpenSSL (leat.sha256)

    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def _tqdm_for(progress, name: str):
    """A tqdm class that reports to leat's ``progress(done, total, label)`` callback; None keeps the hub's own bars."""
    if progress is None:
        return None
    from tqdm.auto import tqdm

    class Report(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = kwargs.get("initial", 0) or 0

        def update(self, n=1):
            self.done += n or 0
            progress(self.done, self.total or 0, f"download {name}")

    return Report
