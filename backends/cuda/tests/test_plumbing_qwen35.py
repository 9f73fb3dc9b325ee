"""Qwen3.5's recurrent layers through the backend's host side against test_plumbing's fake driver (no GPU): the tiny
model loads on the CUDA backend (no refusal), every deltanet launch matches its kernel's PTX signature, the decode
step's graph holds the delta-net's launches and each replay counts the rows' positions as taken in, and a row that
does not continue its slot's state is refused before anything runs. The numbers are test_deltanet_on_host.py's and
the GPU tests' (test_gpu_qwen35.py)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.modelfile import ModelFile
from leat.testing import write_tiny_gguf

_spec = importlib.util.spec_from_file_location("cuda_test_plumbing", Path(__file__).with_name("test_plumbing.py"))
plumbing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plumbing)
fake = plumbing.fake


def count(launched: list[str], kernel: str) -> int:
    return sum(kernel in name for name in launched)  # templates' names are mangled


def test_qwen35_prefill_then_decode_graphs_keep_the_recurrent_state(fake, tmp_path):
    qwen35 = pytest.importorskip("leat_arch_qwen35.qwen35")
    from leat_backend_cuda.backend import CUDABackend

    backend = CUDABackend()
    architecture = qwen35.Qwen35
    model = architecture(ModelFile(write_tiny_gguf(architecture, tmp_path / "qwen35.gguf")), backend)
    linear = sum(model.params.linear(i) for i in range(model.params.layers))
    kv = backend.allocate_kv(architecture.kv_layouts(model.params), slots=2, context=32)
    for step, rows in enumerate([[(1, 0, 5), (0, 0, 3)], [(0, 3, 1), (1, 5, 1)], [(0, 4, 1), (1, 6, 1)]]):
        out = backend.run(model.forward, Batch([Row(s, p, np.arange(n)) for s, p, n in rows]), kv)
        assert out.shape[-1] == model.params.vocab
        taken = [p + n for _, p, n in sorted(rows)]
        assert sorted(kv.recurrent) == [i for i in range(model.params.layers) if model.params.linear(i)]
        assert all(list(state.taken) == taken for state in kv.recurrent.values()), step
    assert len(fake.captured) == 2 and not backend.graph_failures  # the prefill's graph, the decode step's (replayed)
    for graph in fake.captured:
        assert count(graph, "deltanet_conv") == count(graph, "deltanet_recurILi16") == linear
        assert graph.count("sigmoid_mul") == model.params.layers - linear  # the full layers' output gates
    fake.launches.clear()
    with pytest.raises(LeatError, match="cannot continue at position 4"):
        backend.run(model.forward, Batch([Row(0, 4, np.array([1])), Row(1, 7, np.array([1]))]), kv)
    assert not fake.launches and all(list(state.taken) == [5, 7] for state in kv.recurrent.values())
