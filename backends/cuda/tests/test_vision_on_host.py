"""The image kernels (kernels/vision.cu: layer_norm, gelu, attention_open) compiled for the host with g++ and run with
each CUDA thread a fiber (test_moe_mla_on_host.py's harness), against the float64 CPU backend: bidirectional rows
beside causal ones, windows counted from each query's own position, soft-capping, sinks, an f16 cache. The attention
reads the K and V pages the CPU backend wrote (the same layout, [pages, page_size, kv_heads, dim]). No GPU needed;
skipped where g++ is missing."""

import ctypes
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.modelfile import Tensor
from leat_backend_cpu.backend import CPUBackend
from leat_backend_cuda.vision import last_positions

_spec = importlib.util.spec_from_file_location("moe_mla_on_host", Path(__file__).parent / "test_moe_mla_on_host.py")
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)
ptr, f32 = host.ptr, host.f32

HARNESS = r"""
extern "C" void norm(const float* x, const float* w, const float* b, float* y, int n, int cols, float eps) {
    launch({(unsigned)n, 1, 1}, 64, [=] { layer_norm(x, w, b, y, cols, eps); });
}
extern "C" void gelu_all(const float* g, float* y, long long n) { launch({3, 1, 1}, 32, [=] { gelu(g, y, n); }); }
#define OPEN(name, KV, DL)                                                                                          \
    extern "C" void name(const float* q, const KV* kc, const KV* vc, const int* table, const int* slots,            \
                         const int* pos, const int* last, float* out, int n, int heads, int kv_heads, int dim,       \
                         int per_slot, int page_size, int window, float scale, float softcap, const float* sinks) {  \
        launch({(unsigned)((n * heads + 3) / 4), 1, 1}, 128, [=] {                                                  \
            attention_open<KV, DL>(q, kc, vc, nullptr, nullptr, table, slots, pos, last, out, n, heads, kv_heads,   \
                                   dim, dim, per_slot, page_size, window, scale, softcap, sinks);                    \
        });                                                                                                         \
    }
OPEN(open_f32_1, float, 1)
OPEN(open_f32_2, float, 2)
OPEN(open_f16_2, u16, 2)
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return host.host_library(tmp_path_factory, "vision-host", host._kernel("vision.cu") + HARNESS)


@pytest.mark.parametrize("weighted", [True, False])
def test_layer_norm(kernels, weighted):
    rng = np.random.default_rng(1)
    n, cols, eps = 3, 72, 1e-6
    x = f32(rng.standard_normal((n, cols)) * 4 + np.array([[100.0], [0.0], [-3.0]]))  # a large mean: two passes
    w, b = (f32(rng.standard_normal(cols)) for _ in range(2)) if weighted else (None, None)
    y = np.full((n, cols), np.nan, np.float32)
    kernels.norm(ptr(x), ptr(w), ptr(b), ptr(y), n, cols, ctypes.c_float(eps))
    as64 = lambda a: None if a is None else a.astype(np.float64)
    want = CPUBackend("f64").layer_norm(x.astype(np.float64), as64(w), as64(b), eps)
    assert np.abs(y - want).max() < 2e-5 * np.abs(want).max()


def test_gelu(kernels):
    g = f32(np.linspace(-12, 12, 301))
    y = np.full_like(g, np.nan)
    kernels.gelu_all(ptr(g), ptr(y), ctypes.c_longlong(g.size))
    want = CPUBackend("f64").gelu_mul(g.astype(np.float64))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


# (heads, kv_heads, dim, window, softcap, sinks, kv dtype): dims 16 and 40 (one and two per lane, 40 leaving lanes
# idle), grouped queries, a window shorter than the bidirectional row
CASES = [
    (4, 2, 16, None, None, False, "f32"),
    (4, 2, 16, 4, None, False, "f32"),
    (3, 1, 40, 5, 3.0, True, "f32"),
    (3, 1, 40, 5, 3.0, False, "f32"),
    (3, 1, 40, 5, None, True, "f32"),
    (3, 1, 40, None, None, True, "f32"),
    (2, 2, 40, None, None, False, "f16"),
]


@pytest.mark.parametrize("heads,kv_heads,dim,window,softcap,sinks,dtype", CASES)
def test_bidirectional_attention(kernels, heads, kv_heads, dim, window, softcap, sinks, dtype):
    """Slot 1 holds a 6-token prefix; then one batch: a causal row of slot 0 and a bidirectional row of slot 1 after
    its prefix (every query sees the row's last position, and its window counts back from its own)."""
    rng = np.random.default_rng(dim + (window or 0))
    oracle = CPUBackend("f64")
    kv = oracle.allocate_kv([KVLayout(kv_heads, dim, window=window)], slots=2, context=32, page_size=4, dtype=dtype)
    oracle.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    sink = oracle.upload(Tensor("sinks", gguf.GGMLQuantizationType.F32, (heads,), f32(rng.standard_normal(heads))))
    sink = sink if sinks else None

    def step(rows):
        batch = Batch(rows)
        n = len(batch)
        q, k, v = (rng.standard_normal((n, h, dim)) for h in (heads, kv_heads, kv_heads))
        return batch, q, oracle.attention(q, k, v, kv, 0, batch, 0.3, softcap, sink)

    step([Row(1, 0, np.zeros(6, int))])
    batch, q, want = step([Row(0, 0, np.zeros(5, int)), Row(1, 6, np.zeros(7, int), bidirectional=True)])
    assert np.array_equal(last_positions(batch), [0, 1, 2, 3, 4] + [12] * 7)
    n = len(batch)
    slots = np.repeat([0, 1], [5, 7]).astype(np.int32)
    positions, last = (np.ascontiguousarray(a, np.int32) for a in (batch.positions, last_positions(batch)))
    table = np.ascontiguousarray(kv.page_table, np.int32)
    cache = (np.float32, "f32") if dtype == "f32" else (np.float16, "f16")
    kc, vc = (np.ascontiguousarray(c, cache[0]) for c in (kv.k[0], kv.v[0]))
    kernel = getattr(kernels, f"open_{cache[1]}_{1 if dim <= 32 else 2}")
    queries, sink32 = f32(q), None if sink is None else f32(sink)  # held: the kernel reads through their pointers

    def run(last: np.ndarray) -> np.ndarray:
        out = np.full((n, heads * dim), np.nan, np.float32)
        kernel(
            ptr(queries), ptr(kc), ptr(vc), ptr(table), ptr(slots), ptr(positions), ptr(last), ptr(out), n, heads,
            kv_heads, dim, table.shape[1], 4, window or 0, ctypes.c_float(0.3), ctypes.c_float(softcap or 0.0),
            ptr(sink32),
        )  # fmt: skip
        return out

    assert np.abs(run(last) - want).max() < 1e-5 * np.abs(want).max()
    causal = run(positions)  # every token up to its own position: the causal row agrees, the bidirectional not
    assert np.abs(causal[:5] - want[:5]).max() < 1e-5 * np.abs(want).max()
    assert np.abs(causal[5:-1] - want[5:-1]).min(axis=-1).max() > 1e-3
