"""The tinygrad backend's prefill products: ``gemm.py``'s kernel with pinned optimisations, and the float16 weight
copies kept across chunks (``TinygradBackend._half_values``).

On the test device (CI: tinygrad's CPU device, no tensor cores) the kernel is checked against a float64 product written
here, with no opts and with opts the CPU can apply; on tinygrad's NULL device with NVIDIA's renderer for sm_90 (NVRTC
from the ``nvidia-cuda-nvrtc`` wheel; renders and compiles, runs nothing) the H200's opts are checked as tinygrad
applies them: its own record of the opts and the tensor cores' ``mma`` instructions in the source.

``gemm.staged_product`` (tiles staged through shared memory, NVIDIA's tensor cores only) is checked against float64 on
tinygrad's PYTHON device emulating sm_80's tensor cores, rendered and compiled for sm_90 on the NULL device, and run
against float64 where the test device has NVIDIA's tensor cores (the GPU run).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import gguf
import leat
import numpy as np
import pytest
from leat.batch import Batch, Row
from leat.compare import compare
from leat.modelfile import Tensor as FileTensor
from leat_backend_tinygrad import gemm, ring
from leat_backend_tinygrad.backend import TinygradBackend, Weight, probe_reason
from tinygrad import Device, Tensor
from tinygrad.codegen.opt import Opt, OptOps

if probe_reason() is not None:
    pytest.skip(f"tinygrad cannot run here: {probe_reason()}", allow_module_level=True)

if not os.environ.get("LEAT_TINYGRAD_TEST_OPT"):  # as test_tinygrad_backend.py: the same math, a faster cold run
    from tinygrad.helpers import NOOPT

    NOOPT.value = 1
if "PARALLEL" not in os.environ:
    from tinygrad.helpers import PARALLEL

    PARALLEL.value = 0

Q = gguf.GGMLQuantizationType
REFERENCES = Path(__file__).parents[3] / "tests" / "references"
# the 8B file's products at a 512-row chunk: (outputs, inputs)
SHAPES_8B = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A bound on a float16 product's error per output: each float16 product rounded (2^-11 relative), float32 sums."""
    return 2.0**-10 * (np.abs(x) @ np.abs(w).T) + 1e-6


@pytest.mark.parametrize("opts", [None, (), (Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 2))], ids=str)
def test_half_product_equals_the_float64_product(opts):
    # None: tinygrad's own matmul; (): our kernel with no optimisation; upcasts the CPU applies
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 64)).astype(np.float16)
    w = rng.standard_normal((24, 64)).astype(np.float16)
    got = gemm.half_product(Tensor(x), Tensor(w), opts).numpy()
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (32, 24)
    assert (np.abs(got - want) <= _bound(x.astype(np.float64), w.astype(np.float64))).all()


def test_opts_follow_the_output_size_and_need_nvidia_tensor_cores():
    assert [gemm.opts_for(n) for n in (512, 1024)] == [gemm.TC_OPTS[0][1]] * 2
    assert [gemm.opts_for(n) for n in (2048, 4096)] == [gemm.TC_OPTS[1][1]] * 2
    assert [gemm.opts_for(n) for n in (8192, 14336)] == [gemm.TC_OPTS[2][1]] * 2
    renderer = Device[Device.DEFAULT].renderer
    if gemm.cuda_81616[0] not in renderer.tensor_cores:  # the CPU device: tinygrad's own choice
        assert gemm.tuned_opts(renderer, 512, 4096, 4096) is None


STAGED = """
import json, sys
import numpy as np
from tinygrad import Tensor, dtypes
from leat_backend_tinygrad import gemm
report = []
for kinds, rows, outputs, inputs, tiles, *gated in json.loads(sys.argv[1]):
    x_kind, kind = (kinds.split("/") * 2)[:2]  # "x's/w's", or one for both
    if "float16" in kinds and sys.version_info < (3, 12):
        continue  # the PYTHON device holds float16 from Python 3.12 on
    rng = np.random.default_rng(rows + outputs)
    x = rng.standard_normal((rows, inputs)).astype(x_kind)
    w = rng.standard_normal((outputs, inputs)).astype(kind)
    tiles = gemm.Tiles(*tiles)
    if gated:  # x the gate of silu_mul, laid out with up: silu(x) * up
        up = rng.standard_normal((rows, inputs)).astype(x_kind)
        laid = gemm.laid_out(Tensor(x), tiles, getattr(dtypes, kind), Tensor(up))
        got = gemm.staged_product(Tensor(x), Tensor(w), tiles, laid).numpy()
        x = x.astype(np.float64) / (1 + np.exp(-x.astype(np.float64))) * up  # rounded in the kernel: the bound's
    else:
        got = gemm.staged_product(Tensor(x), Tensor(w), tiles).numpy()
        x = x.astype(kind)  # the values the product takes
    want = x.astype(np.float64) @ w.astype(np.float64).T
    x = x.astype(kind)
    bound = 2.0**-10 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-6
    ok = got.shape == want.shape and bool((np.abs(got - want) <= bound).all())
    report.append([kinds, rows, gated, tiles.stages, ok, float(np.abs(got - want).max())])
print("@@report", json.dumps(report), flush=True)
"""
# (kind or "x's kind/w's", rows, outputs, inputs, tiles: rows, outputs, depth, warp rows, warp outputs, pad, stages[, runs, split]): warps in
# both directions (tinygrad's four local ranges, the first two merged), in one direction (three ranges), rows the tile
# does not divide (the last tile's extra rows the last row again, stored over it), one stage and two (three and more depth steps:
# both stages taken twice, the last step's loads of itself again), the fragments read in runs (the default: x's rows
# interleaved in pairs; its padding chosen, or given) and in PTX's order (runs 0), depths of one and two 16-byte reads;
# one warp of rows with a short last tile (40 rows: tinygrad 0.14 dropped the gate of such a tile's stores); ring.py's
# three stages (here its plain copies: the PYTHON device runs no asm) over six steps (the ring taken twice) and one,
# and with the inputs split in two and three parts (three steps and two a part); a float32 x with float16 w (the
# backend's: x cast as ring.py's interleave lays it out, or beforehand for the others); "silu": x silu_mul's gate,
# laid out with its up (gemm.laid_out's up: in ring.py's interleave, or before the others)
STAGED_CASES = [
    ["float32", 100, 32, 96, [32, 16, 32, 2, 1, None, 2]],
    ["float32", 48, 64, 64, [32, 32, 16, 2, 1, None, 2]],
    ["float32", 40, 64, 64, [32, 32, 16, 1, 2, None, 2]],
    ["float32", 100, 64, 64, [32, 32, 32, 2, 2, 8, 1, 0]],
    ["float16", 100, 64, 64, [64, 32, 32, 2, 2, 8, 1]],
    ["float16", 130, 256, 192, [128, 64, 32, 4, 2, None, 2]],
    ["float16", 64, 128, 128, [64, 64, 64, 2, 2, None, 2]],
    ["float16", 130, 256, 192, [64, 128, 32, 2, 4, 8, 2, 0]],
    ["float32", 100, 64, 96, [64, 32, 16, 2, 2, None, 3]],
    ["float32", 20, 32, 16, [64, 32, 16, 2, 2, None, 3]],
    ["float16", 130, 256, 192, [128, 128, 32, 2, 2, None, 3]],
    ["float16", 64, 128, 96, [128, 128, 32, 2, 4, None, 3]],
    ["float32", 100, 64, 96, [64, 32, 16, 2, 2, None, 3, 1, 2]],
    ["float16", 130, 256, 192, [128, 128, 32, 2, 2, None, 3, 1, 3]],
    ["float32/float16", 100, 128, 64, [128, 128, 32, 2, 2, None, 3]],
    ["float32/float16", 100, 64, 64, [64, 32, 32, 2, 2, 8, 1]],
    ["float32", 100, 64, 96, [64, 32, 16, 2, 2, None, 3], "silu"],
    ["float32", 100, 64, 64, [32, 32, 32, 2, 2, 8, 1, 0], "silu"],
    ["float32/float16", 100, 128, 64, [128, 128, 32, 2, 2, None, 3], "silu"],
]


def test_staged_product_equals_the_float64_product_on_emulated_tensor_cores(tmp_path):
    """gemm.staged_product on tinygrad's PYTHON device emulating sm_80's tensor cores (a thread group's warps, shared
    memory and mma.sync's fragments as the GPU has them): float32 x and w (the tf32 m16n8k8 shape) on any Python,
    float16 (m16n8k16, the backend's) where the interpreter is 3.12 or later, against float64 within the float16
    bound. (The PYTHON device runs a thread group's threads in step: it cannot show a missing barrier; the GPU run's
    test below can.) A fragment or copy laid out wrongly puts whole products in the wrong place (errors of order 10)."""
    env = os.environ | {"DEV": "PYTHON::sm_80", "CACHEDB": str(tmp_path / "cache.db")}
    command = [sys.executable, "-c", STAGED, json.dumps(STAGED_CASES)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("@@report ")[-1])
    assert len(report) == (19 if sys.version_info >= (3, 12) else 9), report
    assert all(ok for *_, ok, _ in report), report


def test_staged_tiles_follow_the_shape_and_need_nvidia_tensor_cores():
    from tinygrad import dtypes

    # x's rows interleaved in pairs: each warp copies eights of pairs
    assert not gemm.fits(gemm.Tiles(64, 128, 32, 2, 4), 256, 64, dtypes.float16)
    assert gemm.fits(gemm.Tiles(64, 128, 32, 2, 4, runs=False), 256, 64, dtypes.float16)
    # the inputs split in parts: ring.py's kernel only, each part whole slices
    ring_tiles = gemm.Tiles(128, 128, 32, 2, 2, stages=3, split=2)
    assert gemm.fits(ring_tiles, 256, 128, dtypes.float16) and not gemm.fits(ring_tiles, 256, 96, dtypes.float16)
    assert not gemm.fits(gemm.Tiles(128, 128, 32, 2, 2, stages=2, split=2), 256, 128, dtypes.float16)
    assert gemm.Tiles.parse("128,128,32,2,2,0,3,1,2") == dataclasses.replace(ring_tiles, pad=0)
    renderer = Device[Device.DEFAULT].renderer
    if gemm.tensor_core(renderer, dtypes.float16) is None:
        assert gemm.tiles_for(renderer, 512, 4096, 4096) is None
        return
    for outputs, inputs in SHAPES_8B.values():
        tiles = gemm.tiles_for(renderer, 512, outputs, inputs)
        assert tiles is not None and gemm.fits(tiles, outputs, inputs, dtypes.float16), (outputs, tiles)
    assert gemm.tiles_for(renderer, gemm.MIN_STAGED_ROWS - 1, 4096, 4096) is None
    depth = gemm.tiles_for(renderer, 512, 4096, 4096).depth
    assert gemm.tiles_for(renderer, 512, 4096, 4096 + depth // 2) is None  # inputs the tiles' depth does not divide


def test_ring_tiles_split_the_inputs_of_products_with_few_thread_groups():
    from tinygrad import dtypes
    from tinygrad.codegen.opt import tc

    hopper = types.SimpleNamespace(tensor_cores=tc.get_cuda("sm_90"))  # all tiles_for reads of a renderer

    def split(rows: int, outputs: int, inputs: int, groups: int) -> int:
        tiles = gemm.tiles_for(hopper, rows, outputs, inputs, split_groups=groups)
        assert tiles is not None and gemm.fits(tiles, outputs, inputs, dtypes.float16)
        return tiles.split

    # 128 x 128 tiles: 512 rows of o or down are 4 x 32 = 128 thread groups, of q, k and v as one 4 x 48, of gate 4 x 112
    assert [split(512, 4096, 14336, n) for n in (0, 128, 129, 256, 257, 512)] == [1, 1, 2, 2, 4, 4]
    assert [split(512, 6144, 4096, n) for n in (192, 193, 384, 385)] == [1, 2, 2, 4]
    assert split(512, 14336, 4096, 448) == 1 and split(512, 14336, 4096, 449) == 2
    assert split(512, 4096, 32 * 3, 256) == 1  # neither two nor four parts of whole 32-input slices: unsplit
    assert split(512, 4096, 32 * 6, 512) == 2  # two parts, not four: the most that fit, short of the groups asked
    assert split(100, 4096, 4096, 129) == 4  # one tile of rows (the last one's extra rows repeat the last)
    # the default: o and down in two parts, q, k and v as one (192 groups) and gate and up (448) whole
    defaults = [gemm.tiles_for(hopper, 512, n, k).split for n, k in ((4096, 4096), (4096, 14336), (6144, 4096))]
    assert defaults + [gemm.tiles_for(hopper, 512, 14336, 4096).split] == [2, 2, 1, 1]
    chosen = gemm.Tiles(128, 128, 32, 2, 2, stages=3)
    assert gemm.tiles_for(hopper, 512, 4096, 4096, chosen=chosen, split_groups=10**6) == chosen  # taken as it is


KINDS_OF_STAGE = (
    gemm.Tiles(128, 128, 64, 2, 4, stages=1),
    gemm.Tiles(128, 128, 32, 2, 4, stages=2, runs=False),
    gemm.Tiles(128, 128, 32, 2, 4, stages=3),  # ring.py's: cp.async on CUDA
    gemm.Tiles(128, 128, 32, 2, 2, stages=3, split=2),  # the inputs in two parts, summed after
)


@pytest.mark.parametrize("rows", [512, 300])
def test_staged_product_on_the_device_equals_the_float64_product(rows):
    """On a device with NVIDIA's tensor cores (the GPU run), the backend's staged products at the 8B file's shapes
    against float64 within the float16 bound; 300 rows: a last tile of rows past the end."""
    from tinygrad import dtypes

    renderer = Device[Device.DEFAULT].renderer
    if gemm.tensor_core(renderer, dtypes.float16) is None:
        pytest.skip(f"no NVIDIA float16 tensor cores on {Device.DEFAULT}")
    rng = np.random.default_rng(rows)
    for outputs, inputs in [SHAPES_8B["k/v"], SHAPES_8B["gate/up"], SHAPES_8B["down"]]:
        x = rng.standard_normal((rows, inputs)).astype(np.float16)
        w = rng.standard_normal((outputs, inputs)).astype(np.float16)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        bound = _bound(x.astype(np.float64), w.astype(np.float64))
        # the backend's tiles, and every kind of stage (a barrier or a wait missing shows here: threads run as they do)
        for tiles in (gemm.tiles_for(renderer, rows, outputs, inputs), *KINDS_OF_STAGE):
            got = gemm.staged_product(Tensor(x), Tensor(w), tiles).numpy()
            assert got.shape == want.shape and (np.abs(got - want) <= bound).all(), (outputs, tiles)


def _nvrtc() -> Path | None:
    """libnvrtc.so.13 of the nvidia-cuda-nvrtc wheel (the CUDA backend's dependency), or None."""
    import site

    for folder in site.getsitepackages():
        if (path := Path(folder) / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13").exists():
            return path
    return None


RENDER = """
import json, sys
from tinygrad import Device, Tensor, dtypes
from leat_backend_tinygrad import gemm
renderer, report = Device[Device.DEFAULT].renderer, {}
for name, rows, outputs, inputs in json.loads(sys.argv[1]):
    x = Tensor.empty(rows, inputs, dtype=dtypes.float16).realize()
    w = Tensor.empty(outputs, inputs, dtype=dtypes.float16).realize()
    opts = gemm.tuned_opts(renderer, rows, outputs, inputs)
    report[name] = None if opts is None else [str(o) for o in opts]
    print("@@product", name, flush=True)
    gemm.half_product(x, w, opts).realize()
    print("@@plain", name, flush=True)  # tinygrad's own matmul, and our kernel left to tinygrad's heuristic
    x.matmul(w.T, dtype=dtypes.float32).realize()
    out = Tensor.empty(rows, outputs, dtype=dtypes.float32)
    out.custom_kernel(x, w, fxn=gemm._kernel(rows, outputs, inputs, None))[0].realize()
print("@@report", json.dumps(report), flush=True)
"""


def test_the_h200s_opts_render_tensor_core_kernels_for_sm_90(tmp_path):
    if (nvrtc := _nvrtc()) is None:
        pytest.skip("no libnvrtc.so.13 (the nvidia-cuda-nvrtc wheel: uv sync --all-extras)")
    shapes = [[name, 512, *shape] for name, shape in SHAPES_8B.items()]
    shapes += [["1B gate/up (7 does not divide 8192)", 512, 8192, 2048], ["128 rows", 128, 4096, 4096]]
    env = os.environ | {"DEV": "NULL:CUDA:sm_90", "NVRTC_PATH": str(nvrtc), "DEBUG": "4"}
    env["CACHEDB"] = str(tmp_path / "cache.db")
    command = [sys.executable, "-c", RENDER, json.dumps(shapes)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    text = done.stdout
    report = json.loads(text.split("@@report ")[-1])
    assert all(report[name] is not None for name in SHAPES_8B) and report["128 rows"] is None, report
    assert report["1B gate/up (7 does not divide 8192)"] is None, report
    for name, *_ in shapes:
        product, plain = text.split(f"@@product {name}\n")[1].split(f"@@plain {name}\n")
        plain = plain.split("@@")[0]
        applied = [line.split(" opts: ")[1] for line in product.splitlines() if " opts: " in line]
        if report[name] is not None:  # tinygrad's record of the opts it applied: ours, as a tensor-core kernel
            assert applied == [f"({', '.join(report[name])})"], applied
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in product
        # our kernel left to tinygrad's heuristic is tinygrad's own matmul kernel (the same name: a cache hit)
        assert len(_launched(plain)) == 2 and len(set(_launched(plain))) == 1, plain[:2000]
        assert (_launched(product) == _launched(plain)[:1]) == (report[name] is None), (product[:2000], plain[:2000])


STAGED_RENDER = """
import json, sys
from tinygrad import Device, Tensor, dtypes
from leat_backend_tinygrad import gemm
renderer, report = Device[Device.DEFAULT].renderer, {}
for name, rows, outputs, inputs in json.loads(sys.argv[1]):
    tiles = gemm.tiles_for(renderer, rows, outputs, inputs)
    report[name] = None if tiles is None else repr(tiles)
    print("@@staged", name, flush=True)
    x = Tensor.empty(rows, inputs, dtype=dtypes.float16).realize()
    w = Tensor.empty(outputs, inputs, dtype=dtypes.float16).realize()
    gemm.staged_product(x, w, tiles).realize()
print("@@report", json.dumps(report), flush=True)
"""


def test_the_staged_products_render_and_compile_for_sm_90(tmp_path):
    """The backend's staged products at the 8B file's shapes (512 rows, and 300: rows the tile does not divide) as
    NVRTC compiles them for sm_90 on tinygrad's NULL device: each a kernel of float16 mma.sync, ring.py's loop with
    its copies asynchronous and one barrier a step (three in all: after the first slice's copy, at the loop's end,
    after the last wait), within 48 KB of shared memory."""
    if (nvrtc := _nvrtc()) is None:
        pytest.skip("no libnvrtc.so.13 (the nvidia-cuda-nvrtc wheel: uv sync --all-extras)")
    shapes = [[f"{name} {rows}", rows, *shape] for name, shape in SHAPES_8B.items() for rows in (512, 300)]
    env = os.environ | {"DEV": "NULL:CUDA:sm_90", "NVRTC_PATH": str(nvrtc), "DEBUG": "4"}
    env["CACHEDB"] = str(tmp_path / "cache.db")
    command = [sys.executable, "-c", STAGED_RENDER, json.dumps(shapes)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("@@report ")[-1])
    assert all(tiles is not None and f"stages={ring.STAGES}" in tiles for tiles in report.values()), report
    for name, *_ in shapes:
        source = done.stdout.split(f"@@staged {name}\n")[1].split("@@")[0]
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source, source[:2000]
        assert source.count("__syncthreads();") == 3 and "cp.async.cg.shared.global" in source, source[:4000]
        shared = [int(n) for n in re.findall(r"__shared__ __align__\(16\) half buf\d+\[(\d+)\]", source)]
        assert len(shared) == 2 and 0 < 2 * sum(shared) <= gemm.SHARED_LIMIT, shared


def _launched(text: str) -> list[str]:
    """The kernels tinygrad's DEBUG output says it ran (``*** DEVICE N name ...``), by name."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()
    return [line.split()[3] for line in lines if line.startswith("*** ")]


def _tiny_models():
    spec = importlib.util.spec_from_file_location("leat_tests_tiny_models", REFERENCES / "tiny_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weights(obj):
    """The Weights in a model's (nested) dataclasses and lists."""
    if isinstance(obj, Weight):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _weights(item)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _weights(getattr(obj, f.name))


def _prefill(path: str, monkeypatch, budget: int):
    """A tiny Llama-3 Q4_K model's prompt on the tinygrad backend with float16 prefill products (as on a GPU) and
    ``budget`` bytes of float16 copies: a 5-token chunk run eagerly (below the products' 17 rows: no copies; its rope
    spec seen, so the next jit's first call is its capture), then three 32-token chunks under one TinyJit (captured at
    the first: the copies are made inside its capture; then replayed). The model, its logits and the kernels each
    chunk ran."""
    from tinygrad.helpers import Context, GlobalCounters

    for key, value in {"HALF": "1", "GEMM_ROWS": "17", "PREFILL_JIT": "16,32", "F16_BUDGET": str(budget)}.items():
        monkeypatch.setenv(f"LEAT_TINYGRAD_{key}", value)
    model = leat.load(path, backend="tinygrad")
    backend, forward = model.backend, model.architecture.forward
    layouts = model.architecture.kv_layouts(model.architecture.params)
    kv = backend.allocate_kv(layouts, slots=1, context=104, pages=26, page_size=4)
    backend.set_pages(kv, 0, np.arange(26))
    ids = np.arange(1, 102)
    logits, kernels = [backend.to_host(forward(Batch([Row(0, 0, ids[:5])]), kv))], []  # eager: no jit's first call
    with Context(JIT=2):  # no graphs: a replayed graph (CUDA) counts as one kernel, so each kernel is counted
        for start in (5, 37, 69):
            count = GlobalCounters.kernel_count
            logits.append(backend.to_host(backend.run(forward, Batch([Row(0, start, ids[start : start + 32])]), kv)))
            kernels.append(GlobalCounters.kernel_count - count)
    assert backend._jits[(forward, id(kv), "prefill", 32, False)].cnt == 4  # from 1: captured, replayed twice
    return model, np.concatenate(logits), kernels


def test_prefill_weights_float16_copies_are_made_once_outside_the_jit(tmp_path, monkeypatch):
    path = str(_tiny_models().build("q4_k-llama3", tmp_path / "tiny.gguf"))
    copied, got, kernels = _prefill(path, monkeypatch, 1 << 30)
    _, want, plain = _prefill(path, monkeypatch, 0)
    layers = copied.architecture.layers
    halves = [w for w in _weights([layers, copied.architecture.output]) if w.half is not None]
    # every quantized matrix of the layers (7 a layer; not the output's, a one-row product), each its dequantized
    # values in float16 (gguf's, independently)
    assert len(halves) == 7 * len(layers)
    for w in halves:
        want_half = gguf.quants.dequantize(np.asarray(w.host), w.qtype).reshape(w.shape).astype(np.float16)
        np.testing.assert_array_equal(w.half.numpy(), want_half)
    assert copied.backend.allocations.by_type["F16 copies"] == sum(2 * w.half.numel() for w in halves)
    # the replays run the products from the copies: one dequantization kernel fewer per copy, not one more (a copy
    # made inside the capture would be made again at each replay), and the same logits, bit for bit
    assert [p - k for p, k in zip(plain[1:], kernels[1:])] == [len(halves)] * 2, (plain, kernels)
    np.testing.assert_array_equal(got, want)
    oracle = leat.load(path, backend="cpu", precision="f64")
    positions = [4, *range(36, 101, 32)]
    agreement = compare(oracle.logits(list(range(1, 102)), native=True)[positions], got, label="float16 copies")
    assert not agreement.failures(top1=0.99, kl=1e-3), f"{agreement}"


def test_float16_copies_stop_at_the_budget(monkeypatch):
    monkeypatch.setenv("LEAT_TINYGRAD_F16_BUDGET", str(2 * 24 * 512 + 100))
    monkeypatch.setenv("LEAT_TINYGRAD_HALF", "1")
    monkeypatch.setenv("LEAT_TINYGRAD_GEMM_ROWS", "4")
    backend = TinygradBackend()
    rng = np.random.default_rng(5)
    stored = [rng.integers(0, 256, (24, 512 // 32 * 34), dtype=np.uint8) for _ in range(2)]
    for s in stored:
        s.reshape(24, 16, 34)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    weights = [backend.upload(FileTensor(f"w{i}", Q.Q8_0, (24, 512), s)) for i, s in enumerate(stored)]
    x = rng.standard_normal((8, 512)).astype(np.float16).astype(np.float64)  # float16 values: x is cast to them
    for weight, s in zip(weights, stored):
        w = gguf.quants.dequantize(s, Q.Q8_0).reshape(24, 512).astype(np.float16)
        w = w.astype(np.float64)
        got = backend.matmul(x.astype(np.float32), weight).numpy()
        assert (np.abs(got - x @ w.T) <= _bound(x, w)).all()
    assert weights[0].half is not None and weights[1].half is None  # the second past the budget: copied per product
    assert backend.f16_budget == 100


@pytest.fixture
def laid(monkeypatch) -> list:
    """The backend's staged products at 16 rows and more, its float16 copies kept; the tiles of each gemm.laid_out
    call listed (with its ``up``, where given). Without NVIDIA's tensor cores (CI's CPU device) the plain float16
    product of the laid-out x stands in for the staged kernel (the same sums): what is checked there is what the
    backend asks of the kernels; the GPU run checks the staged kernel itself (the emulated cases, the rest)."""
    import leat_backend_tinygrad.backend as module
    from tinygrad import dtypes

    for key, value in {"HALF": "1", "GEMM_ROWS": "16", "F16_BUDGET": str(1 << 30)}.items():
        monkeypatch.setenv(f"LEAT_TINYGRAD_{key}", value)
    if gemm.tensor_core(Device[Device.DEFAULT].renderer, dtypes.float16) is None:
        monkeypatch.setattr(module, "tiles_for", lambda *args, **kwargs: gemm.Tiles())

        # the staged kernel takes x of any float type as w's, or x laid out (Tiles(): cast, contiguous)
        def staged(x, w, tiles, laid=None):
            return gemm.half_product(x.cast(w.dtype).contiguous() if laid is None else laid, w)

        monkeypatch.setattr(module, "staged_product", staged)
    laid_out, calls = module.laid_out, []

    def spy(x, tiles, kind, up=None):
        calls.append(tiles if up is None else (tiles, up))
        return laid_out(x, tiles, kind, up)

    monkeypatch.setattr(module, "laid_out", spy)
    return calls


def test_products_of_one_x_are_one_staged_product_of_their_copies_side_by_side(laid, monkeypatch):
    """``matmuls`` of a prompt chunk (a layer's q, k and v): one staged product of the weights' float16 copies side
    by side, the copy made once and kept, each output the weight's own product (float64 within the float16 bound) plus
    its bias; few rows: each weight's own product; outputs past gemm.JOINED_OUTPUTS (gate and up): each weight's own
    staged product of one x laid out once (gemm.laid_out: ring.py's interleave); 80 rows: a short last tile."""
    import leat_backend_tinygrad.backend as module

    backend = TinygradBackend()
    rng = np.random.default_rng(7)
    inputs, weights, values = 256, [], []
    # outputs of whole 128-wide tiles: on the GPU each apart takes the tiles the others do (one x laid out for all)
    for i, (qtype, outputs, block) in enumerate([(Q.Q8_0, 128, 34), (Q.Q4_0, 128, 18), (Q.Q8_0, 128, 34)]):
        stored = rng.integers(0, 256, (outputs, inputs // 32 * block), dtype=np.uint8)
        stored.reshape(outputs, inputs // 32, block)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
        weights.append(backend.upload(FileTensor(f"w{i}", qtype, (outputs, inputs), stored)))
        values.append(gguf.quants.dequantize(stored, qtype).reshape(outputs, inputs).astype(np.float16))
    bias = rng.standard_normal(128).astype(np.float32)
    biases = [None, backend.from_host(bias), None]
    x = rng.standard_normal((80, inputs)).astype(np.float16).astype(np.float64)  # float16 values: x is cast to them
    for _ in range(2):  # the second call takes the kept copy
        got = [t.numpy() for t in backend.matmuls(backend.from_host(x.astype(np.float32)), weights, biases)]
        for out, w, b in zip(got, values, [0.0, bias, 0.0]):
            w = w.astype(np.float64)
            assert out.shape == (80, len(w)) and (np.abs(out - b - x @ w.T) <= _bound(x, w) + 1e-5).all()
    ((kept, copy),) = backend._joined.values()
    assert kept == tuple(weights) and all(w.half is None for w in weights)
    np.testing.assert_array_equal(copy.numpy(), np.concatenate(values))
    assert backend.allocations.by_type["F16 copies"] == 2 * 384 * inputs
    few = backend.matmuls(backend.from_host(x[:8].astype(np.float32)), weights[:2])  # under GEMM_ROWS: each its own
    assert [t.shape for t in few] == [(8, 128), (8, 128)] and len(backend._joined) == 1
    assert not laid
    monkeypatch.setattr(module, "JOINED_OUTPUTS", 383)  # outputs past the bound (gate and up): each its own product
    apart = [t.numpy() for t in backend.matmuls(backend.from_host(x.astype(np.float32)), weights)]
    assert [t.shape for t in apart] == [(80, 128)] * 3 and len(backend._joined) == 1
    assert all(w.half is not None for w in weights) and len(laid) == 1  # x laid out once for the three
    for out, w in zip(apart, values):
        w = w.astype(np.float64)
        assert (np.abs(out - x @ w.T) <= _bound(x, w) + 1e-5).all()


def test_a_chunks_norm_and_silu_mul_are_laid_out_by_their_own_kernels_for_the_next_staged_products(laid, monkeypatch):
    """A prompt chunk's feed-forward block: rms_norm, gate and up (one staged product), silu_mul, down. Where the norm
    is norm.py's kernel (a device with thread groups) and the products ring.py's, the norm's kernel writes x in the
    ring's layout (norm.rms_norm_laid_out); silu(gate) * up is computed as down's x is laid out (gemm.laid_out with
    ``up``: ring.py's interleave on the GPU). Gate and up are the float64 products of the float64 norm, down that of
    the activation of the gate and up the backend made, each within the float16 bound."""
    from leat_backend_tinygrad import norm, ring

    normed = []
    made = norm.rms_norm_laid_out
    monkeypatch.setattr(norm, "rms_norm_laid_out", lambda *args: normed.append(args) or made(*args))
    backend = TinygradBackend()
    rng = np.random.default_rng(11)
    inputs, hidden, weights, values = 256, 256, [], []  # 80 rows, whole 128-wide tiles: staged products on the GPU
    for i, (outputs, width) in enumerate([(hidden, inputs), (hidden, inputs), (inputs, hidden)]):  # gate, up, down
        stored = rng.integers(0, 256, (outputs, width // 32 * 34), dtype=np.uint8)
        stored.reshape(outputs, width // 32, 34)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
        weights.append(backend.upload(FileTensor(f"w{i}", Q.Q8_0, (outputs, width), stored)))
        values.append(gguf.quants.dequantize(stored, Q.Q8_0).reshape(outputs, width).astype(np.float16))
    x = rng.standard_normal((80, inputs)).astype(np.float32)
    scale = rng.standard_normal(inputs).astype(np.float32)
    gate, up = backend.matmuls(backend.rms_norm(backend.from_host(x), scale, 1e-5), weights[:2])
    y = backend.matmul(backend.silu_mul(gate, up), weights[2])
    assert laid[-1][1] is up and not backend._layouts  # down's x laid out with up; nothing left unconsumed
    on_ring = isinstance(laid[-1][0], gemm.Tiles) and laid[-1][0].stages == ring.STAGES
    assert len(normed) == (1 if on_ring and norm.applies(backend.from_host(x)) else 0)
    x64 = x.astype(np.float64)
    n = (x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + 1e-5) * scale).astype(np.float16).astype(np.float64)
    for out, w in zip((gate, up), values):
        w = w.astype(np.float64)
        assert (np.abs(out.numpy() - n @ w.T) <= 2 * _bound(n, w) + 1e-5).all()  # (the norm's float32 rounding too)
    g, u = gate.numpy().astype(np.float64), up.numpy().astype(np.float64)
    act, w = g / (1 + np.exp(-g)) * u, values[2].astype(np.float64)
    assert (np.abs(y.numpy() - act @ w.T) <= _bound(act, w) + 1e-5).all()
