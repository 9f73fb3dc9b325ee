"""Structurally invalid GGUF files are refused with one line naming the tensor or key at fault.

Each defect is made by editing the bytes of a tiny valid file (positions found by scripts/fuzz_gguf.py's ``layout``),
and the Hypothesis test at the end drives that script's mutator: every mutant either fails with a one-line LeatError
or loads into the same logits as the original (or, after a metadata value changed, into finite ones).
"""

import dataclasses
import importlib.util
import math
import subprocess
import sys
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from leat import hparams, testing
from leat.doctor import describe_model
from leat.errors import ModelFileError
from leat.modelfile import ModelFile
from leat_arch_llama.llama import Llama

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fuzz_gguf", ROOT / "scripts" / "fuzz_gguf.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_gguf"] = fuzz  # dataclasses look their module up there
_spec.loader.exec_module(fuzz)

K = gguf.Keys
F16 = gguf.GGMLQuantizationType.F16


@dataclass(frozen=True)
class Tiny:
    path: Path
    blob: bytes
    where: "fuzz.Layout"
    logits: np.ndarray

    def value_at(self, key: str) -> int:
        return self.where.hyperparameters[key.format(arch="llama")][0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    path = fuzz.tiny_model(tmp_path_factory.mktemp("tiny"))
    return Tiny(path, path.read_bytes(), fuzz.layout(path), fuzz.logits(path))


def mutant(tiny: Tiny, folder: Path, *changes, extra: bytes = b"") -> Path:
    path = folder / "mutant.gguf"
    path.write_bytes(fuzz.apply(tiny.blob, changes) + extra)
    return path


def load_error(path: Path) -> str:
    """The message of the ModelFileError that loading ``path`` (up to logits) raises: one line naming the file."""
    with pytest.raises(ModelFileError) as info:
        fuzz.logits(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    return message


def test_valid_file_loads(tiny):
    assert ModelFile(tiny.path).tensors
    np.testing.assert_array_equal(fuzz.logits(tiny.path), tiny.logits)
    assert np.isfinite(tiny.logits).all()


def test_offset_wrapping_around_2_64_does_not_read_the_header_as_weights(tiny, tmp_path):
    first = tiny.where.tensors[0]
    wrapped = fuzz.set_u64("offset", first.offset_at, 2**64 - tiny.where.data_start)
    message = load_error(mutant(tiny, tmp_path, wrapped))
    assert f"tensor {first.name}: " in message and "past the end of the file" in message


def test_aliased_tensors(tiny, tmp_path):
    first, second = tiny.where.tensors[:2]
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u64("offset", second.offset_at, first.offset)))
    assert f"tensors {first.name} and {second.name} have the same data offset" in message


def test_overlapping_tensors(tiny, tmp_path):
    first, second = tiny.where.tensors[:2]
    inside = first.offset + tiny.where.alignment
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u64("offset", second.offset_at, inside)))
    assert f"tensor {second.name} at data offset {inside} overlaps tensor {first.name}" in message


def test_misaligned_offset(tiny, tmp_path):
    second = tiny.where.tensors[1]
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u64("offset", second.offset_at, second.offset + 4)))
    assert f"tensor {second.name}: data offset {second.offset + 4} is not a multiple of general.alignment" in message


def test_type_code_whose_size_does_not_match_the_data(tiny, tmp_path):
    middle = tiny.where.tensors[len(tiny.where.tensors) // 2]
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u32("type", middle.type_at, F16)))
    assert f"the padded end of {middle.name}" in message and "type or shape" in message


def test_type_code_of_the_last_tensor_whose_size_does_not_match_the_data(tiny, tmp_path):
    last = tiny.where.tensors[-1]
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u32("type", last.type_at, F16)))
    assert f"the last tensor, {last.name}, belong to no tensor" in message


def test_unknown_type_code(tiny, tmp_path):
    second = tiny.where.tensors[1]
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u32("type", second.type_at, 1000)))
    assert f"tensor {second.name}: unknown type code 1000" in message


def test_bytes_after_the_last_tensor(tiny, tmp_path):
    message = load_error(mutant(tiny, tmp_path, extra=bytes(4096)))
    assert f"the last tensor, {tiny.where.tensors[-1].name}, belong to no tensor" in message


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_tensor_data(tiny, tmp_path, keep):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny.blob[: int(len(tiny.blob) * keep)])
    assert "past the end of the file" in load_error(path)


@pytest.mark.parametrize("at, value, what", [(8, 2**64 - 1, "tensors"), (16, 2**32, "metadata entries")])
def test_huge_counts(tiny, tmp_path, at, value, what):
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u64("count", at, value)))
    assert f"{value} {what} declared, but only" in message


def test_string_longer_than_the_file(tiny, tmp_path):
    first_key_length = fuzz.HEADER_BYTES
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u64("string", first_key_length, 2**40)))
    assert f"a string of {2**40} bytes at byte {first_key_length} runs past the end" in message


@pytest.mark.parametrize(
    "key, value",
    [
        (K.Rope.FREQ_BASE, math.nan),
        (K.Rope.FREQ_BASE, 0.0),
        (K.Rope.FREQ_BASE, -10000.0),
        (K.Attention.LAYERNORM_RMS_EPS, math.nan),
        (K.Attention.LAYERNORM_RMS_EPS, 0.0),
        (K.Attention.LAYERNORM_RMS_EPS, -1e-5),
        (K.Attention.LAYERNORM_RMS_EPS, math.inf),
        (K.Attention.HEAD_COUNT, 0),
        (K.Attention.HEAD_COUNT_KV, 0),
        (K.LLM.BLOCK_COUNT, 2**32 - 1),
        (K.LLM.EMBEDDING_LENGTH, 0),
        (K.Rope.DIMENSION_COUNT, 2**31 - 1),
    ],
)
def test_hyperparameter_out_of_range(tiny, tmp_path, key, value):
    setter = fuzz.set_f32 if isinstance(value, float) else fuzz.set_u32
    message = load_error(mutant(tiny, tmp_path, setter("hyperparameter", tiny.value_at(key), value)))
    shown = f"{value:g}" if isinstance(value, float) else value
    assert f"metadata key {key.format(arch='llama')} is {shown}" in message


ATTN_Q = "tensor blk.0.attn_q.weight has shape [32, 32] in the file, but the llama hyperparameters"


@pytest.mark.parametrize(
    "key, value, expected",
    [
        (K.Attention.HEAD_COUNT, 3, [ATTN_Q, "head_count = 3, llama.attention.key_length = 16) make it [48, 32]"]),
        (K.Attention.HEAD_COUNT, 1, [ATTN_Q, "llama.attention.key_length = 16) make it [16, 32]"]),
        (K.Attention.KEY_LENGTH, 2**16, [ATTN_Q, "llama.attention.key_length = 65536) make it [131072, 32]"]),
        (K.LLM.EMBEDDING_LENGTH, 3, ["tensor token_embd.weight has shape [272, 32] in the file", "make it [272, 3]"]),
        (K.LLM.FEED_FORWARD_LENGTH, 3, ["tensor blk.0.ffn_gate.weight has shape [64, 32] in the file"]),
    ],
)
def test_hyperparameter_at_odds_with_the_tensor_shapes(tiny, tmp_path, key, value, expected):
    """In range, but not what the tensors were made with: the tensor, both shapes and the keys, not a failed reshape."""
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u32("hyperparameter", tiny.value_at(key), value)))
    assert all(part in message for part in expected), message


@pytest.mark.parametrize(
    "key, value, expected",
    [
        (K.Attention.HEAD_COUNT_KV, 3, "head_count_kv is 3, which does not divide llama.attention.head_count 2"),
        (K.Rope.DIMENSION_COUNT, 3, "metadata key llama.rope.dimension_count is 3, an odd number"),
        (
            K.Rope.DIMENSION_COUNT,
            2**16,
            "dimension_count is 65536, more than the head size 16 (llama.attention.key_length)",
        ),
        (K.Attention.KEY_LENGTH, 1, "metadata key llama.rope.dimension_count is 16, more than the head size 1"),
    ],
)
def test_hyperparameters_at_odds_with_each_other(tiny, tmp_path, key, value, expected):
    message = load_error(mutant(tiny, tmp_path, fuzz.set_u32("hyperparameter", tiny.value_at(key), value)))
    assert expected in message, message


def test_a_per_layer_array_where_the_family_reads_one_number(tmp_path, monkeypatch):
    """Before: TypeError (int() of a tuple) while the tensors' shapes were checked."""
    write = Llama.write_metadata  # the key written per layer, as llama.cpp's loader would also read it
    per_layer = lambda writer, p: write(writer, dataclasses.replace(p, kv_heads=(p.kv_heads,) * p.layers))
    monkeypatch.setattr(Llama, "write_metadata", per_layer)
    path = testing.write_tiny_gguf(Llama, tmp_path / "m.gguf")
    assert "metadata key llama.attention.head_count_kv is an array, where this family takes one number" in load_error(
        path
    )


def test_fewer_tokens_than_embedding_rows(tmp_path, monkeypatch):
    """Before: it loaded, and the first sampled id past the tokenizer's end was a ValueError mid-generation."""
    write = testing.add_tiny_tokenizer
    monkeypatch.setattr(testing, "add_tiny_tokenizer", lambda writer, size: write(writer, size - 20))
    path = testing.write_tiny_gguf(Llama, tmp_path / "m.gguf")
    assert "280 tokens, fewer than the 300 rows of its embedding" in load_error(path)


def test_doctor_refuses_a_head_count_at_odds_with_the_tensors(tiny, tmp_path):
    path = mutant(tiny, tmp_path, fuzz.set_u32("hyperparameter", tiny.value_at(K.Attention.HEAD_COUNT), 3))
    with pytest.raises(ModelFileError, match=r"tensor blk\.0\.attn_q\.weight has shape \[32, 32\] in the file"):
        describe_model(str(path))


def test_doctor_refuses_a_huge_block_count(tiny, tmp_path):
    path = mutant(tiny, tmp_path, fuzz.set_u32("hyperparameter", tiny.value_at(K.LLM.BLOCK_COUNT), 2**32 - 1))
    with pytest.raises(ModelFileError, match="metadata key llama.block_count is 4294967295"):
        describe_model(str(path))


def test_doctor_cli_exits_non_zero_with_one_line(tiny, tmp_path):
    first = tiny.where.tensors[0]
    path = mutant(tiny, tmp_path, fuzz.set_u64("offset", first.offset_at, 2**64 - tiny.where.data_start))
    command = [sys.executable, "-m", "leat", "doctor", "-m", str(path), "--plugins", "leat-arch-llama,leat-backend-cpu"]
    result = subprocess.run(command, check=False, capture_output=True, text=True)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and f"tensor {first.name}: " in lines[0]


def write_gguf(path: Path, tensors: dict[str, np.ndarray], alignment: int | None = None) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_uint32(K.General.ALIGNMENT, alignment)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "tensors, alignment, expected",
    [
        ({"empty.weight": np.zeros((0, 4), np.float32)}, None, "tensor empty.weight: shape [4, 0] has an empty dim"),
        ({"five.weight": np.zeros((1, 1, 1, 1, 2), np.float32)}, None, "tensor five.weight: 5 dimensions, not 1 to 4"),
        ({"bad\nname": np.zeros(4, np.float32)}, None, "tensor name 'bad\\nname' is not a printable name"),
        ({"norm.weight": np.zeros(4, np.float32)}, 48, "metadata key general.alignment is 48, not a power of two"),
    ],
)
def test_malformed_tensor_infos(tmp_path, tensors, alignment, expected):
    path = write_gguf(tmp_path / "bad.gguf", tensors, alignment)
    with pytest.raises(ModelFileError) as info:
        ModelFile(path)
    assert expected in str(info.value) and "\n" not in str(info.value)


_names = count()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a mutant of another, valid, model may overflow float32
@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutants_fail_cleanly_or_load_the_same_model(tiny, tmp_path_factory, data):
    changes = fuzz.mutations(tiny.where, lambda n: data.draw(st.integers(0, n - 1)))
    note(", ".join(map(str, changes)))
    path = tmp_path_factory.getbasetemp() / f"mutant-{next(_names)}.gguf"
    path.write_bytes(fuzz.apply(tiny.blob, changes))
    category, detail = fuzz.outcome(path, tiny.logits, any(m.semantic for m in changes))
    path.unlink()
    assert category in ("clean error", "same logits", "other model"), f"{category}: {detail}"


@dataclasses.dataclass
class _Numbers:  # module level: hparams.read resolves the hints of a module's names
    one: int = hparams.key("x.one", 0)
    maybe: int | None = hparams.key("x.maybe", None)
    many: tuple[int, ...] = hparams.key("x.many", ())
    either: int | tuple[int, ...] = hparams.key("x.either", 0)


def test_an_array_is_refused_only_where_a_field_takes_one_number():
    """Before: tuple[int, ...] fields (qwen35's rope.dimension_sections) were refused too, so no such file loaded."""
    metadata = {"x.one": 1, "x.maybe": 2, "x.many": [3, 3, 2, 0], "x.either": [4, 4]}
    file = SimpleNamespace(get=lambda k, default=None: metadata.get(k, default), architecture="x", path="f", tensors={})
    assert hparams.read(_Numbers, file) == _Numbers(1, 2, (3, 3, 2, 0), (4, 4))
    for name in ("x.one", "x.maybe"):
        with pytest.raises(
            ModelFileError, match=f"metadata key {name} is an array, where this family takes one number"
        ):
            hparams.read(
                _Numbers, SimpleNamespace(**{**vars(file), "get": lambda k, d=None, n=name: [1] if k == n else d})
            )
