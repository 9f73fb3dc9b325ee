"""What tests/test_llamacpp_embeddings.py and tests/test_llamacpp_rerank.py share: llama.cpp's pooled outputs
recorded by ``scripts/record_llamacpp_KIND.py`` on the tiny files of ``tiny_KIND.py`` (KIND: embeddings, rerank),
and those files rebuilt and checked to be the ones recorded on.

Run as a script (in leat's environment) to build every file of ``tiny_KIND.py`` into a folder and print one JSON
line, ``{name: {"path", "sha256", ...its description}}``, which the recording scripts do::

    uv run python tests/references/llamacpp_pooled.py KIND OUTDIR
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

HERE = Path(__file__).parent


def tiny(kind: str) -> ModuleType:
    """``tiny_KIND.py``: its ``CONFIGS`` and ``build(name, path)``, which writes a file and describes it."""
    spec = importlib.util.spec_from_file_location(f"leat_tests_tiny_{kind}", HERE / f"tiny_{kind}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Recording:
    """llama.cpp's recording of KIND: ``manifest`` (per file its description as recorded), ``names`` of the files,
    ``arrays`` (``NAME/I/f16kv`` and ``NAME/I/f32kv``: llama.cpp's pooled output of sequence ``I`` with its default
    F16 KV cache and with an F32 one) and ``models``, leat's models of a rebuilt file."""

    def __init__(self, kind: str):
        self.kind = kind
        self.manifest = json.loads((HERE / f"llamacpp_{kind}.json").read_text())
        self.names = sorted(self.manifest["tiny"])
        self.rerecord = (
            f"re-record with scripts/record_llamacpp_{kind}.py (see its docstring) and commit the new references"
        )

    @functools.cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        with np.load(HERE / f"llamacpp_{self.kind}.npz") as data:
            return {key: data[key] for key in data.files}

    def models(self, name: str, folder: Path, sequences: str) -> Iterator[tuple[str, Any]]:
        """File ``name`` rebuilt in ``folder`` (failing unless it is the file recorded on, with the same
        ``sequences``: the description's field of what was fed), then leat's model of it: (precision, model) for
        the float64 oracle and the float32 path."""
        import leat

        recorded = self.manifest["tiny"][name]
        built = tiny(self.kind).build(name, folder / f"{name}.gguf")
        assert built["sha256"] == recorded["sha256"], f"{name} no longer builds the recorded file; {self.rerecord}"
        assert built[sequences] == recorded[sequences], self.rerecord
        for precision in ("f64", "f32"):
            yield precision, leat.load(built["path"], backend="cpu", precision=precision)


def main(kind: str, out: Path) -> None:
    module = tiny(kind)
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps({name: module.build(name, out / f"tiny-{name}.gguf") for name in module.CONFIGS}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
