"""`leat generate` imports what it uses: no OpenSSL, no numpy.random for a greedy request, none of gguf's writing
modules. What each held of its peak RSS (issue #17) is in docs/benchmarks.md; these check the imports, not a figure."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from leat.sampling import generator
from leat.sha256 import sha256
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama

NEVER = ["_hashlib", "hmac", "secrets", "yaml", "gguf.gguf_writer", "gguf.metadata", "gguf.vocab"]
# runs `leat generate ARGS...` in this process, then prints the modules imported so far, for each argument list
CODE = """
import json, sys
from leat.cli import cli
for args in json.loads(sys.argv[1]):
    cli.main(args, prog_name="leat", standalone_mode=False)
    print("\\nMODULES " + json.dumps(sorted(sys.modules)))
"""


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[tuple[str, set[str]]]:
    """The text and the modules imported after a greedy `leat generate`, then after each of two seeded ones."""
    path = str(write_tiny_gguf(Llama, tmp_path_factory.mktemp("lean") / "tiny.gguf"))
    common = ["generate", path, "--backend", "cpu", "-p", "hello", "-n", "6"]
    runs = [[*common, "--temperature", "0"], *[[*common, "--temperature", "1", "-s", "7"]] * 2]
    command = [sys.executable, "-c", CODE, json.dumps(runs)]
    result = subprocess.run(command, check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    first, *rest = result.stdout.split("\nMODULES ")
    texts = [first] + [chunk.split("\n", 1)[1] for chunk in rest[:-1]]
    return [(text, set(json.loads(chunk.split("\n")[0]))) for text, chunk in zip(texts, rest, strict=True)]


def test_a_greedy_generate_imports_no_openssl_numpy_random_or_gguf_writer(generated):
    _, modules = generated[0]
    assert sorted(modules & {*NEVER, "numpy.random"}) == []
    assert "gguf.gguf_reader" in modules


def test_gguf_is_whole_on_first_use_of_another_name():
    code = (
        "import threading, leat, gguf\n"
        "assert type(gguf).__name__ == '_Lean' and 'GGUFWriter' not in vars(gguf)\n"
        "found = []\n"
        "threads = [threading.Thread(target=lambda: found.append(gguf.GGUFWriter)) for _ in range(4)]\n"
        "[t.start() for t in threads], [t.join() for t in threads]\n"
        "from gguf import get_tensor_name_map, Keys\n"
        "import gguf.metadata\n"
        "print(len(found), type(gguf).__name__, found[0].__module__, hasattr(gguf, 'no such name'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4", "module", "gguf.gguf_writer", "False"]


def test_seeded_sampling_imports_numpy_random_without_secrets_and_repeats(generated):
    _, (first, modules), (second, _) = generated
    assert "numpy.random" in modules and sorted(modules & set(NEVER)) == []
    assert first == second and first.strip()


def test_the_generator_is_numpys_default_for_the_seed():
    assert np.array_equal(generator(11).random(4), np.random.default_rng(11).random(4))


def test_sha256_gives_hashlibs_digests():
    for data in (b"", b"abc", bytes(range(256)) * 300):
        ours, reference = sha256(data), hashlib.sha256(data)
        assert ours.hexdigest() == reference.hexdigest()
        ours.update(b"more"), reference.update(b"more")
        assert ours.copy().digest() == reference.digest()
