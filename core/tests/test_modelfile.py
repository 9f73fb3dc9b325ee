import subprocess
import sys

import gguf
import numpy as np
import pytest
from leat.errors import ModelFileError, UnknownArchitecture
from leat.model import architecture_class
from leat.modelfile import ModelFile
from leat.plugins import PluginHost
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(Llama, tmp_path_factory.mktemp("m") / "tiny.gguf")


def leat(*args):
    return subprocess.run([sys.executable, "-m", "leat", *args], check=False, capture_output=True, text=True)


def test_reads_metadata_and_tensors_without_copying(tiny):
    f = ModelFile(tiny)
    assert f.architecture == "llama"
    assert f.get("{arch}.block_count") == 2
    embd = f.tensor("token_embd.weight")
    assert embd.shape == (300, 64) and embd.qtype == gguf.GGMLQuantizationType.F32
    assert isinstance(embd.data.base, np.memmap) or isinstance(embd.data, np.memmap)


def test_split_gguf_loads_from_first_part(tmp_path, tiny):
    source = ModelFile(tiny)
    writer = gguf.GGUFWriter(tmp_path / "split.gguf", "llama", split_max_tensors=8)
    for key in ("llama.block_count", "llama.embedding_length"):
        writer.add_uint32(key, source.metadata[key])
    for t in source.tensors.values():
        writer.add_tensor(t.name, np.asarray(t.data).reshape(t.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(tmp_path.glob("split-*.gguf"))
    assert len(parts) == 3, parts
    f = ModelFile(parts[0])
    assert len(f.parts) == 3 and set(f.tensors) == set(source.tensors)
    np.testing.assert_array_equal(f.tensor("output_norm.weight").data, source.tensor("output_norm.weight").data)
    parts[2].unlink()
    with pytest.raises(ModelFileError, match="missing part"):
        ModelFile(parts[0])


def test_not_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        ModelFile(bad)


def test_truncated(tmp_path, tiny):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[: tiny.stat().st_size - 1000])
    with pytest.raises(ModelFileError, match="truncated"):
        ModelFile(cut)


def test_truncated_header(tmp_path, tiny):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(ModelFileError, match="malformed or truncated"):
        ModelFile(cut)


def test_missing_key_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "nokey.gguf", "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match="missing metadata key llama.block_count"):
        Llama.read_params(ModelFile(tmp_path / "nokey.gguf"))


def test_unknown_architecture_names_installed_and_plugin(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "q.gguf", "qwen3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    only_llama = PluginHost(["leat-arch-llama"])  # leat-arch-qwen3 may be installed: leave it out
    with pytest.raises(UnknownArchitecture, match=r"'qwen3'.*installed: llama.*leat-arch-qwen3"):
        architecture_class(ModelFile(tmp_path / "q.gguf"), only_llama)


@pytest.mark.parametrize("content, message", [(b"garbage!", "not a GGUF file"), (None, "no such file")])
def test_cli_reports_one_line_without_traceback(tmp_path, content, message):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    result = leat("generate", "-m", str(path), "-p", "hi", "-n", "1")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_cli_unknown_architecture_one_line(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "g.gguf", "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = leat("doctor", "-m", str(tmp_path / "g.gguf"), "--plugins", "leat-arch-llama,leat-backend-cpu")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "architecture 'gemma3' is not served" in result.stderr and "leat-arch-gemma" in result.stderr
