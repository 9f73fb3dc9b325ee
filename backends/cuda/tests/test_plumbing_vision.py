"""Images through the backend's host side against test_plumbing's fake driver (no GPU): a tiny Gemma 3 model takes
a tiny mmproj on the CUDA backend (no refusal), the encoder's launches match their kernels' PTX signatures, and an
image's row runs eagerly through ``run`` (no graph captured of it) while the decode step after it is captured."""

import importlib.util
from pathlib import Path

import gguf
import numpy as np
from leat.batch import Batch, Row
from leat.modelfile import ModelFile
from leat.testing import encode_png, write_tiny_gguf, write_tiny_mmproj
from leat.vision import Vision

_spec = importlib.util.spec_from_file_location("cuda_test_plumbing", Path(__file__).with_name("test_plumbing.py"))
plumbing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plumbing)
fake = plumbing.fake


def test_an_image_encodes_and_its_row_runs_eagerly(fake, tmp_path):
    from leat_arch_gemma.gemma import Gemma3
    from leat_backend_cuda.backend import CUDABackend

    params = Gemma3.tiny(window=8, pattern=2)
    backend = CUDABackend()
    model = Gemma3(ModelFile(write_tiny_gguf(Gemma3, tmp_path / "gemma3.gguf", params=params)), backend)
    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf", params.width, gguf.VisionProjectorType.GEMMA3)
    vision = Vision(mmproj, backend, params.width, Gemma3.projectors)
    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    span = vision.span(3, encode_png(pixels))
    embeddings = vision.embeddings(span)
    assert embeddings.shape == (span.length, params.width)
    launched = [f for f, _, _ in fake.launches]
    layers = 2  # write_tiny_mmproj's encoder
    assert launched.count("layer_norm") == 2 * layers + 1 and launched.count("gelu") == layers
    assert sum("attention_open" in f for f in launched) == layers and "gelu_mul" not in launched

    kv = backend.allocate_kv(Gemma3.kv_layouts(model.params), slots=1, context=32, dtype="f16")
    backend.run(model.forward, Batch([Row(0, 0, np.arange(3))]), kv)
    captured = len(fake.captured)
    fake.launches.clear()
    image = Row(0, 3, np.zeros(span.length, np.int64), bidirectional=True, inputs=embeddings)
    out = backend.run(model.forward, Batch([image]), kv)
    assert out.shape == (1, params.vocab) and len(fake.captured) == captured and not backend.graph_failures
    launched = [f for f, _, _ in fake.launches]
    assert "graph" not in launched and sum("attention_open" in f for f in launched) == params.layers
    backend.run(model.forward, Batch([Row(0, 3 + span.length, np.array([5]))]), kv)
    assert len(fake.captured) == captured + 1 and not any("attention_open" in f for f in fake.captured[-1])
