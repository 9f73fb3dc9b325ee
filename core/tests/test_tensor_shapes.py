"""Every architecture's tensors are checked against the shapes its hyperparameters give them, in core
(:meth:`leat.architecture.Architecture.checked_params`), and hyperparameters against each other
(:func:`leat.gguf_check.check_consistency`): a file at odds with itself is a one-line ModelFileError naming the tensor
or key, never a numpy error from inside ``forward``."""

import re

import gguf
import pytest
from leat import plugins
from leat.architecture import Architecture, check_tensor_shapes
from leat.errors import ModelFileError
from leat.gguf_check import check_consistency
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

K = gguf.Keys
ARCHITECTURES = sorted(
    {entry.load() for entry in plugins.host().registry["architectures"].values()}, key=lambda cls: cls.names[0]
)


@pytest.fixture(scope="module", params=ARCHITECTURES, ids=lambda cls: cls.names[0])
def tiny(request, tmp_path_factory) -> tuple[type[Architecture], ModelFile]:
    cls = request.param
    path = write_tiny_gguf(cls, tmp_path_factory.mktemp(cls.names[0]) / "tiny.gguf", gguf.GGMLQuantizationType.F32)
    return cls, ModelFile(path)


def with_value(file: ModelFile, template: str, value: object) -> ModelFile:
    """``file`` as if its metadata held ``value`` for ``template``."""
    key = template.format(arch=file.architecture)
    assert key in file.metadata
    changed = ModelFile(file.path)
    changed.metadata[key] = value
    return changed


def test_a_tiny_file_passes(tiny):
    cls, file = tiny
    assert cls.checked_params(file) == cls.read_params(file)


def test_a_head_count_at_odds_with_the_tensors_names_a_tensor_and_the_key(tiny):
    cls, file = tiny
    heads = file.get(K.Attention.HEAD_COUNT)
    key = K.Attention.HEAD_COUNT.format(arch=file.architecture)
    with pytest.raises(ModelFileError) as info:
        cls.checked_params(with_value(file, K.Attention.HEAD_COUNT, 2 * heads))
    message = str(info.value)
    assert message.startswith(f"{file.path}: tensor ") and " in the file, but the " in message, message
    assert f"{key} = {2 * heads}" in message and "\n" not in message


def test_an_architecture_without_tensor_shapes_is_not_checked(tmp_path):
    class NoShapes(Llama):
        @classmethod
        def tensor_shapes(cls, params):
            raise NotImplementedError

    file = with_value(ModelFile(write_tiny_gguf(Llama, tmp_path / "llama.gguf")), K.Attention.HEAD_COUNT, 8)
    params = NoShapes.checked_params(file)
    check_tensor_shapes(NoShapes, file, params)
    with pytest.raises(ModelFileError, match=r"tensor blk\.0\.attn_q\.weight has shape \[64, 64\] in the file"):
        Llama.checked_params(file)


def test_leading_dimensions_of_one_are_the_same_shape(tmp_path):
    class Unsqueezed(Llama):
        @classmethod
        def tensor_shapes(cls, params):
            return {
                name: (1, *shape) if len(shape) == 1 else shape for name, shape in super().tensor_shapes(params).items()
            }

    file = ModelFile(write_tiny_gguf(Llama, tmp_path / "llama.gguf"))
    check_tensor_shapes(Unsqueezed, file, Llama.read_params(file))


@pytest.mark.parametrize(
    "metadata, expected",
    [
        ({"attention.head_count": 8, "attention.head_count_kv": 3}, "head_count_kv is 3, which does not divide x.att"),
        ({"rope.dimension_count": 7, "attention.key_length": 16}, "x.rope.dimension_count is 7, an odd number"),
        ({"rope.dimension_count": 32, "attention.key_length": 16}, "is 32, more than the head size 16 (x.attention.k"),
        (
            {"rope.dimension_count": 32, "embedding_length": 64, "attention.head_count": 4},
            "is 32, more than the head size 16 (x.embedding_length / x.attention.head_count)",
        ),
        (
            {"expert_count": 4, "expert_used_count": 5},
            "x.expert_used_count is 5; with x.expert_count 4 it must be 1 to 4",
        ),
        (
            {"expert_count": 4, "expert_used_count": 0},
            "x.expert_used_count is 0; with x.expert_count 4 it must be 1 to 4",
        ),
        ({"expert_count": 0, "expert_used_count": 2}, "x.expert_used_count is 2; with x.expert_count 0 it must be 0"),
        ({"expert_count": 8, "expert_group_count": 3}, "x.expert_group_count is 3, which does not divide x.expert_cou"),
        ({"expert_group_count": 4, "expert_group_used_count": 5}, "x.expert_group_used_count is 5; with x.expert_g"),
        (
            {"attention.head_count": 0, "attention.head_count_kv": 1},
            "metadata key x.attention.head_count is 0, outside",
        ),
    ],
)
def test_inconsistent_hyperparameters(metadata, expected):
    with pytest.raises(ModelFileError) as info:
        check_consistency("x", {f"x.{key}": value for key, value in metadata.items()})
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "metadata",
    [
        {"attention.head_count": 8, "attention.head_count_kv": 2, "rope.dimension_count": 16, "embedding_length": 256},
        {"attention.head_count": [8, 8, 4], "attention.head_count_kv": 3},  # per layer: the architecture's to check
        {
            "attention.head_count": 128,
            "attention.head_count_kv": 1,
            "rope.dimension_count": 64,
            "attention.key_length": 576,
        },
        {"rope.dimension_count": 64, "attention.key_length": 64},
        {"expert_count": 0, "expert_used_count": 0},
        {"expert_count": 256, "expert_used_count": 8, "expert_group_count": 8, "expert_group_used_count": 4},
        {"expert_count": 8, "expert_group_count": 1},
    ],
)
def test_consistent_hyperparameters(metadata):
    check_consistency("x", {f"x.{key}": value for key, value in metadata.items()})


@pytest.mark.parametrize("name, slides", [("gemma2", True), ("gpt-oss", True), ("gemma3", False)])
def test_a_sliding_window_of_no_positions(name, slides, tmp_path):
    """Gemma 2 and gpt-oss slide over ``attention.sliding_window`` positions; to Gemma 3, a window of 0 means none."""
    cls = next(cls for cls in ARCHITECTURES if name in cls.names)
    file = ModelFile(write_tiny_gguf(cls, tmp_path / "tiny.gguf", params=cls.tiny(window=0)))
    if not slides:
        assert all(layout.window is None for layout in cls.kv_layouts(cls.checked_params(file)))
        return
    message = f"layer 0 slides over a window of 0 positions, so it attends to nothing (metadata key {name}.attention"
    with pytest.raises(ModelFileError, match=re.escape(message)):
        cls.checked_params(file)
