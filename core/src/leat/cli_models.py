"""What ``leat list``, ``leat show`` and ``leat ps`` print, and the files running servers leave for ``leat ps``.

A model goes by one name everywhere the CLI and the server print it: its GGUF file's stem (the first part's, for a
split model), which is also the id ``leat serve`` gives clients and a name ``leat run`` accepts once pulled.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from leat.errors import LeatError


def model_label(path: str | Path) -> str:
    """A model's name in everything leat prints: its GGUF file's stem."""
    return Path(path).stem


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart (as `ollama list` prints)."""
    cells = [list(map(str, head))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def pulled_models() -> list[dict[str, Any]]:
    """The pulled models of :func:`leat.pull.list_models`, each with ``model`` (its name) and ``modified`` (epoch);
    paths as strings."""
    from leat.pull import list_models

    rows = []
    for row in list_models():
        path = Path(row["path"])
        modified = path.stat().st_mtime if path.exists() else None
        mmproj = str(row["mmproj"]) if row["mmproj"] else None
        rows.append({"model": model_label(path), **row, "path": str(path), "mmproj": mmproj, "modified": modified})
    return rows


def _ago(epoch: float | None, now: float) -> str:
    if epoch is None:
        return "missing"
    seconds = max(0.0, now - epoch)
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit} ago"
    return "just now"


def list_table(rows: list[dict[str, Any]]) -> str:
    """The pulled models; a PROJECTOR column when one has a vision projector."""
    now, vision = time.time(), any(r.get("mmproj") for r in rows)
    body = [
        (r["model"], human_size(r["size"]), r["source"], _ago(r["modified"], now))
        + ((Path(r["mmproj"] or "").name,) if vision else ())
        for r in rows
    ]
    return table(["NAME", "SIZE", "SOURCE", "MODIFIED"] + ["PROJECTOR"] * vision, body)


def describe(path: Path) -> dict[str, Any]:
    """What ``leat show`` prints: the file's metadata (long arrays summarised), chat template and quant mix."""
    from leat.chat import ChatTemplate
    from leat.modelfile import ModelFile, StringArray

    file = ModelFile(path)
    mix: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for tensor in file.tensors.values():
        mix[tensor.qtype.name] += tensor.nbytes
        count[tensor.qtype.name] += 1
    metadata = {}
    for key, value in file.metadata.items():
        if isinstance(value, list | tuple | StringArray) and len(value) > 8:
            value = f"[{len(value)} items]"
        elif key == "tokenizer.chat_template":
            continue
        metadata[key] = value if isinstance(value, str | int | float | bool | type(None)) else str(value)
    template = ChatTemplate.from_metadata(file.metadata)
    return {
        "model": model_label(file.path),
        "path": str(file.path),
        "architecture": file.architecture,
        "context_length": int(file.get("{arch}.context_length", 0)) or None,
        "weight_bytes": file.weight_bytes(),
        "tensors": len(file.tensors),
        "quant_mix": [
            {"type": name, "tensors": count[name], "bytes": size, "share": size / max(1, file.weight_bytes())}
            for name, size in mix.most_common()
        ],
        "chat_template": template.source,
        "chat_template_note": template.fallback_reason,
        "metadata": metadata,
    }


def show_text(d: dict[str, Any]) -> str:
    lines = [
        f"model          {d['model']}",
        f"path           {d['path']}",
        f"architecture   {d['architecture']}",
        f"context length {d['context_length']}",
        f"weights        {human_size(d['weight_bytes'])} in {d['tensors']} tensors",
        "",
        table(
            ["TYPE", "TENSORS", "SIZE", "SHARE"],
            [(q["type"], q["tensors"], human_size(q["bytes"]), f"{100 * q['share']:.1f}%") for q in d["quant_mix"]],
        ),
        "",
        "metadata:",
    ]
    lines += [f"  {key} = {value}" for key, value in d["metadata"].items() if not key.startswith("tokenizer.ggml.")]
    note = f" ({d['chat_template_note']})" if d["chat_template_note"] else ""
    lines += ["", f"chat template{note}: {len(d['chat_template'])} characters (--template prints it)"]
    return "\n".join(lines)


# --- running servers, for `leat ps` -------------------------------------------------------------------------------


def _servers_dir() -> Path:
    from leat.pull import cache_dir

    return cache_dir() / "servers"


@contextmanager
def running_server(record: dict[str, Any]) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Leave ``record`` (model, path, address, ...; ``models``: each resident model's model, path, size, state and
    loaded time, for a server of several) where ``leat ps`` finds it while the block runs; the block gets a function
    that updates it."""
    directory = _servers_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{os.getpid()}.json"
    current = {"pid": os.getpid(), "started": time.time(), **record}
    lock = threading.Lock()  # a server's load threads update it at once: one writer of the .part file at a time

    def update(fields: dict[str, Any]) -> None:
        with lock:
            current.update(fields)
            partial = path.with_suffix(".part")  # replaced whole: a reader never sees half a file
            partial.write_text(json.dumps(current))
            partial.replace(path)

    update({})
    try:
        yield update
    finally:
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_servers() -> list[dict[str, Any]]:
    """The ``leat serve`` processes of this LEAT_HOME that are still running; files of dead ones are removed."""
    directory = _servers_dir()
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid = int(record["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(pid):
            found.append(record)
        else:
            path.unlink(missing_ok=True)
    return found


def ps_table(rows: list[dict[str, Any]]) -> str:
    """A line per resident model: a server of several models has one for each it has loaded (or is loading)."""
    now = time.time()
    body = []
    for r in rows:
        for m in r.get("models", [r]):
            started = _ago(m["loaded"], now) if m.get("loaded") else m.get("state", _ago(r["started"], now))
            body.append((m["model"], r["address"], r["pid"], human_size(m["size"] or 0), started))
    return table(["NAME", "ADDRESS", "PID", "SIZE", "STARTED"], body)


def check_removable(name: str) -> None:
    """Refuse to remove a model a running server has loaded."""
    from leat.pull import resolve

    path = resolve(name, pull=False)
    for server in running_servers():
        if any(Path(m["path"]).resolve() == path.resolve() for m in server.get("models", [server])):
            raise LeatError(
                f"{model_label(path)} is served by process {server['pid']} ({server['address']}); stop it first"
            )
