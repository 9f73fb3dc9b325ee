"""The Architecture contract: GGUF metadata -> hyperparameters, tensors -> weights, ``forward``.

An architecture class serves one or more values of ``general.architecture``. It is constructed
with a :class:`~leat.modelfile.ModelFile` and a :class:`~leat.backend.Backend`; it reads its
hyperparameters (a missing key is a :class:`ModelFileError` naming it), uploads every tensor of the
file (a tensor it does not consume is an error too: it would mean a silent mapping bug), declares
its KV layout per layer, and writes ``forward`` once against Backend ops.

For tests, each architecture also describes a tiny model: :meth:`tiny` hyperparameters,
:meth:`tensor_shapes` and :meth:`write_metadata`, from which :func:`leat.testing.write_tiny_gguf`
writes a random-weight GGUF with the real tensor names and metadata keys.
"""

from __future__ import annotations

from typing import Any, ClassVar

import gguf
import numpy as np

from leat.backend import Backend, KVLayout
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.modelfile import ModelFile


class Weights:
    """Uploads tensors by name on request and remembers which ones were consumed."""

    def __init__(self, file: ModelFile, backend: Backend):
        self.file = file
        self.backend = backend
        self.used: set[str] = set()

    def __call__(self, name: str, optional: bool = False) -> Any:
        if name not in self.file.tensors:
            if optional:
                return None
            raise ModelFileError(f"{self.file.path}: missing tensor {name}")
        self.used.add(name)
        return self.backend.upload(self.file.tensors[name])

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def host(self, name: str) -> np.ndarray:
        """A small tensor dequantized to float32 on the host (e.g. RoPE frequency factors)."""
        tensor = self.file.tensor(name)
        self.used.add(name)
        return gguf.quants.dequantize(tensor.data, tensor.qtype).reshape(tensor.shape).astype(np.float32)

    def check_all_used(self) -> None:
        unused = sorted(set(self.file.tensors) - self.used)
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise ModelFileError(f"{self.file.path}: tensors not used by the {self.file.architecture} loader: {shown}")


class Architecture:
    """Base class of model architectures. Subclasses set ``names`` and implement the methods below."""

    names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, file: ModelFile, backend: Backend):
        self.file = file
        self.backend = backend
        self.params = self.read_params(file)
        weights = Weights(file, backend)
        self.load_weights(weights)
        weights.check_all_used()

    # -- description --------------------------------------------------------------------------------
    @classmethod
    def read_params(cls, file: ModelFile) -> Any:
        """Hyperparameters from metadata; ``file.get(key)`` raises ModelFileError naming a missing key."""
        raise NotImplementedError

    @classmethod
    def kv_layouts(cls, params: Any) -> list[KVLayout]:
        """One KVLayout per layer for these hyperparameters."""
        raise NotImplementedError

    @property
    def context_length(self) -> int:
        return int(self.file.get(gguf.Keys.LLM.CONTEXT_LENGTH, 4096))

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    # -- compute -------------------------------------------------------------------------------------
    def load_weights(self, weights: Weights) -> None:
        raise NotImplementedError

    def forward(self, batch: Batch, kv: Any) -> Any:
        """Run the batch, writing its K/V into ``kv``; return logits [len(batch.logit_index), vocab]."""
        raise NotImplementedError

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> Any:
        """Hyperparameters of a tiny model for tests (overrides replace fields)."""
        raise NotImplementedError

    @classmethod
    def tensor_shapes(cls, params: Any) -> dict[str, tuple[int, ...]]:
        """Every tensor of a file with these hyperparameters: name -> numpy-order shape."""
        raise NotImplementedError

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, params: Any) -> None:
        """The architecture's metadata keys for these hyperparameters (tokenizer keys excluded)."""
        raise NotImplementedError
