"""``leat doctor``: what this machine can run, and what a model needs, without loading weights."""

from __future__ import annotations

import ctypes.util
import os
import platform
import shutil
from collections import Counter
from typing import Any

from leat import plugins
from leat.errors import LeatError
from leat.modelfile import ModelFile

KV_ELEMENT_BYTES = {"f32": 4, "f16": 2, "q8_0": 34 / 32}


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def machine_report() -> dict[str, Any]:
    """CPU, memory, GPU driver and NVRTC presence, and each backend's probe, with what to fix."""
    report: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "nvidia_driver": bool(ctypes.util.find_library("cuda")),
        "nvidia_smi": shutil.which("nvidia-smi"),
    }
    fixes = []
    host = plugins.host()
    backends = {}
    for name, entry in host.registry["backends"].items():
        try:
            reason = entry.load().probe()
        except LeatError as e:
            reason = str(e)
        backends[name] = {"plugin": entry.plugin, "usable": reason is None, "reason": reason}
        if reason:
            fixes.append(f"backend {name}: {reason}")
    report["backends"] = backends
    report["install"] = install_hints(backends, report["nvidia_driver"])
    for info in host.failed():
        fixes.append(f"plugin {info.name} failed to load: {info.error}")
    if not backends:
        fixes.append("no backend plugin is installed: install leat-backend-cpu")
    report["fixes"] = fixes
    return report


# the backends that are extras of a clone of leat (`uv sync --extra NAME`), and their distributions
EXTRAS = {"cuda": "leat-backend-cuda", "tinygrad": "leat-backend-tinygrad"}


def install_hints(backends: dict[str, Any], nvidia_driver: bool) -> list[str]:
    """What to install for the hardware found: the CUDA backend where an NVIDIA driver is, tinygrad (and the clang
    its CPU device compiles with) where asked for."""
    hints = []
    if nvidia_driver and "cuda" not in backends:
        hints.append(
            "an NVIDIA driver is here but the CUDA backend is not installed: pip install leat-backend-cuda "
            "(in a clone of leat: uv sync --extra cuda)"
        )
    if "tinygrad" not in backends:
        clang = (
            ""
            if shutil.which(os.environ.get("CC", "clang"))
            else "; its CPU device also needs clang (apt-get install clang)"
        )
        hints.append(
            f"optional: the tinygrad backend, pip install leat-backend-tinygrad (in a clone: uv sync --extra tinygrad){clang}"
        )
    return hints


def describe_model(name: str, tensor_parallel: int = 1, device_memory: float | None = None) -> dict[str, Any]:
    """What ``name`` is and needs; with ``tensor_parallel`` N above 1, also what each of N devices holds and whether it
    fits ``device_memory`` bytes (None: the machine's memory shared by the ranks for the cpu backend, else unknown)."""
    from leat.model import architecture_class
    from leat.pull import resolve

    file = ModelFile(resolve(name))
    types = Counter(t.qtype.name for t in file.tensors.values())
    out: dict[str, Any] = {
        "path": str(file.path),
        "parts": len(file.parts),
        "name": file.name,
        "architecture": file.architecture,
        "tensors": len(file.tensors),
        "tensor_types": dict(types.most_common()),
        "weight_bytes": file.weight_bytes(),
    }
    arch = architecture_class(file)
    params = arch.checked_params(file)
    layouts = arch.kv_layouts(params)
    out["context_length"] = int(file.get("{arch}.context_length", 0)) or None
    out["kv_bytes_per_token"] = {
        kind: int(sum(layout.bytes_per_token(1) for layout in layouts) * size)
        for kind, size in KV_ELEMENT_BYTES.items()
    }
    host = plugins.host()
    support, memory = {}, {}
    for backend_name, entry in host.registry["backends"].items():
        try:
            cls = entry.load()
        except LeatError as e:
            support[backend_name] = str(e)
            continue
        missing = sorted({t.qtype.name for t in file.tensors.values()} - {q.name for q in cls.quant_types})
        support[backend_name] = "all tensor types" if not missing else f"missing {', '.join(missing)}"
        if arch.recurrent and not cls.recurrent_state:
            support[backend_name] += "; keeps no recurrent state, which this model's layers need"
        held = cls.weight_bytes(list(file.tensors.values())) if not missing else None
        if held is not None:
            memory[backend_name] = held
    out["backend_support"] = support
    out["backend_weight_bytes"] = memory
    if tensor_parallel > 1:
        out["tensor_parallel"] = _split_fit(file, arch, layouts, tensor_parallel, device_memory)
    return out


def _split_fit(file: ModelFile, arch: Any, layouts: list, ranks: int, device_memory: float | None) -> dict[str, Any]:
    """Per device of ``ranks``: the weights each backend would hold, the f16 KV of one sequence of the model's context,
    and whether the two fit; or why the model does not split."""
    from leat.parallel import check_split, rank_tensors

    try:
        check_split(arch, file, ranks)
    except LeatError as e:
        return {"ranks": ranks, "refused": str(e)}
    context = int(file.get("{arch}.context_length", 0)) or 4096
    kv = int(sum(layout.bytes_per_token(2) // (1 if layout.latent else ranks) for layout in layouts) * context)
    tensors = rank_tensors(list(file.tensors.values()), ranks)
    fit: dict[str, Any] = {"ranks": ranks, "kv_bytes_per_rank": kv, "context": context, "backends": {}}
    for backend_name, entry in plugins.host().registry["backends"].items():
        held = entry.load().weight_bytes(tensors)
        memory = device_memory or (_memory_bytes() or 0) / ranks if backend_name == "cpu" else device_memory
        fits = None if held is None or not memory else held + kv <= memory
        fit["backends"][backend_name] = {"weight_bytes_per_rank": held, "memory_per_rank": memory, "fits": fits}
    return fit


def render_split(fit: dict[str, Any]) -> list[str]:
    if "refused" in fit:
        return [f"tensor parallel {fit['ranks']}: {fit['refused']}"]
    lines = []
    for name, b in fit["backends"].items():
        if b["weight_bytes_per_rank"] is None:
            continue
        need = (b["weight_bytes_per_rank"] + fit["kv_bytes_per_rank"]) / 2**30
        verdict = {True: "fits", False: "does not fit", None: "fit unknown (give --device-memory GIB)"}[b["fits"]]
        memory = f" in {b['memory_per_rank'] / 2**30:.1f} GiB" if b["memory_per_rank"] else ""
        lines.append(
            f"tensor parallel {fit['ranks']} on {name}: each rank holds {b['weight_bytes_per_rank'] / 2**20:.1f} MiB "
            f"of weights + {fit['kv_bytes_per_rank'] / 2**20:.1f} MiB of f16 KV for one {fit['context']}-token "
            f"sequence = {need:.2f} GiB: {verdict}{memory}"
        )
    return lines


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"leat {report['leat']} on Python {m['python']}, {m['platform']}"]
    memory = f"{m['memory_bytes'] / 2**30:.1f} GiB" if m["memory_bytes"] else "unknown"
    lines.append(f"CPU: {m['cpus']} cores, memory {memory}")
    lines.append(f"NVIDIA driver: {'found' if m['nvidia_driver'] else 'not found'}")
    for name, b in m["backends"].items():
        state = "usable" if b["usable"] else f"not usable: {b['reason']}"
        lines.append(f"backend {name} ({b['plugin']}): {state}")
    if "model" in report:
        d = report["model"]
        lines.append("")
        lines.append(f"model {d['name']} ({d['path']}, {d['parts']} part(s))")
        lines.append(f"architecture {d['architecture']}, {d['tensors']} tensors, {d['weight_bytes'] / 2**20:.1f} MiB")
        lines.append("tensor types: " + ", ".join(f"{k} x{v}" for k, v in d["tensor_types"].items()))
        lines.append(f"context length {d['context_length']}")
        lines.append("KV bytes per token: " + ", ".join(f"{k} {v}" for k, v in d["kv_bytes_per_token"].items()))
        for name, support in d["backend_support"].items():
            held = d["backend_weight_bytes"].get(name)
            lines.append(f"backend {name}: {support}" + (f", weights in memory {held / 2**20:.1f} MiB" if held else ""))
        lines.extend(render_split(d["tensor_parallel"]) if "tensor_parallel" in d else [])
    if m["install"]:
        lines.append("")
        lines.append("to install:")
        lines.extend(f"  - {hint}" for hint in m["install"])
    fixes = m["fixes"]
    lines.append("")
    lines.append("to fix:" if fixes else "nothing to fix")
    lines.extend(f"  - {fix}" for fix in fixes)
    return "\n".join(lines)
