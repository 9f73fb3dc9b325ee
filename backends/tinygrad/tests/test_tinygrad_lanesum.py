"""``lanesum.py``: the lanes of a result summed by a butterfly. Where the butterfly's lanes lie among a thread
group's hardware threads (tinygrad's own mapping of ranges to thread indices), its sums on tinygrad's PYTHON device
against float64 (through local memory: the exchanges a CUDA warp makes with ``__shfl_xor_sync``), and the CUDA
kernels with shuffles rendered and compiled for sm_90 (NVRTC, no GPU)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
from leat_backend_tinygrad.backend import probe_reason

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

from leat_backend_tinygrad import intx, lanesum, norm
from leat_backend_tinygrad.gemv import GATED_SHAPE, LAYOUTS, Shape, Threads, as_words, gemv
from tinygrad import Tensor
from tinygrad.codegen.gpudims import get_grouped_dims
from tinygrad.uop.ops import Ops

Q = gguf.GGMLQuantizationType
CUDA_LOCAL_MAX = (1024, 1024, 64)  # CUDA's block dimensions' limits (tinygrad's CUDARenderer.local_max)


def hardware_order(ranges: list) -> list[tuple[int, ...]]:
    """For each hardware thread of a group (threadIdx.x fastest, as a warp's lanes are numbered), the value of each
    of ``ranges`` (in the given order) there: tinygrad's ``get_grouped_dims``, which maps a kernel's thread ranges,
    sorted by axis id, to CUDA's three dimensions."""
    ranked = sorted((r for r in ranges if r.vmax > 0), key=lambda r: r.arg[0:-1])  # a range of one folds into 0
    idxs = get_grouped_dims("lidx", tuple(int(r.vmax) + 1 for r in ranked), CUDA_LOCAL_MAX)
    specials = sorted({u for x in idxs for u in x.toposort() if u.op is Ops.SPECIAL}, key=lambda u: u.arg)
    dims = [int(s.src[0].arg) for s in specials]
    order = []
    for t in range(int(np.prod(dims))):
        coords, rest = [], t
        for d in dims:
            coords.append(rest % d)
            rest //= d
        values = dict(
            zip(
                ranked,
                (
                    int(x.substitute(dict(zip(specials, map(specials[0].const_like, coords)))).simplify().arg)
                    for x in idxs
                ),
            )
        )
        order.append(tuple(values.get(r, 0) for r in ranges))
    return order


def assert_butterfly_stays_in_a_result(lanes: lanesum.Lanes) -> None:
    """Every aligned run of ``within`` hardware threads holds one result's lanes of one warp, each once: an exchange
    with the lane ``bit`` away (bit < within) never leaves the result."""
    inner = lanes.ranges
    others = [*([lanes.warps] if lanes.warps is not None else []), *lanes.outer]
    within = int(np.prod([int(r.vmax) + 1 for r in inner]))
    assert within <= lanesum.WARP and lanesum.WARP % within == 0
    order = hardware_order(inner + others)
    for start in range(0, len(order), within):
        run = order[start : start + within]
        assert len({t[len(inner) :] for t in run}) == 1, run  # one result, one warp
        assert len({t[: len(inner)] for t in run}) == within, run  # each of its lanes once


SHAPES = [Shape(), Shape(32, 4, 2), Shape(64, 4, 2), GATED_SHAPE, Shape(16, 1, 1)]


@pytest.mark.parametrize("qtype", list(LAYOUTS), ids=lambda q: q.name)
def test_a_products_lanes_are_an_aligned_run_of_a_warps_threads(qtype):
    for shape, blocks in itertools.product(SHAPES, (2, 16, 56)):
        threads = Threads.make(LAYOUTS[qtype], 4096, blocks, True, shape, "shuffle")
        if threads.lane_set.mode == "shuffle":
            assert_butterfly_stays_in_a_result(threads.lane_set)
        else:  # lanes not a power of two (blocks of an odd count a step): tinygrad's group reduce
            assert blocks % 2 or shape.lanes < int(np.prod(LAYOUTS[qtype].units))


def test_a_norms_lanes_are_an_aligned_run_of_a_warps_threads():
    for k in (512, 2048, 4096, 8192):
        for n in {norm.lanes(k), norm.run_lanes(k)} - {None}:
            lanes = lanesum.Lanes.make((n,), 1, "shuffle", True)
            assert lanes.mode == "shuffle" and (lanes.warps is not None) == (n > lanesum.WARP)
            assert_butterfly_stays_in_a_result(lanes)
    assert lanesum.Lanes.make((28,), 1, "shuffle", True).mode == "group"  # 896 / 32 runs: not a power of two


def test_the_mode_is_checked(monkeypatch):
    monkeypatch.setenv("LEAT_TINYGRAD_LANE_SUM", "warp")
    with pytest.raises(ValueError, match="LEAT_TINYGRAD_LANE_SUM"):
        lanesum.mode("PYTHON")
    monkeypatch.setenv("LEAT_TINYGRAD_LANE_SUM", "shuffle")
    with pytest.raises(ValueError, match="CUDA"):
        lanesum.mode("PYTHON")  # the shuffle is CUDA's intrinsic
    monkeypatch.delenv("LEAT_TINYGRAD_LANE_SUM")
    assert lanesum.mode("PYTHON") == "group"


def test_a_device_without_thread_groups_sums_in_a_loop(cpu_device, monkeypatch):
    monkeypatch.setenv("LEAT_TINYGRAD_LANE_SUM", "shuffle")
    assert lanesum.mode(cpu_device) == "group"  # no thread groups: the lanes are a loop whatever the setting


def _blocks(qtype: Q, outputs: int, k: int, rng) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    stored = rng.integers(0, 256, (outputs, k // block, size), dtype=np.uint8)
    if qtype == Q.Q6_K:
        stored[..., -2:] = np.array([0.01], np.float16).view(np.uint8)
    else:  # Q4_K
        stored[..., :4] = np.array([0.02, 0.01], np.float16).view(np.uint8)
    return stored


# (type, shape, epilogue, integer x): the gated unit's 64 lanes (two warps a result), 32 lanes (one warp), the default
# 16 lanes in 4 groups (two results a warp); float and integer x
CASES = [
    (Q.Q4_K, GATED_SHAPE, "glu", False),
    (Q.Q6_K, Shape(32, 2, 2), "residual", True),
    (Q.Q4_K, Shape(), "", True),
]


@pytest.mark.parametrize(("qtype", "shape", "epilogue", "integer"), CASES)
def test_butterfly_products_on_thread_groups_against_float64(qtype, shape, epilogue, integer, monkeypatch):
    monkeypatch.setenv("LEAT_TINYGRAD_LANE_SUM", "local")
    rng = np.random.default_rng(int(qtype) + len(epilogue))
    outputs, k, rows = 16, 1024, 2
    stored = [_blocks(qtype, outputs, k, rng) for _ in range(2 if epilogue == "glu" else 1)]
    w = [gguf.quants.dequantize(s.reshape(outputs, -1), qtype).reshape(outputs, k).astype(np.float64) for s in stored]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    residual = rng.standard_normal((rows, outputs)).astype(np.float32)
    words = [Tensor(as_words(s, qtype), device="PYTHON").realize() for s in stored]
    xt = Tensor(x, device="PYTHON").realize()
    x_in = intx.quantize(xt) if integer else xt
    if integer:  # the products of x as its integers: the reference multiplies those
        q = x_in  # its words and scales as the device's quantize made them (test_tinygrad_intx.py checks those)
        pairs = q.words.numpy().view(np.int16).reshape(rows, k).astype(np.float64)
        x64 = pairs * np.repeat(q.scales.numpy().astype(np.float64), intx.RUN, axis=1)
    else:
        x64 = x.astype(np.float64)
    extra = {"up": words[1]} if epilogue == "glu" else {}
    if epilogue == "residual":
        extra = {"residual": Tensor(residual, device="PYTHON").realize()}
    got = gemv(x_in, words[0], qtype, shape, **extra).numpy()
    want = x64 @ w[0].T
    if epilogue == "glu":
        want = want / (1 + np.exp(-want)) * (x64 @ w[1].T)
    elif epilogue == "residual":
        want = want + residual
    scale = np.abs(x64) @ np.abs(w[0]).T  # float32 sums: a few epsilons of the sum of magnitudes
    assert (np.abs(got - want) <= 2e-6 * scale * (1 + (np.abs(x64) @ np.abs(w[-1]).T))).all()


def test_butterfly_norm_on_thread_groups_against_float64(monkeypatch):
    monkeypatch.setenv("LEAT_TINYGRAD_LANE_SUM", "local")
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 512)) * 4).astype(np.float32)  # 128 lanes: four warps a row
    w = rng.standard_normal(512).astype(np.float32)
    got = norm.rms_norm(Tensor(x, device="PYTHON").realize(), Tensor(w, device="PYTHON").realize(), 1e-5).numpy()
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


RENDER = """
import json, sys
from tinygrad import Tensor, dtypes
from leat_backend_tinygrad import intx, norm, softmax
from leat_backend_tinygrad.gemv import GATED_SHAPE, Shape, gemv, gemv_segments, LAYOUTS
import gguf
Q = gguf.GGMLQuantizationType
def words(qtype, outputs, k):
    size = LAYOUTS[qtype].block_bytes(qtype) // LAYOUTS[qtype].word.itemsize
    return Tensor.empty(outputs, k // 256, size, dtype=LAYOUTS[qtype].word).realize()
x = Tensor.empty(1, 4096, dtype=dtypes.float32).realize()
q = intx.quantize(x)
print("@@kernel glu", flush=True)
gemv(q, words(Q.Q4_K, 1024, 4096), Q.Q4_K, GATED_SHAPE, up=words(Q.Q4_K, 1024, 4096)).realize()
print("@@kernel residual", flush=True)
gemv(q, words(Q.Q6_K, 1024, 4096), Q.Q6_K, Shape(32, 4, 2), residual=Tensor.empty(1, 1024).realize()).realize()
print("@@kernel segments", flush=True)
for t in gemv_segments(x, [words(Q.Q4_K, 512, 4096), words(Q.Q4_K, 128, 4096)], Q.Q4_K):
    t.realize()
print("@@kernel norm", flush=True)
y, quantized = norm.rms_norm_quantized(x, Tensor.empty(4096).realize(), 1e-5)
y.realize()
print("@@kernel softmax", flush=True)  # 528 keys: 64 lanes a row, two warps
scores = Tensor.empty(8, 4, 512, 528, dtype=dtypes.float32).realize()
softmax.probabilities(scores, Tensor.empty(512, dtype=dtypes.int32).realize(), 0, 0.1, kind=dtypes.float16).realize()
print("@@kernel partial", flush=True)  # 512 values in runs of 32: 16 threads, half a warp
y, quantized = norm.rms_norm_quantized(Tensor.empty(1, 512).realize(), Tensor.empty(512).realize(), 1e-5)
y.realize()
print("@@done", flush=True)
"""


def test_the_shuffles_render_and_compile_for_sm_90(tmp_path):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("nvidia")
    found = (
        [p for d in (spec.submodule_search_locations or []) for p in Path(d).glob("cu*/lib/libnvrtc.so*")]
        if spec
        else []
    )
    if not found:
        pytest.skip("no libnvrtc.so (the nvidia-cuda-nvrtc wheel: uv sync --all-extras)")
    env = os.environ | {"DEV": "NULL:CUDA:sm_90", "NVRTC_PATH": str(found[0]), "DEBUG": "4", "NULL_ALLOW_COPYOUT": "1"}
    env["CACHEDB"] = str(tmp_path / "cache.db")
    env.pop("LEAT_TINYGRAD_LANE_SUM", None)  # the default on CUDA's renderer: shuffles
    command = [sys.executable, "-c", RENDER]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "@@done" in done.stdout, done.stderr[-4000:]
    parts = dict(part.split("\n", 1) for part in done.stdout.split("@@kernel ")[1:])
    # each sum a butterfly of log2(lanes in a warp) shuffles: the gated unit's 4 sums of 64 lanes (5 each, then two
    # warps added in local memory), the Q6_K product's 2 of 32 (5 each), the segments' 2 of 64 (640 outputs: lanes
    # doubled to 64, Shape.for_product), the norm's 1 of 128 lanes
    counts = {name: text.count("__shfl_xor_sync(0xffffffffu") for name, text in parts.items()}
    # and the softmax's max, then its sum (5 each)
    assert counts == {"glu": 20, "residual": 10, "segments": 10, "norm": 5, "softmax": 10, "partial": 0}, counts
    # a thread group of 16 threads: the mask names those (the other 16 of the warp do not exist)
    assert parts["partial"].count("__shfl_xor_sync(0xffffu") == 4, parts["partial"][-3000:]
