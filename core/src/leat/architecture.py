"""The Architecture contract: GGUF metadata -> hyperparameters, tensors -> weights, ``forward``.

An architecture class serves one or more values of ``general.architecture``. It is constructed
with a :class:`~leat.modelfile.ModelFile` and a :class:`~leat.backend.Backend`; it reads its
hyperparameters (a missing key is a :class:`ModelFileError` naming it), uploads every tensor of the
file (a tensor it does not consume is an error too: it would mean a silent mapping bug), declares
its KV layout per layer, and writes ``forward`` once against Backend ops.

Before any tensor is uploaded, :meth:`Architecture.checked_params` holds the file to what every architecture
gets checked for: hyperparameters consistent with one another (:func:`leat.gguf_check.check_consistency`), each
tensor of the shape that :meth:`Architecture.tensor_shapes` gives it for these hyperparameters, and no sliding
window of 0 positions, so that a head count at odds with the weights is a ModelFileError naming the tensor and the
keys, not a failed reshape in the middle of ``forward``.

Each model is described once. The hyperparameters are a dataclass (``Params``) whose fields name their GGUF keys
(:mod:`leat.hparams`): :meth:`read_params` and :meth:`write_metadata` follow from it. :meth:`load_weights` names
each tensor with its shape (``w(name, shape)``): :meth:`tensor_shapes` records it. With :meth:`tiny`
hyperparameters, :func:`leat.testing.write_tiny_gguf` writes a random-weight GGUF with the real tensor names and
metadata keys from those.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import gguf
import numpy as np

from leat import gguf_check, hparams
from leat.backend import Backend, KVLayout
from leat.batch import Batch
from leat.errors import ModelFileError
from leat.modelfile import ModelFile, Tensor


class Weights:
    """Uploads tensors by name on request and remembers which ones were consumed."""

    def __init__(self, file: ModelFile, backend: Backend):
        self.file = file
        self.backend = backend
        self.used: set[str] = set()

    def __call__(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False) -> Any:
        """The tensor ``name`` uploaded; ``shape`` (numpy order) is what the hyperparameters make it, which
        :meth:`Architecture.tensor_shapes` records and :func:`check_tensor_shapes` holds the file to."""
        if name not in self.file.tensors:
            if optional:
                return None
            raise ModelFileError(f"{self.file.path}: missing tensor {name}")
        self.used.add(name)
        return self.backend.upload(self.file.tensors[name])

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def host(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A small tensor dequantized to float32 on the host (e.g. RoPE frequency factors)."""
        tensor = self.file.tensor(name)
        self.used.add(name)
        return gguf.quants.dequantize(tensor.data, tensor.qtype).reshape(tensor.shape).astype(np.float32)

    def rows(self, name: str, shape: tuple[int, ...], rows: np.ndarray) -> Any:
        """The rows ``rows`` (first axis) of the 2-D tensor ``name`` (of ``shape``), uploaded in its stored type: a
        projection whose outputs the model splits (rows are independent blocks in every quant type)."""
        tensor = self.file.tensor(name)
        self.used.add(name)
        data = np.asarray(tensor.data).reshape(tensor.shape[0], -1)[rows]
        return self.backend.upload(Tensor(name, tensor.qtype, (len(rows), *tensor.shape[1:]), data))

    def columns(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> Any:
        """The columns ``start:stop`` of the 2-D tensor ``name`` (of ``shape``), uploaded in its stored type: one input's
        part of a projection of concatenated inputs. Both ends must fall on the type's block boundaries."""
        tensor = self.file.tensor(name)
        self.used.add(name)
        block = gguf.GGML_QUANT_SIZES[tensor.qtype][0]
        if start % block or stop % block:
            raise ModelFileError(
                f"{self.file.path}: {name} ({tensor.qtype.name}) cannot be split at column {start}:{stop}"
            )
        data = np.asarray(tensor.data).reshape(tensor.shape[0], -1)
        per_block = data.shape[1] // (tensor.shape[1] // block)  # array elements per block of a row
        part = np.ascontiguousarray(data[:, start // block * per_block : stop // block * per_block])
        return self.backend.upload(Tensor(name, tensor.qtype, (tensor.shape[0], stop - start), part))

    def array(self, name: str, values: np.ndarray) -> Any:
        """Host ``values`` computed at load (from tensors read with :meth:`host`) uploaded as F32 under ``name``."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        return self.backend.upload(Tensor(name, gguf.GGMLQuantizationType.F32, values.shape, values))

    def check_all_used(self) -> None:
        unused = sorted(set(self.file.tensors) - self.used)
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise ModelFileError(f"{self.file.path}: tensors not used by the {self.file.architecture} loader: {shown}")


class TensorRecorder(Weights):
    """What :meth:`Architecture.load_weights` asks for, with the shapes it gives, instead of uploading anything: a
    tiny file's tensors. ``file`` holds only the metadata the hyperparameters write."""

    def __init__(self, file: Any):  # no Weights.__init__: there is no ModelFile or Backend
        self.file = file
        self.used: set[str] = set()
        self.shapes: dict[str, tuple[int, ...]] = {}

    def __call__(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False) -> Any:
        if optional:
            return None  # not part of a test file: the hyperparameters decide what a file has
        if shape is None:
            raise TypeError(f"load_weights asks for {name} without its shape: w(name, shape) describes test files")
        self.shapes[name] = tuple(int(d) for d in shape)
        return name

    def has(self, name: str) -> bool:
        return False

    def host(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        self(name, shape)
        return np.zeros(self.shapes[name], np.float32)

    def rows(self, name: str, shape: tuple[int, ...], rows: np.ndarray) -> Any:
        return self(name, shape)

    def columns(self, name: str, shape: tuple[int, ...], start: int, stop: int) -> Any:
        return self(name, shape)

    def array(self, name: str, values: np.ndarray) -> Any:
        return name  # computed from recorded tensors, not a tensor of the file


class DescribedFile:
    """The metadata a set of hyperparameters writes, readable as a ModelFile's (``get``, ``architecture``)."""

    def __init__(self, architecture: str, params: Any, writer: Any):
        self.architecture, self.path = architecture, f"<tiny {architecture}>"
        self.tensors: dict[str, Any] = {}
        self.metadata: dict[str, Any] = {}
        writer(self, params)

    @property
    def arch(self) -> str:  # what hparams.write asks of a GGUFWriter
        return self.architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key.format(arch=self.architecture), default)

    def add_bool(self, key: str, value: Any) -> None:
        self.metadata[key] = value

    add_uint32 = add_float32 = add_string = add_array = add_bool


class Architecture:
    """Base class of model architectures. Subclasses set ``names`` and implement the methods below."""

    names: ClassVar[tuple[str, ...]] = ()
    #: The hyperparameter dataclass, its fields declared with :func:`leat.hparams.key` / :func:`~leat.hparams.derived`.
    Params: ClassVar[type | None] = None
    #: The vision projectors (an mmproj's ``clip.projector_type``) the family takes images through: each a
    #: :class:`leat.vision.Projector` (its encoder and the text around an image's embeddings). None: no images.
    projectors: ClassVar[dict[str, Any]] = {}
    #: True for a family with layers that keep a recurrent state per sequence (:meth:`Backend.gated_delta_net`), which
    #: rewinds only into a verified draft: the engine then reuses no cached prefix and keeps no sessions for it
    recurrent: ClassVar[bool] = False
    #: True for a drafter that runs only beside its target (a proposer plugin's ``--draft`` file): its ``forward``
    #: refuses with what the file is for, and no text is generated with it alone
    drafts_only: ClassVar[bool] = False

    def __init__(self, file: ModelFile, backend: Backend):
        self.file = file
        self.backend = backend
        self.params = self.checked_params(file)
        weights = Weights(file, backend)
        self.load_weights(weights)
        self.classifier = self.load_classifier(weights)
        weights.check_all_used()

    # -- description --------------------------------------------------------------------------------
    @classmethod
    def read_params(cls, file: ModelFile) -> Any:
        """Hyperparameters from metadata (a missing key is a ModelFileError naming it): by default as ``Params``
        declares them."""
        if cls.Params is None:
            raise NotImplementedError
        return hparams.read(cls.Params, file)

    @classmethod
    def checked_params(cls, file: ModelFile) -> Any:
        """:meth:`read_params`, checked: the hyperparameters are consistent with one another, every tensor of the
        file that :meth:`tensor_shapes` describes has the shape it gives for them (no check of shapes where the
        architecture has no ``tensor_shapes``), and no layer slides over a window of no positions. Anything else is
        a ModelFileError."""
        try:
            gguf_check.check_consistency(file.architecture, file.metadata)
        except ModelFileError as e:
            raise ModelFileError(f"{file.path}: {e}") from None
        params = cls.read_params(file)
        check_tensor_shapes(cls, file, params)
        tokens, vocab = file.get(gguf.Keys.Tokenizer.LIST, None), getattr(params, "vocab", None)
        if isinstance(tokens, list) and isinstance(vocab, int) and 0 < len(tokens) < vocab:  # ids past its end
            raise ModelFileError(f"{file.path}: {len(tokens)} tokens, fewer than the {vocab} rows of its embedding")
        for layer, layout in enumerate(cls.kv_layouts(params)):
            if layout.window is not None and layout.window < 1:
                key = gguf.Keys.Attention.SLIDING_WINDOW.format(arch=file.architecture)
                stated = f" (metadata key {key} is {file.metadata[key]})" if key in file.metadata else ""
                raise ModelFileError(
                    f"{file.path}: layer {layer} slides over a window of {layout.window} positions, "
                    f"so it attends to nothing{stated}"
                )
        return params

    @classmethod
    def kv_layouts(cls, params: Any) -> list[KVLayout]:
        """One KVLayout per layer for these hyperparameters."""
        raise NotImplementedError

    @property
    def context_length(self) -> int:
        return int(self.file.get(gguf.Keys.LLM.CONTEXT_LENGTH, 4096))

    @property
    def vocab_size(self) -> int:
        """The vocabulary size (rows of the output matrix): by default the hyperparameters' ``vocab``."""
        return int(self.params.vocab)

    # -- compute -------------------------------------------------------------------------------------
    def load_weights(self, weights: Weights) -> None:
        raise NotImplementedError

    def load_classifier(self, w: Weights) -> np.ndarray | None:
        """A reranker's classifier head, for every family alike: ``cls.output.weight`` [labels, width], one row per
        ``{arch}.classifier.output_labels`` (one where the file names none), required where the file's pooling type
        is rank and read where a file of another pooling has one. On the host in float32: :meth:`leat.model.Model.rank`
        multiplies the last position's hidden state by it. (BERT-style heads, a dense layer with tanh before this
        one, belong to families with bidirectional attention, which leat has none of.)"""
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.CLS_OUT] + ".weight"
        if self.file.get(gguf.Keys.LLM.POOLING_TYPE, None) != gguf.PoolingType.RANK and not w.has(name):
            return None
        labels = self.file.get(gguf.Keys.Classifier.OUTPUT_LABELS, None) or [""]
        shape = (len(labels), int(self.file.get(gguf.Keys.LLM.EMBEDDING_LENGTH)))
        try:
            head = w.host(name, shape)
        except ModelFileError:
            raise ModelFileError(
                f"{self.file.path}: pooling type rank (a reranker) but no classifier head {name}"
            ) from None
        if head.shape != shape:
            raise ModelFileError(
                f"{self.file.path}: {name} has shape {list(head.shape)}; {len(labels)} output labels and the "
                f"embedding length make it {list(shape)}"
            )
        return head

    def forward(self, batch: Batch, kv: Any) -> Any:
        """Run the batch, writing its K/V into ``kv``; return logits [len(batch.logit_index), vocab]."""
        raise NotImplementedError

    def hidden(self, batch: Batch, kv: Any) -> Any:
        """Optional, for embeddings: run the batch as :meth:`forward` does, but return the final-normed hidden states
        [len(batch.logit_index), width] that ``forward`` would multiply by the output matrix. A family that has it
        serves ``/v1/embeddings`` (:meth:`leat.model.Model.embed`); without it, embeddings are refused."""
        raise NotImplementedError

    # -- optional: multi-token prediction (a proposer drafts with the model's own nextn layer) --------------
    def forward_hidden(self, batch: Batch, kv: Any) -> tuple[Any, Any]:
        """Optional, for proposers that read the target's states (:attr:`leat.speculative.Proposer.reads_hidden`):
        ``forward``'s logits, and the final-normed hidden state of every position of the batch [len(batch), width]
        (what :meth:`hidden` gives, before ``batch.logit_index`` picks rows)."""
        raise NotImplementedError

    def nextn_kv_layouts(self) -> list[KVLayout]:
        """Optional, with :meth:`nextn`: the KV layout of the file's multi-token-prediction layer, as a list of one;
        empty (the default) where the file has none."""
        return []

    def nextn(self, batch: Batch, hidden: Any, kv: Any) -> tuple[Any, Any]:
        """Optional: the file's multi-token-prediction layer (:mod:`leat.nextn`) on ``batch``, with layer 0 of ``kv`` (a
        cache of :meth:`nextn_kv_layouts`) as its cache. Each token x_p is paired with its row of ``hidden``
        [len(batch), width], the final-normed state after x_{p-1} (the target's, or this layer's own while drafting).
        Returns its logits (a guess at x_{p+1}) and its final-normed hidden states, for the rows ``batch.logit_index``
        picks. The layer's weights are uploaded on the first call."""
        raise NotImplementedError

    # -- test models ---------------------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> Any:
        """Hyperparameters of a tiny model for tests (overrides replace fields)."""
        raise NotImplementedError

    @classmethod
    def tensor_shapes(cls, params: Any) -> dict[str, tuple[int, ...]]:
        """Every tensor of a file with these hyperparameters: name -> numpy-order shape, in file order. By default
        what :meth:`load_weights` asks for, recorded without a file or a backend."""
        if cls.Params is None:
            raise NotImplementedError
        model = cls.__new__(cls)  # no __init__: nothing is read or uploaded
        file: Any = DescribedFile(cls.names[0], params, cls.write_metadata)
        model.file, model.params = file, params
        recorder = TensorRecorder(file)
        model.load_weights(recorder)
        model.load_classifier(recorder)
        return recorder.shapes

    @classmethod
    def write_metadata(cls, writer: gguf.GGUFWriter, params: Any) -> None:
        """The architecture's metadata keys for these hyperparameters (tokenizer keys excluded): by default as
        ``Params`` declares them."""
        if cls.Params is None:
            raise NotImplementedError
        hparams.write(writer, params)


def check_tensor_shapes(architecture: type[Architecture], file: ModelFile, params: Any) -> None:
    """Every tensor of ``file`` that ``architecture.tensor_shapes(params)`` lists has the shape listed (leading
    dimensions of 1 aside); else a ModelFileError naming the tensor, both shapes (numpy order) and the metadata keys
    that set the expected one."""
    try:
        expected = architecture.tensor_shapes(params)
    except NotImplementedError:
        return
    for name, tensor in file.tensors.items():
        shape = _shape(expected.get(name))
        if shape is None or _squeezed(tensor.shape) == _squeezed(shape):
            continue
        keys = ", ".join(_keys_behind(architecture, file, name, shape)) or "its metadata"
        raise ModelFileError(
            f"{file.path}: tensor {name} has shape {list(tensor.shape)} in the file, but the {file.architecture} "
            f"hyperparameters ({keys}) make it {list(shape)}"
        )


def _shape(shape: Any) -> tuple[int, ...] | None:
    return None if shape is None else tuple(int(d) for d in shape)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def _keys_behind(architecture: type[Architecture], file: ModelFile, name: str, shape: tuple[int, ...]) -> list[str]:
    """The file's integer ``{arch}.*`` keys, with their values, that set the shape of tensor ``name``: those for which
    a neighbouring value gives the tensor another shape. Runs only on the way to an error."""
    keys = []
    for key, value in file.metadata.items():
        if not key.startswith(f"{file.architecture}.") or not isinstance(value, int) or isinstance(value, bool):
            continue
        if {_shape_if(architecture, file, key, v, name) for v in (value - 1, value + 1)} - {None, shape}:
            keys.append(f"{key} = {value}")
    return keys


def _shape_if(architecture: type[Architecture], file: ModelFile, key: str, value: int, name: str) -> Any:
    """The shape of tensor ``name`` were ``key`` ``value``; None where the architecture then has no such tensor."""
    changed = copy.copy(file)
    changed.metadata = {**file.metadata, key: value}
    try:
        return _shape(architecture.tensor_shapes(architecture.read_params(changed)).get(name))
    except Exception:  # noqa: BLE001 - the value may be out of range, or make no model at all
        return None
