"""The backend's host side against a fake CUDA driver: no GPU needed.

Kernels really compile (NVRTC), but the driver calls are recorded instead of run, and every
launch is checked against the kernel's PTX signature: argument count, and float, integer or
pointer in each slot. This catches plumbing mistakes (argument order, shapes, graph capture
flow) on machines without a GPU; the GPU tests check the numbers.
"""

import gc
import importlib.util
import re
import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.errors import LeatError
from leat.modelfile import ModelFile, Tensor
from leat.testing import write_tiny_gguf
from leat_arch_llama.llama import Llama
from leat_backend_cuda import driver
from leat_backend_cuda.backend import CUDABackend, KVCache

Q = gguf.GGMLQuantizationType


class FakeDriver:
    """The cu* functions the backend calls, recording launches; enums come from cuda.bindings."""

    def __init__(self):
        from cuda.bindings import driver as real

        self.real = real
        self.launches: list[tuple[str, tuple, int]] = []
        self.capturing = False
        self.freed: list[tuple[int, bool]] = []  # (pointer, freed while capturing)
        self.captured: list[list[str]] = []
        self.next_ptr = 1 << 32
        self.allocated = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    ok = property(lambda self: self.real.CUresult.CUDA_SUCCESS)

    def cuInit(self, flags):
        return (self.ok,)

    def cuDeviceGetCount(self):
        return self.ok, 1

    def cuDeviceGet(self, ordinal):
        return self.ok, 0

    def cuDevicePrimaryCtxRetain(self, dev):
        return self.ok, object()

    def cuCtxSetCurrent(self, ctx):
        return (self.ok,)

    def cuDeviceGetAttribute(self, attr, dev):
        a = self.real.CUdevice_attribute
        values = {
            a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9,
            a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
            a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132,
            a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
        }
        return self.ok, values[attr]

    def cuDeviceGetName(self, length, dev):
        return self.ok, b"Fake H200\0"

    def cuDriverGetVersion(self):
        return self.ok, 13000

    def cuStreamCreate(self, flags):
        return self.ok, self.real.CUstream(0x5157)  # a real handle: CUlaunchConfig takes no other

    def cuMemAlloc(self, size):
        ptr = self.next_ptr
        self.next_ptr += -(-size // 4096) * 4096
        self.allocated += size
        return self.ok, ptr

    def cuMemFree(self, ptr):
        self.freed.append((ptr, self.capturing))  # a free synchronizes the device: inside a capture it ends it
        return (self.ok,)

    def cuMemGetInfo(self):
        return self.ok, 100 << 30, 140 << 30

    def cuMemcpyHtoDAsync(self, dst, src, size, stream):
        assert not self.capturing, "host-to-device copy inside a graph capture"
        return (self.ok,)

    def cuMemcpyDtoHAsync(self, dst, src, size, stream):
        return (self.ok,)

    def cuMemcpyDtoDAsync(self, dst, src, size, stream):
        return (self.ok,)

    def cuMemsetD8Async(self, dst, value, size, stream):
        return (self.ok,)

    def cuMemHostAlloc(self, size, flags):
        buffer = np.zeros(size, np.uint8)
        self.host_buffers = [*getattr(self, "host_buffers", []), buffer]
        return self.ok, buffer.ctypes.data

    def cuMemFreeHost(self, ptr):
        return (self.ok,)

    def cuEventCreate(self, flags):
        return self.ok, object()

    def cuEventRecord(self, event, stream):
        return (self.ok,)

    def cuEventSynchronize(self, event):
        assert not self.capturing, "waiting for an event inside a graph capture"
        return (self.ok,)

    def cuEventDestroy(self, event):
        return (self.ok,)

    def cuStreamSynchronize(self, stream):
        assert not self.capturing, "synchronize inside a graph capture"
        return (self.ok,)

    def cuModuleLoadData(self, image):
        assert image[:4] == b"\x7fELF"
        return self.ok, "module"

    def cuModuleGetFunction(self, module, name):
        return self.ok, name.decode()

    def cuFuncSetAttribute(self, function, attr, value):
        assert value <= 232448
        return (self.ok,)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        assert min(gx, gy, gz) >= 1 and gy < 65536 and gz < 65536 and 32 <= bx <= 1024 and bx % 32 == 0, (
            f,
            gx,
            gy,
            gz,
            bx,
        )
        self.launches.append((f, (gx, gy, gz), bx))
        if self.capturing:
            self.captured[-1].append(f)
        return (self.ok,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, function, block, smem):
        return self.ok, 4

    def cuStreamBeginCapture(self, stream, mode):
        self.capturing = True
        self.captured.append([])
        return (self.ok,)

    def cuStreamEndCapture(self, stream):
        self.capturing = False
        return self.ok, "graph"

    def cuGraphInstantiate(self, graph, flags):
        return self.ok, "exec"

    def cuGraphLaunch(self, exec_, stream):
        self.launches.append(("graph", (1, 1, 1), 0))
        return (self.ok,)


def _check_types(kernel, args):
    for kind, arg in zip(kernel.params, args):
        if kind == ".f32":
            assert isinstance(arg, float), (kernel.name, kernel.params, args)
        elif kind in (".u32", ".s32"):
            assert isinstance(arg, int | np.integer) and not isinstance(arg, bool), (kernel.name, kind, arg)
        else:
            assert not isinstance(arg, float), (kernel.name, kind, arg)


@pytest.fixture
def fake(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("LEAT_HOME", str(tmp_path_factory.getbasetemp() / "leat-home"))
    monkeypatch.setenv("LEAT_CUDA_WGMMA", "0")  # the fake device is sm_90: the paths these tests check, not gemm_wg
    fake = FakeDriver()
    monkeypatch.setattr(driver, "_cu", lambda: fake)
    monkeypatch.setattr(driver, "_local", types.SimpleNamespace())
    original = driver.Kernel.__call__

    def checked(self, grid, block, *args, smem=0):
        _check_types(self, args)
        return original(self, grid, block, *args, smem=smem)

    monkeypatch.setattr(driver.Kernel, "__call__", checked)
    return fake


def kernel_name(symbol: str) -> str:
    """A recorded launch's kernel: an extern "C" symbol as it is, a template's name from its mangled symbol
    (``_Z<length><name>I...``)."""
    mangled = re.match(r"_Z(\d+)", symbol)
    return symbol[mangled.end() : mangled.end() + int(mangled[1])] if mangled else symbol


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F32])
def test_forward_prefill_decode_and_graph(fake, tmp_path, qtype):
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", qtype)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=3, context=64, dtype="f16")
    assert isinstance(kv, KVCache) and backend.allocations.kv > 0 and backend.allocations.weights > 0

    prefill = Batch([Row(0, 0, np.arange(20) % 300), Row(1, 0, np.arange(3))])
    logits = model.forward(prefill, kv)
    assert logits.shape == (2, model.params.vocab)
    names = {f for f, _, _ in fake.launches}
    assert any(n.startswith("_Z4gemm") for n in names)  # 23 tokens: the tensor-core path

    fake.launches.clear()
    decode = Batch([Row(0, 20, np.array([5])), Row(1, 3, np.array([7]))])
    eager = model.forward(decode, kv)
    backend.to_host(eager)
    steps = [f for f, _, _ in fake.launches if f != "attention_combine"]
    # quantized weights: norms, residual adds and the gated unit run inside the matrix-vector products
    if qtype != Q.F32:
        assert not {"rms_norm", "add", "silu_mul"} & {f for f, _, _ in fake.launches}
        # per layer one launch each for q+k+v, o (+ residual), gate+up (+ norm), down (+ residual)
        products = [f for f, _, _ in fake.launches if f.startswith("_Z6gemv_q")]
        assert len(products) == 4 * model.params.layers + 1
    # RoPE of q and k and the cache write: one launch a layer
    assert len([f for f in steps if f.startswith("_Z13rope_kv_writeItLb0E")]) == model.params.layers
    assert not [f for f in steps if f == "rope" or f.startswith("_Z8kv_write")]
    out = backend.run(model.forward, decode, kv)
    assert not backend.graph_failures
    assert out.shape == eager.shape == (2, model.params.vocab)
    # the same launches (a graph splits attention over the cache's whole capacity, so it may combine)
    assert len(fake.captured) == 1 and [f for f in fake.captured[0] if f != "attention_combine"] == steps
    fake.launches.clear()
    backend.run(model.forward, Batch([Row(1, 4, np.array([1])), Row(0, 21, np.array([2]))]), kv)
    assert [f for f, _, _ in fake.launches] == ["graph"]  # replayed: one launch, no capture
    assert len(fake.captured) == 1
    backend.to_host(out)


def test_decode_attention_cuts_each_tokens_range_not_the_launchs(fake, tmp_path, monkeypatch):
    """A captured one-token step's attention is launched with as many splits as the cache's whole context calls for
    (the graph replays at every depth), so the kernel must cut each token's own range: it gets ATTENTION_SPLIT_KEYS,
    the unit a split's keys are rounded to, not the launch's split (which would leave a token near the start of a long
    cache to the first split alone); a prefill's attention_wide still gets the split of its span."""
    from leat_backend_cuda.backend import ATTENTION_SPLIT_KEYS

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=1, context=8192, dtype="f32")
    launch, seen = driver.Kernel.__call__, []

    def call(self, grid, block, *args, **kw):
        if self.name.split("<")[0] in ("attention", "attention_wide"):  # (..., window, split or keys, scale, ...)
            seen.append((self.name.split("<")[0], grid[2], args[-4]))
        return launch(self, grid, block, *args, **kw)

    monkeypatch.setattr(driver.Kernel, "__call__", call)
    model.forward(Batch([Row(0, 0, np.arange(100) % 300)]), kv)  # a prefill of 100 tokens, eagerly
    wide = [s for s in seen if s[0] == "attention_wide"]
    assert wide and {(z, split) for _, z, split in wide} == {(2, 64)}  # its 100 positions in two splits of 64
    seen.clear()
    backend.run(model.forward, Batch([Row(0, 100, np.array([5]))]), kv)  # captured for the cache's 8,192 positions
    assert not backend.graph_failures
    decode = [s for s in seen if s[0] == "attention"]
    assert len(decode) == 2 * model.params.layers  # the eager pass before the capture, then the capture
    # 2 KV heads: 132 splits would make two blocks a multiprocessor; 8,192 positions in 132 splits, rounded up to a
    # multiple of 32, is 128 splits of 64 (the launch's split, which the kernel no longer takes)
    assert {(z, keys) for _, z, keys in decode} == {(128, ATTENTION_SPLIT_KEYS)}, decode


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_decode_attention_on_tensor_cores_launches(fake, tmp_path, monkeypatch, kv_dtype):
    """By default, a captured one-token step of 64-dim heads (36 over 2 KV heads: 18 a KV head, blocks of 16 and 2)
    launches flash.cu's attention_tc, with its PTX signature's arguments, ATTENTION_TC_KEYS as the unit of its splits,
    and attention_combine's merge; a prefill keeps attention_wide or flash."""
    from leat_backend_cuda.backend import ATTENTION_TC_KEYS

    monkeypatch.delenv("LEAT_CUDA_ATTENTION_TC", raising=False)
    params = Llama.tiny(width=36 * 64, heads=36, kv_heads=2, head_dim=64, context=4096)
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0, params=params)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=1, context=4096, dtype=kv_dtype)
    launch, seen = driver.Kernel.__call__, []

    def call(self, grid, block, *args, **kw):
        if "attention" in self.name:
            seen.append((self.name, tuple(grid), args[-4] if self.name.startswith("attention_tc") else None))
        return launch(self, grid, block, *args, **kw)

    monkeypatch.setattr(driver.Kernel, "__call__", call)
    model.forward(Batch([Row(0, 0, np.arange(100) % 300)]), kv)
    assert seen and not any(name.startswith("attention_tc") for name, *_ in seen)
    seen.clear()
    backend.run(model.forward, Batch([Row(0, 100, np.array([5]))]), kv)
    assert not backend.graph_failures
    tc = [s for s in seen if s[0].startswith("attention_tc")]
    kind = {"f16": "u16", "q8_0": "i8"}[kv_dtype]
    assert len(tc) == 2 * model.params.layers and {(s[0], s[1][:2], s[2]) for s in tc} == {
        (f"attention_tc<{kind}, 64>", (1, 2 * 2), ATTENTION_TC_KEYS)
    }
    splits = tc[0][1][2]
    assert splits > 1 and [s[1][0] for s in seen if s[0] == "attention_combine"] == [36] * len(tc)


@pytest.mark.parametrize(
    "switch,kv_heads,tensor_cores", [(None, 2, True), (None, 12, False), ("0", 2, False), ("1", 12, True)]
)
def test_decode_attention_kernel_by_group_and_switch(fake, tmp_path, monkeypatch, switch, kv_heads, tensor_cores):
    """A decode step takes attention_tc where a KV head has at least ATTENTION_TC_MIN_GROUP query heads (36 over 2:
    18; over 12: 3 takes the SIMT kernel); LEAT_CUDA_ATTENTION_TC=0 never takes it, =1 at any group size."""
    if switch is None:
        monkeypatch.delenv("LEAT_CUDA_ATTENTION_TC", raising=False)
    else:
        monkeypatch.setenv("LEAT_CUDA_ATTENTION_TC", switch)
    params = Llama.tiny(width=36 * 64, heads=36, kv_heads=kv_heads, head_dim=64, context=256)
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0, params=params)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=1, context=256, dtype="f16")
    fake.launches.clear()
    model.forward(Batch([Row(0, 10, np.array([5]))]), kv)
    decode = {kernel_name(f) for f, _, _ in fake.launches if "attention" in f} - {"attention_combine"}
    assert decode == ({"attention_tc"} if tensor_cores else {"attention"})


def test_steps_with_prefill_chunks_replay_a_graph(fake, tmp_path):
    """A step that carries a prompt's chunk beside decode rows is captured once per (tokens, logits) bucket and
    replayed after; a chunk deep into a long prompt runs eagerly (its tile-wise attention is cheaper)."""
    from leat_backend_cuda.backend import FLAT_ATTENTION_BUDGET

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=3, context=4096, dtype="f16")
    mixed = Batch([Row(0, 20, np.array([5])), Row(1, 0, np.arange(70) % 300), Row(2, 9, np.array([3]))])
    out = backend.run(model.forward, mixed, kv)
    assert not backend.graph_failures and out.shape == (3, model.params.vocab)
    assert [k[2:] for k in backend._captured] == [(96, 3)]  # 72 tokens, 3 logits rows
    fake.launches.clear()
    again = Batch([Row(2, 10, np.array([4])), Row(0, 21, np.array([6])), Row(1, 70, np.arange(80) % 300)])
    backend.run(model.forward, again, kv)
    assert [f for f, _, _ in fake.launches] == ["graph"]
    fake.launches.clear()
    start = FLAT_ATTENTION_BUDGET // 100
    deep = Batch([Row(0, 22, np.array([7])), Row(1, start, np.arange(100) % 300)])
    backend.run(model.forward, deep, kv)
    assert "graph" not in [f for f, _, _ in fake.launches] and len(fake.captured) == 1


def test_prefill_steps_past_the_per_token_buckets_replay_a_graph_with_tiled_attention(fake, tmp_path):
    """A step of more than TILED_GRAPH_TOKENS tokens is captured with flash attention, its tiles made on the device
    (flash_tiles, then flash_attention, in the capture: the eager run before it keeps its own tiles out of the
    graph), and replayed for such a step at any depth; a latent (MLA) cache's steps of that size stay eager."""
    from leat_backend_cuda.backend import TILED_GRAPH_TOKENS

    params = Llama.tiny(heads=4, kv_heads=2, head_dim=64, width=256, context=4096)
    path = write_tiny_gguf(Llama, tmp_path / "hd64.gguf", Q.Q8_0, params=params)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=2, context=4096, dtype="f16")
    n = TILED_GRAPH_TOKENS + 44
    fake.launches.clear()
    backend.run(model.forward, Batch([Row(0, 0, np.arange(n) % 300)]), kv)
    assert not backend.graph_failures and [k[2:] for k in backend._captured] == [(384, 1)]
    captured = fake.captured[0]
    assert captured.count("flash_tiles") == 1 and sum("flash_attention" in f for f in captured) == model.params.layers
    fake.launches.clear()
    deep = Batch([Row(1, 3000, np.arange(n) % 300)])  # far past the per-token graphs' attention budget
    backend.run(model.forward, deep, kv)
    assert [f for f, _, _ in fake.launches] == ["graph"]
    latent = backend.allocate_kv([KVLayout(1, 64, 48, latent=True)] * 2, slots=1, context=1024, dtype="f16")
    assert backend._graph_shape(Batch([Row(0, 0, np.arange(n) % 300)]), latent) is None


def test_q8_0_kv_and_top_k(fake, tmp_path):
    """A q8_0 cache: scale planes beside the quants, its kernels (a prefill of 32-dimension heads takes
    attention_wide: the tensor-core kernel has 64 and 128), a replayed decode step; top_k's launch and host arrays."""
    path = write_tiny_gguf(Llama, tmp_path / "hd32.gguf", Q.Q8_0, params=Llama.tiny(head_dim=32))
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=2, context=64, pages=6, dtype="q8_0")
    assert len(kv.k) == len(kv.k_scale) == len(kv.v_scale) == model.params.layers
    assert kv.k_scale[0].nbytes * 16 == kv.k[0].nbytes == 6 * 16 * model.params.kv_heads * 32
    backend.set_pages(kv, 0, np.array([3, 1]))
    model.forward(Batch([Row(0, 0, np.arange(20) % 300)]), kv)
    names = {f for f, _, _ in fake.launches}
    assert any("kv_writeIa" in n for n in names) and any("attention_wideIa" in n for n in names)  # a: signed char
    assert not any("flash" in n for n in names)
    out = backend.run(model.forward, Batch([Row(0, 20, np.array([5]))]), kv)
    assert not backend.graph_failures
    values, ids = backend.top_k(out, 40)
    assert values.shape == ids.shape == (1, 40) and ids.dtype == np.int64
    assert "top_k_rows" in {f for f, _, _ in fake.launches}
    assert len(backend.read_pages(kv, [3])) == 4 * model.params.layers


def test_a_prefill_over_a_q8_0_cache_takes_the_tensor_core_attention(fake, tmp_path):
    """Heads of 64 dimensions: a prefill over a q8_0 cache runs flash_attention<i8, 64> (its scale planes passed, the
    argument types checked against the kernel's), as one over an f16 cache runs flash_attention<u16, 64>; neither
    falls back to attention_wide."""
    path = write_tiny_gguf(Llama, tmp_path / "hd64.gguf", Q.Q8_0, params=Llama.tiny(head_dim=64))
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    for dtype, kind in (("q8_0", "a"), ("f16", "t")):  # mangled: a signed char, t unsigned short
        kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=1, context=64, dtype=dtype)
        fake.launches.clear()
        model.forward(Batch([Row(0, 0, np.arange(20) % 300)]), kv)
        names = [f for f, _, _ in fake.launches]
        flash = [f for f in names if "flash_attention" in f]
        assert len(flash) == model.params.layers and all(f"flash_attentionI{kind}Li64E" in f for f in flash), flash
        assert not any("attention_wide" in f for f in names)


class RecordingCublas:
    """cuBLAS's one call, recorded (the real library needs a GPU)."""

    version = 0

    def __init__(self):
        self.calls: list[tuple[int, int, int, int, int, int, int]] = []

    def gemm_f16(self, w, x, y, m, n, k, ldy):
        self.calls.append((w, x, y, m, n, k, ldy))


def test_products_of_many_tokens_go_to_cublas_a_chunk_of_rows_at_a_time(fake):
    """From ``cublas_min_tokens`` tokens a product decodes the weight to f16 rows (at most the scratch's
    worth per cuBLAS call), writes each chunk's columns of the output, then applies x's scales once."""
    rng = np.random.default_rng(3)
    rows, cols, n = 75, 256, 40
    data = rng.standard_normal((rows, cols)).astype(np.float32)
    backend = CUDABackend(use_cublas=False)
    weight = backend.upload(Tensor("w", Q.Q8_0, (rows, cols), gguf.quants.quantize(data, Q.Q8_0)))
    x = backend.from_host(rng.standard_normal((n, cols)))
    backend.cublas = RecordingCublas()
    backend._f16_weights = driver.Memory(20 * cols * 2)  # 20 rows a chunk: 20, 20, 20, 15
    backend.cublas_min_tokens = n
    fake.launches.clear()
    out = backend.matmul(x, weight)
    assert out.shape == (n, rows)
    names = [f for f, _, _ in fake.launches]
    assert sum(f.startswith("_Z14dequantize_f16I5TQ8_0") for f in names) == 4
    assert names[0] == "x_to_f16" and names[-1] == "scale_rows_bias"
    chunks = [(y - out.ptr) // 4 for _, _, y, _, _, _, _ in backend.cublas.calls]
    assert chunks == [0, 20, 40, 60]
    assert [c[3] for c in backend.cublas.calls] == [20, 20, 20, 15]
    assert all(c[4:] == (n, cols, rows) and c[0] == backend._f16_weights.ptr for c in backend.cublas.calls)
    fake.launches.clear()
    backend.cublas.calls.clear()
    backend.matmul(backend.from_host(rng.standard_normal((n - 1, cols))), weight)  # fewer: the own kernels
    assert not backend.cublas.calls and any(f.startswith("_Z9gemm_rows") for f, _, _ in fake.launches)


def gemv_q_launches(fake, monkeypatch):
    """Record the launches from here on; the function returned gives (rows a warp, units, mode, threads, shared memory)
    of each gemv_q<struct, tokens, rows a warp, units, mode> launched since (the template's integers from the mangled
    symbol)."""
    launch, shared = fake.cuLaunchKernel, []

    def recorded(f, gx, gy, gz, bx, by, bz, smem, *rest):
        shared.append(smem)
        return launch(f, gx, gy, gz, bx, by, bz, smem, *rest)

    monkeypatch.setattr(fake, "cuLaunchKernel", recorded)
    fake.launches.clear()
    return lambda: [
        (*(int(v) for v in re.findall(r"Li(\d+)E", f)[1:]), threads, smem)
        for (f, _, threads), smem in zip(fake.launches, shared, strict=True)
        if kernel_name(f) == "gemv_q"
    ]


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_one_token_products_split_over_k_unless_switched_off(fake, tmp_path, monkeypatch, switch):
    """By default (LEAT_CUDA_GEMV_SPLIT unset or 1) a one-token decode step's products of few rows without the gated
    unit launch
    gemv_q's split variants (GEMV_Q_SPLIT in the mode) with 8 warps a block and the reduction's shared memory after
    x's: q, k and v with the RoPE epilogue and the norm inside, o and down with the residual, the output matrix with
    the norm (every product of the tiny model has fewer than 4,096 rows: two rows a warp, one unit); gate and up stay
    whole. With 0 none is split; a bad value is refused."""
    from leat_backend_cuda import quants

    if switch is None:
        monkeypatch.delenv("LEAT_CUDA_GEMV_SPLIT", raising=False)
    else:
        monkeypatch.setenv("LEAT_CUDA_GEMV_SPLIT", switch)
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=1, context=64, dtype="f16")
    model.forward(Batch([Row(0, 0, np.arange(5))]), kv)
    launched = gemv_q_launches(fake, monkeypatch)
    backend.to_host(model.forward(Batch([Row(0, 5, np.array([7]))]), kv))
    products = launched()
    split = quants.GEMV_Q_SPLIT if switch != "0" else 0
    threads = quants.gemv_q_threads(split)
    assert threads == (256 if switch != "0" else 128)
    norm, glu, rope = quants.GEMV_Q_NORM, quants.GEMV_Q_GLU, quants.GEMV_Q_ROPE
    width, ffn = model.params.width, model.params.ffn  # o's rows are as long as the others' (4 heads of 16)

    def smem(cols: int) -> int:  # x's, and the reduction's of 2 rows a warp where split
        return quants.gemv_q_smem(Q.Q8_0, 1, cols, 2 if split else 0)

    units = 1 if split else 2  # the split shape of fewer than 4,096 rows: (2, 1)
    layer = [
        (2, units, norm | rope | split, threads, smem(width)),  # q, k and v: 128 rows
        (2, units, split, threads, smem(width)),  # o, the residual added
        (2, 2, norm | glu, 128, quants.gemv_q_smem(Q.Q8_0, 1, width)),  # gate and up
        (2, units, split, threads, smem(ffn)),  # down, the residual added
    ]
    output = (2, units, norm | split, threads, smem(width))
    assert sorted(products) == sorted(layer * model.params.layers + [output])
    for bad in ("2", "on", "yes"):
        monkeypatch.setenv("LEAT_CUDA_GEMV_SPLIT", bad)
        with pytest.raises(LeatError, match="LEAT_CUDA_GEMV_SPLIT"):
            CUDABackend()


@pytest.mark.parametrize("switch", [None, "1", "4"])
def test_runs_ahead_compiles_the_products_program_with_its_define(fake, tmp_path, monkeypatch, switch):
    """LEAT_CUDA_RUNS_AHEAD=N above 1 compiles matmul.cu (gemv_q: its prologue's quantize_runs) with
    -DLEAT_RUNS_AHEAD=N and no other program with it; unset or 1 compiles every program as before (no define). Values
    outside 1-8 are refused."""
    from leat_backend_cuda import compiler

    if switch is None:
        monkeypatch.delenv("LEAT_CUDA_RUNS_AHEAD", raising=False)
    else:
        monkeypatch.setenv("LEAT_CUDA_RUNS_AHEAD", switch)
    built, compile_program = [], compiler.compile_program

    def recorded(file, names, arch, extra=(), **kw):
        built.append((file, tuple(extra)))
        return compile_program(file, names, arch, extra, **kw)

    monkeypatch.setattr(compiler, "compile_program", recorded)
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=1, context=16, dtype="f16")
    backend.to_host(model.forward(Batch([Row(0, 0, np.arange(3))]), kv))
    ahead = (f"-DLEAT_RUNS_AHEAD={switch}",) if switch == "4" else ()
    assert {extra for file, extra in built if file == "matmul.cu"} == {ahead}
    assert {extra for file, extra in built if file != "matmul.cu"} <= {()}
    for bad in ("0", "9", "two", "-1"):
        monkeypatch.setenv("LEAT_CUDA_RUNS_AHEAD", bad)
        with pytest.raises(LeatError, match="LEAT_CUDA_RUNS_AHEAD"):
            CUDABackend()


def test_a_split_gated_unit_reserves_its_up_rows_sums(fake, monkeypatch):
    """Where the rule gives the gated unit a split shape (decode_shapes.py tries them), its launch's reduction holds
    the gate's and the up rows' sums: shared memory for twice its rows a warp, 8 warps a block."""
    from leat_backend_cuda import quants

    split = quants.GEMV_Q_SPLIT
    monkeypatch.setattr(quants, "GEMV_Q_VARIANTS", (*quants.GEMV_Q_VARIANTS, (1, 2, 2, quants.GEMV_Q_GLU | split)))
    rng = np.random.default_rng(8)
    cols, rows = 512, 64
    backend = CUDABackend()
    gate, up = (backend.upload(Tensor(n, Q.Q4_K, (rows, cols), stored_q4_k(rows, cols, rng))) for n in "gu")
    monkeypatch.setattr(quants, "gemv_q_shape", lambda *_: (2, 2, split))
    launched = gemv_q_launches(fake, monkeypatch)
    x = backend.from_host(rng.standard_normal((1, cols)))
    backend.to_host(backend.silu_mul(backend.matmul(x, gate), backend.matmul(x, up)))
    assert launched() == [(2, 2, quants.GEMV_Q_GLU | split, 256, quants.gemv_q_smem(Q.Q4_K, 1, cols, 4))]


def test_the_rule_splits_only_the_small_one_token_products():
    """quants.gemv_q_shape with ``split``: on Llama-3-8B's shapes, the three that decode_shapes.py --split found faster
    split take it: o (4,096 rows) four rows by one unit, v alone (1,024 rows, the norm inside) two by one, down (rows
    of 14,336 values) two by two; q, k and v (6,144 rows, the norm inside), the gated unit, the output matrix and two
    tokens are as without it, and so are rows longer than GEMV_Q_SPLIT_MAX_COLS. A split launch's shared memory (x's,
    then the reduction's) stays under GEMV_Q_MAX_SMEM for every integer type up to that length. The split kernels are
    compiled only where the split is on (kernel_names' ``split``): each the rule can give, with its ROPE twin."""
    from leat_backend_cuda import quants

    split, glu, norm = quants.GEMV_Q_SPLIT, quants.GEMV_Q_GLU, quants.GEMV_Q_NORM
    longest = quants.GEMV_Q_SPLIT_MAX_COLS
    for shape, taken in [((1, 0, 4096, 4096), (4, 1)), ((1, norm, 1024, 4096), (2, 1)), ((1, 0, 4096, 14336), (2, 2))]:
        assert quants.gemv_q_shape(*shape)[2] != split
        assert quants.gemv_q_shape(*shape, True) == (*taken, split), shape
    whole = [(1, norm, 6144, 4096), (1, norm | glu, 14336, 4096), (1, norm, 128256, 4096), (2, 0, 4096, 4096)]
    for shape in whole + [(1, 0, 4096, longest + 256), (1, 0, 1024, longest + 256)]:
        assert quants.gemv_q_shape(*shape, True) == quants.gemv_q_shape(*shape), shape
    for qtype, layout in quants.LAYOUTS.items():
        if layout.integer:
            assert quants.gemv_q_smem(qtype, 1, longest, 4) <= quants.GEMV_Q_MAX_SMEM, qtype
    # the split kernels are compiled only where the split is on: every shape the rule can give, and its ROPE twin
    default, switched = quants.kernel_names(Q.Q4_K), quants.kernel_names(Q.Q4_K, split=True)
    modes = [int(name.rsplit(",", 1)[1].rstrip(">")) for name in default if name.startswith("gemv_q<")]
    assert modes and not [m for m in modes if m & quants.GEMV_Q_SPLIT]
    names = {quants.gemv_q_name(Q.Q4_K, 1, (r, u), m) for _, r, u, m in quants.GEMV_Q_SPLIT_VARIANTS}
    assert set(switched) - set(default) == names and len(names) == 8
    for mode, rows, cols in [(0, 4096, 4096), (0, 1024, 4096), (norm, 1024, 4096), (0, 4096, 14336), (0, 512, 8192)]:
        r, u, variant = quants.gemv_q_shape(1, mode, rows, cols, True)
        assert variant == split
        for twin in (0, quants.GEMV_Q_ROPE):
            assert quants.gemv_q_name(Q.Q4_K, 1, (r, u), mode | variant | twin) in names


def test_products_of_9_to_16_tokens_go_to_gemm_wg_on_hopper_where_turned_on(fake, monkeypatch):
    """On sm_90 (the fake device) with LEAT_CUDA_WGMMA=16, products of 9-16 tokens go to gemm_wg, ahead of cuBLAS
    and gemm_few: x put in its order once per weight type and token tile (q, k and v share it), split over K where
    the rows leave multiprocessors idle, the tile that holds the tokens. Unset it is off (WGMMA_LAST), =64 widens
    it, a bad value is refused; off Hopper it takes nothing."""
    from leat_backend_cuda import wgmma

    monkeypatch.delenv("LEAT_CUDA_WGMMA")
    assert CUDABackend().wg_tokens == (1, 0) and wgmma.WGMMA_LAST == 0
    monkeypatch.setenv("LEAT_CUDA_WGMMA", "16")
    rng = np.random.default_rng(5)
    cols = 512
    backend = CUDABackend()
    assert backend.wg_tokens == (9, 16)
    q, k = (backend.upload(Tensor(n, Q.Q4_K, (r, cols), stored_q4_k(r, cols, rng))) for n, r in (("q", 256), ("k", 64)))
    for n, tile in ((9, 2), (16, 2)):
        x = backend.from_host(rng.standard_normal((n, cols)))
        fake.launches.clear()
        backend.matmul(x, q)
        backend.matmul(x, k)
        names = [f for f, _, _ in fake.launches]
        orders = [f for f in names if f.startswith("_Z10wg_order_x")]
        products = [(f, grid) for f, grid, _ in fake.launches if f.startswith("_Z7gemm_wg")]
        assert len(orders) == 1 and f"I5TQ4_KLi{tile}E" in orders[0]  # one order for both, the 16-token tile
        assert [grid for _, grid in products] == [(2, 2, 1), (1, 2, 1)]  # 2 chunks of K, split in 2 (264 blocks)
        assert names.count("x_to_f16") == 1 and names.count("splitk_sum") == 2  # x's f16 rows once for both
        assert "scale_rows_bias" not in names  # the scales are applied in gemm_wg
    fake.launches.clear()
    backend.matmul(backend.from_host(rng.standard_normal((17, cols))), q)
    assert not [f for f, _, _ in fake.launches if "gemm_wg" in f]
    monkeypatch.setenv("LEAT_CUDA_WGMMA", "64")
    assert wgmma.wg_tokens("sm_90") == (9, 64) and wgmma.wg_tile(33) == 8 and wgmma.wg_tile(17) == 4
    monkeypatch.setenv("LEAT_CUDA_WGMMA", "0")
    assert wgmma.wg_tokens("sm_90") == (1, 0)
    for bad in ("65", "-1", "on"):
        monkeypatch.setenv("LEAT_CUDA_WGMMA", bad)
        with pytest.raises(LeatError, match="LEAT_CUDA_WGMMA"):
            wgmma.wg_tokens("sm_90")
    assert wgmma.wg_tokens("sm_89") == (1, 0)


def stored_q4_k(rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K blocks with small scales (gguf-py cannot quantize Q4_K)."""
    block, size = gguf.GGML_QUANT_SIZES[Q.Q4_K]
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    data[:, :4] = np.frombuffer(np.full(2, 0.01, np.float16).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def test_a_weight_kept_in_f16_goes_to_cublas_whole_without_decoding(fake):
    """Within ``f16_budget`` the upload decodes a matrix to f16 rows once; a product of many tokens then multiplies
    that copy in one cuBLAS call and decodes nothing. Past the budget a matrix keeps no copy. A kept copy goes to
    cuBLAS from ``cublas_min_tokens_f16`` tokens, a matrix without one from ``cublas_min_tokens``."""
    rng = np.random.default_rng(4)
    rows, cols, n = 75, 256, 40
    data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.Q8_0)
    backend = CUDABackend(use_cublas=False)
    backend.f16_budget = 2 * rows * cols + 1  # room for one copy
    fake.launches.clear()
    weight = backend.upload(Tensor("w", Q.Q8_0, (rows, cols), data))
    assert weight.f16 is not None and weight.f16.nbytes == 2 * rows * cols
    assert sum(f.startswith("_Z14dequantize_f16I5TQ8_0") for f, _, _ in fake.launches) == 1
    second = backend.upload(Tensor("w2", Q.Q8_0, (rows, cols), data))
    assert second.f16 is None  # the budget is spent
    backend.cublas, backend.cublas_min_tokens, backend.cublas_min_tokens_f16 = RecordingCublas(), n + 1, n
    fake.launches.clear()
    x = backend.from_host(rng.standard_normal((n, cols)))
    out = backend.matmul(x, weight).materialize()  # waits for its consumer (a lone product: as it always ran)
    assert not any(f.startswith("_Z14dequantize_f16") for f, _, _ in fake.launches)
    assert backend.cublas.calls == [(weight.f16.ptr, backend.cublas.calls[0][1], out.ptr, rows, n, cols, rows)]
    backend.cublas.calls.clear()
    backend.matmul(x, second)  # no copy: n tokens are below its threshold, so the own kernels
    assert not backend.cublas.calls


def test_a_free_during_a_graph_capture_waits_for_its_end(fake):
    """Python may drop an allocation in the middle of a capture: its garbage collector runs when objects are created
    and frees what reference cycles held. cuMemFree synchronizes the device, which invalidates the capture (on an H200
    an engine's capture failed so: 'cuMemsetD8Async failed: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED'); the free waits
    for the capture's end."""
    device = driver.Device(0)
    held = [driver.Memory(4096)]
    ptr = held[0].ptr
    held.append(held)  # a cycle: only the collector frees it

    def capture():
        held.clear()
        gc.collect()
        assert not any(capturing for _, capturing in fake.freed)
        return "captured"

    fake.freed.clear()
    assert driver.Graph(device, capture).result == "captured"
    # freed once the capture ended, as is anything else the collector found in it
    assert (ptr, False) in fake.freed and not any(capturing for _, capturing in fake.freed)


def test_destroys_during_a_graph_capture_wait_for_its_end(fake, monkeypatch):
    """Not only frees: an event's, a graph's and a cuBLAS handle's destroy (the handle frees its workspace) dropped by
    the collector in the middle of a capture also wait for its end. In a GPU run of the suite under xdist another
    backend's objects, collected during a 384-token capture, invalidated it ('cuMemsetD8Async failed:
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED' at the capture's next call)."""
    from leat_backend_cuda import cublas

    destroyed: list[tuple[str, bool]] = []

    def destroy(kind):
        return lambda *_: destroyed.append((kind, fake.capturing)) or (fake.ok,)

    for name in ("cuEventDestroy", "cuGraphExecDestroy", "cuGraphDestroy"):
        monkeypatch.setattr(fake, name, destroy(name), raising=False)
    device = driver.Device(0)
    handle = cublas.Cublas.__new__(cublas.Cublas)  # a handle without the library: its destroy is all that runs
    handle.lib = type("Lib", (), {"cublasDestroy_v2": staticmethod(destroy("cublasDestroy_v2"))})()
    handle.handle = 1
    old_graph = driver.Graph(device, lambda: None)
    held: list = [driver.Event(device), old_graph, handle]
    held.append(held)  # a cycle: only the collector frees them
    del old_graph, handle

    def capture():
        held.clear()
        gc.collect()
        return "captured"

    graph = driver.Graph(device, capture)
    kinds = sorted(kind for kind, _ in destroyed)  # (the new graph still lives)
    assert kinds == ["cuEventDestroy", "cuGraphDestroy", "cuGraphExecDestroy", "cublasDestroy_v2"], destroyed
    assert not any(capturing for _, capturing in destroyed) and graph.result == "captured"


def test_a_free_inside_the_capture_bookkeeping_does_not_wait_for_itself(fake):
    """The collector may run inside the driver's locked bookkeeping of frees (a tuple or list made there) and free
    an allocation: that free takes the same lock again on the same thread, which must not wait for itself."""
    import threading

    def free_while_locked():
        with driver._capture_lock:
            memory = driver.Memory(4096)
            del memory

    worker = threading.Thread(target=free_while_locked, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "a free inside the locked section waited for its own lock"


def test_a_step_whose_graph_cannot_be_captured_runs_eagerly_and_says_so(fake, tmp_path, caplog, monkeypatch):
    """A graph is an optimization: when its capture fails the step runs eagerly, the failure is recorded
    (``graph_failures``) and logged once for that shape, so that a figure measured after it is not taken for the
    graphs' (steps of that shape pay the eager path's host time)."""
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=2, context=32, dtype="f16")

    def invalidated(stream):
        fake.capturing = False
        return fake.real.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None

    monkeypatch.setattr(fake, "cuStreamEndCapture", invalidated)
    monkeypatch.setattr(fake, "cuGetErrorName", lambda err: (fake.ok, err.name.encode()), raising=False)
    decode = Batch([Row(0, 0, np.array([5])), Row(1, 0, np.array([7]))])
    with caplog.at_level("WARNING", logger="leat.cuda"):
        for _ in range(2):
            assert backend.to_host(backend.run(model.forward, decode, kv)).shape == (2, model.params.vocab)
    assert len(backend.graph_failures) == 1 and "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED" in backend.graph_failures[0]
    warnings = [r.getMessage() for r in caplog.records if r.name == "leat.cuda"]
    assert len(warnings) == 1 and "no graph for steps of 2 tokens" in warnings[0] and "eagerly" in warnings[0]
    assert not backend._captured


def test_a_chunks_new_graph_needs_the_devices_free_share_or_its_steps_run_eagerly(fake, tmp_path, caplog, monkeypatch):
    """A graph's private pool stays reserved while it lives, so a new graph of a prompt's chunk (over 64 tokens) is
    captured only while GRAPH_FREE_SHARE of the device's memory is free; short of that its steps run eagerly (same
    results), recorded and logged once. Decode steps' graphs are captured regardless, and graphs captured before
    keep replaying."""
    from leat_backend_cuda.backend import GRAPH_FREE_SHARE

    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=2, context=256, dtype="f16")
    chunk = lambda tokens: Batch([Row(0, 0, np.arange(tokens) % 50)])
    total = 140 << 30
    free = {"bytes": int(GRAPH_FREE_SHARE * total)}  # just enough
    monkeypatch.setattr(fake, "cuMemGetInfo", lambda: (fake.ok, free["bytes"], total))
    backend.run(model.forward, chunk(70), kv)
    assert [key[2] for key in backend._captured] == [96]
    free["bytes"] -= 1
    with caplog.at_level("WARNING", logger="leat.cuda"):
        for _ in range(2):
            assert backend.to_host(backend.run(model.forward, chunk(100), kv)).shape == (1, model.params.vocab)
    assert len(backend._captured) == 1 and len(backend.graph_failures) == 1 and "free" in backend.graph_failures[0]
    warnings = [r.getMessage() for r in caplog.records if r.name == "leat.cuda"]
    assert len(warnings) == 1 and "no graph for steps of 128 tokens" in warnings[0]
    backend.run(model.forward, Batch([Row(1, 0, np.array([5]))]), kv)  # a decode step: captured regardless
    assert sorted(key[2] for key in backend._captured) == [1, 96]
    replays = [name for name, _, _ in fake.launches].count("graph")
    backend.run(model.forward, chunk(70), kv)  # the chunk's graph captured before replays
    assert [name for name, _, _ in fake.launches].count("graph") == replays + 1


def test_products_of_f16_copies_go_to_cublas_with_their_siblings_and_their_epilogue_into_the_consumer(
    fake, monkeypatch
):
    """Products of f16 copies wait for their consumer: q, k and v (one x) go to cuBLAS side by side, one call for the
    copies that adjoin in their slab, and one scale_split writes each its output; gate and up go to one call and
    scale_silu_mul; a product added to the residual goes to scale_add. A product alone keeps scale_rows_bias."""
    from leat_backend_cuda import backend as cuda_backend

    rng = np.random.default_rng(5)
    cols, n = 256, 24
    monkeypatch.setattr(cuda_backend, "F16_SLAB_BYTES", 2 * 96 * cols)  # gate and up fill a slab, q and k the next
    backend = CUDABackend(use_cublas=False)
    backend.f16_budget = 1 << 24

    def upload(name, rows):
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.Q8_0)
        return backend.upload(Tensor(name, Q.Q8_0, (rows, cols), data))

    gate, up, q, k, v, down = (
        upload(name, rows) for name, rows in (("g", 48), ("u", 48), ("q", 64), ("k", 32), ("v", 32), ("d", 48))
    )
    assert k.f16.ptr == q.f16.ptr + q.f16.nbytes and v.f16.ptr != k.f16.ptr + k.f16.nbytes
    assert up.f16.ptr == gate.f16.ptr + gate.f16.nbytes
    backend.cublas, backend.cublas_min_tokens_f16 = RecordingCublas(), n
    fake.launches.clear()
    x = backend.from_host(rng.standard_normal((n, cols)))
    pq, pk, pv = (backend.matmul(x, w) for w in (q, k, v))
    assert not backend.cublas.calls and not fake.launches  # nothing launched before a consumer reads one
    pk.materialize()  # k read first: q and v come along
    (_, xh, y, *_), _ = backend.cublas.calls
    assert backend.cublas.calls == [(q.f16.ptr, xh, y, 96, n, cols, 128), (v.f16.ptr, xh, y + 4 * 96, 32, n, cols, 128)]
    assert [f for f, _, _ in fake.launches] == ["x_to_f16", "scale_split"]
    fake.launches.clear()
    assert len({pq.ptr, pk.ptr, pv.ptr}) == 3 and not fake.launches and len(backend.cublas.calls) == 2

    backend.cublas.calls.clear()
    h = backend.from_host(rng.standard_normal((n, cols)))
    out = backend.silu_mul(backend.matmul(h, gate), backend.matmul(h, up))
    assert out.shape == (n, 48) and [f for f, _, _ in fake.launches] == ["x_to_f16", "scale_silu_mul"]
    ((_, xh, y, *_),) = backend.cublas.calls
    assert backend.cublas.calls == [(gate.f16.ptr, xh, y, 96, n, cols, 96)]

    fake.launches.clear()
    backend.cublas.calls.clear()
    residual = backend.from_host(rng.standard_normal((n, 48)))
    total = backend.add(residual, backend.matmul(h, down))
    assert total.shape == (n, 48) and [f for f, _, _ in fake.launches] == ["scale_add"]  # h's f16 rows made once
    fake.launches.clear()
    alone = backend.matmul(backend.from_host(rng.standard_normal((n, cols))), down)
    alone.materialize()
    assert [f for f, _, _ in fake.launches] == ["x_to_f16", "scale_rows_bias"]


def test_the_f16_budget_follows_the_size_of_the_mapped_file(tmp_path):
    """A GGUF's tensors view its mmap: the backend reads the file's size from them (none for an array in memory)."""
    from leat_backend_cuda.backend import _mapped_size

    path = write_tiny_gguf(Llama, tmp_path / "m.gguf", Q.Q8_0)
    tensor = next(iter(ModelFile(path).tensors.values()))
    assert _mapped_size(tensor.data) == path.stat().st_size
    assert _mapped_size(np.zeros(4)) is None


def test_a_step_fed_from_the_last_argmax_gathers_its_tokens_on_the_device(fake, tmp_path):
    """run(..., fed=(ids, index)) on the graph path: the inputs go up, gather_ints puts the last step's argmax
    (rows ``index``) in the token slots, then the graph replays, with no wait for the host."""
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=3, context=64, dtype="f16")
    first = Batch([Row(0, 4, np.array([5])), Row(1, 7, np.array([7])), Row(2, 2, np.array([1]))])
    ids = backend.argmax_async(backend.run(model.forward, first, kv))
    fake.launches.clear()
    following = Batch([Row(0, 5, np.array([0])), Row(2, 3, np.array([0]))])
    backend.run(model.forward, following, kv)  # its graph is captured
    fake.launches.clear()
    backend.run(model.forward, following, kv, fed=(ids, np.array([0, 2])))
    assert [f for f, _, _ in fake.launches] == ["gather_ints", "graph"]
    assert not backend.graph_failures


REAL_GPU = CUDABackend.probe() is None  # checked before any test swaps in the fake driver


@pytest.mark.skipif(REAL_GPU, reason="a real GPU is present: cuBLAS starts there (the GPU tests cover it)")
def test_without_a_gpu_cublas_installed_or_not_leaves_the_own_gemm(fake):
    """Installed (``leat-backend-cuda[cublas]``) or not, cuBLAS cannot start without a driver: the backend says
    why and multiplies with its own kernels, it does not fail."""
    backend = CUDABackend()
    assert backend.cublas is None and backend._f16_weights is None
    assert backend.describe()["cublas"].startswith("not used (")


def test_a_launch_packs_its_arguments_as_param_converts_each(monkeypatch):
    """Kernel.__call__ packs the arguments with one struct call (a float32 slot for each .f32 parameter): every
    slot holds what ``_param`` makes of its argument (a pointer, 64-bit integer, float32 bits), and arguments the
    packing refuses (an int over 63 bits, a float for an integer parameter) fall back to ``_param``."""
    fake = FakeDriver()  # not the fixture: its type check refuses the odd arguments tried here
    monkeypatch.setattr(driver, "_cu", lambda: fake)
    monkeypatch.setattr(driver, "_local", types.SimpleNamespace())
    device = driver.Device(0)
    params = [".u64", ".u32", ".f32", ".s32", ".u64", ".f32", ".u64", ".u64"]
    kernel = driver.Kernel("k", "k", device, params)
    memory = driver.Memory(256)
    pool = driver.Pool(device, lambda n: None)
    array = driver.DeviceArray(memory.ptr + 64, (4,), np.float32, memory)
    block = pool.take(100)
    runs = [
        (array, np.int32(5), 1.5, -3, None, np.float32(0.25), memory, block),
        (array.view((2,), 1), 7, -0.0, np.int64(-1), 0, 3.0e38, block, 1 << 40),
        (array, 1 << 63, 2.5, 0, array, 1.0, 0.5, memory),  # over 63 bits; a float for a pointer
    ]
    for args in runs:
        kernel._values[:] = 0xAB
        kernel((1,), 32, *args)
        assert [int(v) for v in kernel._values] == [driver._param(a) for a in args]
    assert len(fake.launches) == len(runs)


def test_a_timer_destroys_its_events_when_collected(fake):
    destroyed = []
    fake.cuEventDestroy = lambda event: destroyed.append(event) or (fake.ok,)
    timer = driver.Timer(types.SimpleNamespace(stream="stream"))
    events = [timer.start, timer.end]
    del timer
    assert destroyed == events


@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_one_token_decode_rotates_and_writes_the_cache_in_the_products(fake, tmp_path, dtype):
    """One token a step, a float32 or f16 cache: q, k and v run as one gemv_q with the ROPE epilogue (mode bit 16: q
    rotated out, k rotated and v into the cache), and no rope_kv_write is launched. Two rows a step keep
    rope_kv_write (as a q8_0 cache does, whose blocks of 32 values span rows: not on the tiny model, whose heads
    have 16)."""
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    backend = CUDABackend()
    model = Llama(ModelFile(path), backend)
    kv = backend.allocate_kv(Llama.kv_layouts(model.params), slots=2, context=64, dtype=dtype)
    model.forward(Batch([Row(0, 0, np.arange(20) % 300), Row(1, 0, np.arange(3))]), kv)
    for rows, fused in ((1, True), (2, False)):
        fake.launches.clear()
        decode = Batch([Row(0, 20, np.array([5])), Row(1, 3, np.array([7]))][:rows])
        backend.to_host(model.forward(decode, kv))
        names = [f for f, _, _ in fake.launches]
        rope_kv = [f for f in names if f.startswith("_Z13rope_kv_write")]
        # gemv_q with the ROPE bit in its mode (its last template integer): NORM | ROPE, split over K or not
        with_rope = [f for f in names if f.startswith("_Z6gemv_q") and int(re.findall(r"Li(\d+)E", f)[-1]) & 16]
        assert len(rope_kv) == (0 if fused else model.params.layers), (rows, dtype)
        assert len(with_rope) == (model.params.layers if fused else 0), (rows, dtype)
        assert len([f for f in names if f.startswith("_Z6gemv_q")]) == 4 * model.params.layers + 1


def _script(name: str):
    """scripts/NAME.py's path and the module loaded from it (its main() not run)."""
    script = Path(__file__).parents[3] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return script, module


def test_decode_parts_leaves_each_kind_of_kernel_out_of_the_graph(fake, tmp_path, monkeypatch, capsys):
    """scripts/decode_parts.py on the fake driver, where a replay takes a millisecond for each launch in the graph:
    the step's launches counted by kind, and the step with one kind left out shorter by exactly that kind's
    launches (so the kind was left out of the captured graph, and nothing else was)."""
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    fake.cuEventElapsedTime = lambda start, end: (fake.ok, float(len(fake.captured[-1])))
    script, module = _script("decode_parts")
    monkeypatch.setattr(sys, "argv", [str(script), str(path), "--position", "5", "--reps", "1", "--rounds", "1"])
    module.main()
    out = capsys.readouterr().out
    whole, launches = re.search(r"whole step: ([\d.]+) ms .*, (\d+) launches", out).groups()
    assert float(whole) == int(launches) > 0
    rows = re.findall(r"\| (`\w+`|all but `gemv_q`) \| (\d+) \| ([\d.]+) \|", out)
    kinds = {name.replace("`", ""): (int(count), float(ms)) for name, count, ms in rows}
    assert {"gemv_q", "attention", "all but gemv_q"} <= set(kinds) and "rope_kv_write" not in kinds  # in q/k/v's
    assert kinds["gemv_q"][0] == 4 * 2 + 1  # tiny Llama: 2 layers of q+k+v, o, gate+up, down; the output matrix
    for count, ms in kinds.values():
        assert ms == int(launches) - count


@pytest.mark.parametrize("graph", [False, True])
def test_prefill_host_times_a_prefill_and_its_launches(fake, tmp_path, monkeypatch, capsys, graph):
    """scripts/prefill_host.py on the fake driver: the prefill runs eagerly (the backend's graphs off: no graph
    launched), each round's launches a step the launches one such prefill makes; with --graph it replays a graph
    (no launch of its own a step)."""
    from leat_backend_cuda import backend as cuda_backend

    monkeypatch.setattr(cuda_backend, "TOKEN_BUCKETS", cuda_backend.TOKEN_BUCKETS)  # --graph extends them
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    script, module = _script("prefill_host")
    load = module.one_token_step
    monkeypatch.setattr(module, "one_token_step", lambda *a: (load(*a), fake.launches.clear())[0])  # steps only
    argv = [str(script), str(path), "--tokens", "300", "--reps", "2", "--rounds", "2"] + ["--graph"] * graph
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d.]+) \| [\d,]+ \| (\d+) \| [\d.]+ \| (\d+) \|", out, re.MULTILINE)
    assert [r[0] for r in rows] == ["1", "2"] and "own GEMM" in out
    names = [f for f, _, _ in fake.launches]
    assert all(0 < float(queued) <= float(whole) for _, queued, whole, _, _ in rows)
    if graph:  # the first step captures; every step after it is one replay
        assert len(fake.captured) == 1 and names.count("graph") == 3 + 2 * 2
        assert all(int(r[3]) == 0 for r in rows)
        return
    assert "graph" not in names and not fake.captured
    per_step = len(names) // (3 + 2 * 2)  # three untimed steps, then two rounds of two
    assert per_step > 0 and all(int(r[3]) == per_step and int(r[4]) == 0 for r in rows)


@pytest.mark.parametrize("fill", [7, None])
def test_decode_host_times_a_token_in_parts_and_in_loops(fake, tmp_path, monkeypatch, capsys, fill):
    """scripts/decode_host.py on the fake driver: every part and every loop's rounds, one capture and a replay for each
    step the script runs, and its check that the page-locked copy equals to_host's as the downloads make them (each
    download fills its destination with one byte: equal; with the second copy's byte another: not equal)."""
    import ctypes

    downloads = []

    def download(dst, src, size, stream):
        downloads.append(dst)
        ctypes.memset(dst, fill if fill is not None else len(downloads) % 2, size)
        return (fake.ok,)

    monkeypatch.setattr(fake, "cuMemcpyDtoHAsync", download)
    path = write_tiny_gguf(Llama, tmp_path / "tiny.gguf", Q.Q8_0)
    script, module = _script("decode_host")
    monkeypatch.setattr(sys, "argv", [str(script), str(path), "--position", "5", "--reps", "3", "--rounds", "2"])
    module.main()
    out = capsys.readouterr().out
    parts = re.findall(r"^\| ([\w -]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.MULTILINE)
    assert [p[0] for p in parts] == list(module.PARTS)
    loops = re.findall(r"^\| ([^|]+) \| (\d) \| ([\d.]+) \| ([\d.]+) \|$", out, re.MULTILINE)
    assert [(name.split(" (")[0], int(i)) for name, i, _, _ in loops] == [
        (name, i)
        for name in ("run + to_host", "run + page-locked download + copy", "run alone, back to back")
        for i in (1, 2)
    ]
    assert f"equals to_host's: {fill is not None}" in out
    assert len(fake.captured) == 1
    assert [f for f, _, _ in fake.launches].count("graph") == 5 + 1 + 3 + 3 * 2 * 128


def test_load_patterns_times_each_pattern_on_a_persistent_grid(fake, monkeypatch, capsys):
    """scripts/load_patterns.py on the fake driver: a row for each pattern, units in flight, blocks a multiprocessor
    and size, each from --reps launches of that pattern's kernel on blocks x multiprocessors blocks of 128 threads."""
    fake.cuEventElapsedTime = lambda start, end: (fake.ok, 1.0)
    fake.cuFuncGetAttribute = lambda attribute, function: (fake.ok, 4096)
    script, module = _script("load_patterns")
    argv = [str(script), "--mbytes", "1", "--units", "1", "2", "--blocks", "2", "--reps", "3"]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    rows = re.findall(r"\| (\w+) \| (\d) \| 2 \| 1 \| [\d,]+ \|", capsys.readouterr().out)
    assert sorted(rows) == sorted((p, u) for p in module.UNIT_BYTES for u in "12")
    kernels = [(f, grid, block) for f, grid, block in fake.launches if f != "graph"]
    sms = CUDABackend().device.sm_count
    assert len(kernels) == 3 * len(rows) and {(g, b) for _, g, b in kernels} == {((2 * sms, 1, 1), 128)}


def test_load_patterns_times_chains_of_kernels_plain_in_graphs_and_overlapped(fake, monkeypatch, capsys):
    """load_patterns.py --chain on the fake driver: for each pattern one launch over all the layers' bytes, the chain
    of a launch a kernel (2 kernels x 3 layers), three graphs of that chain (plain launches; with programmatic
    stream serialization, each kernel waiting at its top or after its first loads) captured once, replayed --reps
    times, and the persistent kernel of all the passes, without and with prefetching, --reps launches each."""
    fake.cuEventElapsedTime = lambda start, end: (fake.ok, 1.0)
    fake.cuFuncGetAttribute = lambda attribute, function: (fake.ok, 4096)
    overlapped = []

    def launch_ex(config, f, params, extra):
        assert config.numAttrs == 1 and config.attrs[0].value.programmaticStreamSerializationAllowed == 1
        overlapped.append(f)
        grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
        return fake.cuLaunchKernel(f, *grid, config.blockDimX, 1, 1, config.sharedMemBytes, config.hStream, params, 0)

    fake.cuLaunchKernelEx = launch_ex
    script, module = _script("load_patterns")
    argv = [str(script), "--chain", "1", "2", "--layers", "3", "--units", "1", "--blocks", "2", "--reps", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    rows = re.findall(r"\| (\w+) \| 1 \| 2 \|((?: [\d,]+ \|){7})$", capsys.readouterr().out, re.MULTILINE)
    assert sorted(p for p, _ in rows) == sorted(module.UNIT_BYTES)
    kernels = [f for f, _, _ in fake.launches if f != "graph"]
    # one launch and the chain each rep; each graph's chain captured once; the persistent kernel twice each rep
    per_pattern = 4 * 1 + 4 * 6 + 3 * 6 + 2 * 4
    assert len(kernels) == per_pattern * len(rows) and len(overlapped) == 2 * 6 * len(rows)
    assert sum("6phases" in f for f in kernels) == 2 * 4 * len(rows)  # mangled: _Z6phasesI...
    assert sum(f == "graph" for f, _, _ in fake.launches) == 3 * 4 * len(rows)
