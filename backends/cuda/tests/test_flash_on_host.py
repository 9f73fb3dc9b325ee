"""flash.cu's tensor-core prefill attention compiled for the host with g++ and run with each CUDA thread a fiber
(test_moe_mla_on_host.py's harness; mma.sync and ldmatrix emulated by tests/host/mma.cuh), over an f16 and a q8_0
paged cache, against the float64 CPU backend's attention over the same cache (its q8_0 quants and scales, or its f16
values): two rows in one step, a second chunk over cached positions, pages out of order, grouped-query heads, windows
and soft-capping. Skipped where g++ is missing."""

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from leat.backend import KVLayout
from leat.batch import Batch, Row
from leat.testing import relative_error
from leat_backend_cpu.backend import CPUBackend

_spec = importlib.util.spec_from_file_location(
    "flash_tiles_on_host", Path(__file__).parent / "test_flash_tiles_on_host.py"
)
flash_tiles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flash_tiles)
host = flash_tiles.host  # test_moe_mla_on_host.py's harness

HARNESS = r"""
template <typename KV, int D>
void flash_run(const float* q, const void* kc, const void* vc, const u16* ks, const u16* vs, const int* table,
               const int* slots, const int* pos, const int* tiles, int count, float* out, int heads, int kv_heads,
               int per_slot, int page_size, int window, float scale, float softcap, int gb) {
    const unsigned chunks = (unsigned)((heads / kv_heads + gb - 1) / gb);
    launch({(unsigned)count, (unsigned)kv_heads * chunks, 1}, 128, [=] {
        flash_attention<KV, D>(q, (const KV*)kc, (const KV*)vc, ks, vs, table, slots, pos, tiles, out, heads, kv_heads,
                               per_slot, page_size, window, scale, softcap, gb);
    });
}
extern "C" void flash(const float* q, const void* kc, const void* vc, const u16* ks, const u16* vs, const int* table,
                      const int* slots, const int* pos, const int* tiles, int count, float* out, int heads,
                      int kv_heads, int per_slot, int page_size, int window, float scale, float softcap, int gb,
                      int q8_0, int dim) {
    auto run = q8_0 ? (dim == 64 ? flash_run<i8, 64> : flash_run<i8, 128>)
                    : (dim == 64 ? flash_run<u16, 64> : flash_run<u16, 128>);
    run(q, kc, vc, ks, vs, table, slots, pos, tiles, count, out, heads, kv_heads, per_slot, page_size, window, scale,
        softcap, gb);
}
template <typename KV, int D>
void decode_run(const float* q, const void* kc, const void* vc, const u16* ks, const u16* vs, const int* table,
                const int* slots, const int* pos, int n, float* out, float* ml, float* acc, int heads, int kv_heads,
                int per_slot, int page_size, int window, int keys, int splits, float scale, float softcap,
                const float* sinks) {
    const unsigned chunks = (unsigned)((heads / kv_heads + 15) / 16);
    launch({(unsigned)n, (unsigned)kv_heads * chunks, (unsigned)splits}, 128, [=] {
        attention_tc<KV, D>(q, (const KV*)kc, (const KV*)vc, ks, vs, table, slots, pos, splits == 1 ? out : nullptr,
                            ml, acc, heads, kv_heads, per_slot, page_size, window, keys, scale, softcap, sinks);
    });
}
extern "C" void decode(const float* q, const void* kc, const void* vc, const u16* ks, const u16* vs, const int* table,
                       const int* slots, const int* pos, int n, float* out, float* ml, float* acc, int heads,
                       int kv_heads, int per_slot, int page_size, int window, int keys, int splits, float scale,
                       float softcap, const float* sinks, int q8_0, int dim) {
    auto run = q8_0 ? (dim == 64 ? decode_run<i8, 64> : decode_run<i8, 128>)
                    : (dim == 64 ? decode_run<u16, 64> : decode_run<u16, 128>);
    run(q, kc, vc, ks, vs, table, slots, pos, n, out, ml, acc, heads, kv_heads, per_slot, page_size, window, keys,
        splits, scale, softcap, sinks);
}
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    headers = {"mma.cuh": (Path(__file__).parent / "host" / "mma.cuh").read_text()}
    headers["decode_tc.cuh"] = host._kernel("decode_tc.cuh")
    return host.host_library(tmp_path_factory, "flash-host", host._kernel("flash.cu") + HARNESS, headers)


def run_flash(kernels, kv, q, step, dtype, heads, kv_heads, dim, scale, window, softcap, scales=True):
    """flash.cu over the CPU backend's cache ``kv`` (layer 0) for the step's tokens; ``scales`` False passes a q8_0
    cache without its scale planes (the check below must fail then)."""
    group = heads // kv_heads
    gb = 4 if group >= 3 else group  # CUDABackend._flash's query heads a block
    tiles = np.array(flash_tiles.expected(step, 16 * 4 // gb), np.int32).reshape(-1)  # _flash_tiles' rule
    slots = np.concatenate([np.full(n, s, np.int32) for s, _, n in step])
    pos = np.concatenate([np.arange(a, a + n, dtype=np.int32) for _, a, n in step])
    out = np.full((len(q), heads * dim), np.nan, np.float32)
    q8_0 = dtype == "q8_0"
    ks, vs = (np.ascontiguousarray(c[0]).view(np.uint16) if q8_0 else None for c in (kv.k_scale, kv.v_scale))
    if q8_0 and not scales:
        ks = vs = np.full(ks.size, 0x3C00, np.uint16)  # every scale f16 1.0
    kc, vc = (np.ascontiguousarray(c[0]) for c in (kv.k, kv.v))
    table = np.ascontiguousarray(kv.page_table, np.int32)
    q32 = host.f32(q)  # held: a temporary's memory could be reused before the call
    kernels.flash(
        *map(host.ptr, (q32, kc, vc, ks, vs, table, slots, pos, tiles)),
        len(tiles) // 2,
        host.ptr(out),
        heads,
        kv_heads,
        table.shape[1],
        kv.page_size,
        window or 0,
        ctypes.c_float(scale),
        ctypes.c_float(softcap),
        gb,
        int(q8_0),
        dim,
    )
    return out


CASES = [(8, 2, 64, None, 0.0), (4, 4, 64, 37, 0.0), (6, 2, 128, None, 4.0)]


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("heads,kv_heads,dim,window,softcap", CASES)
def test_flash_attention_against_float64(kernels, dtype, heads, kv_heads, dim, window, softcap):
    """Each step's output against the float64 attention over the same cache: f16 queries, keys, values (a q8_0
    cache's decoded q x d rounded to f16) and probabilities, as the f16 cache's GPU test bounds them."""
    rng = np.random.default_rng(40 + dim + heads)
    cpu = CPUBackend("f64")
    kv = cpu.allocate_kv([KVLayout(kv_heads, dim, window=window)], 2, 96, page_size=16, dtype=dtype)
    cpu.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    seqs = {s: [rng.standard_normal((96, h, dim)) for h in (heads, kv_heads, kv_heads)] for s in (0, 1)}
    steps = [[(0, 0, 40), (1, 0, 25)], [(1, 25, 50), (0, 40, 9)]]
    scale = dim**-0.5
    for step in steps:
        batch = Batch([Row(s, a, np.zeros(n, int), all_logits=True) for s, a, n in step])
        q, k, v = (np.concatenate([seqs[s][i][a : a + n] for s, a, n in step]) for i in range(3))
        want = cpu.attention(q, k, v, kv, 0, batch, scale, softcap or None)
        got = run_flash(kernels, kv, q, step, dtype, heads, kv_heads, dim, scale, window, softcap)
        assert np.isfinite(got).all()
        assert relative_error(got, want.reshape(got.shape)) < 3e-3, (step, relative_error(got, want.reshape(got.shape)))


def test_the_check_fails_without_q8_0_scales(kernels):
    """The comparison above can fail: a q8_0 cache read with every scale 1 (its quants alone) is far off."""
    rng = np.random.default_rng(3)
    cpu = CPUBackend("f64")
    kv = cpu.allocate_kv([KVLayout(2, 64)], 1, 32, page_size=16, dtype="q8_0")
    q, k, v = (rng.standard_normal((20, h, 64)) for h in (4, 2, 2))
    step = [(0, 0, 20)]
    want = cpu.attention(q, k, v, kv, 0, Batch([Row(0, 0, np.zeros(20, int), all_logits=True)]), 0.125)
    got = run_flash(kernels, kv, q, step, "q8_0", 4, 2, 64, 0.125, None, 0.0, scales=False)
    assert relative_error(got, want.reshape(got.shape)) > 0.1


DECODE_CASES = [(8, 2, 64, None, 0.0, False), (4, 4, 64, 37, 0.0, False), (6, 2, 128, None, 4.0, False)]
DECODE_CASES += [(40, 2, 128, None, 0.0, False), (8, 2, 64, None, 0.0, True)]


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("heads,kv_heads,dim,window,softcap,sinks", DECODE_CASES)
def test_decode_attention_on_tensor_cores_against_float64(kernels, dtype, heads, kv_heads, dim, window, softcap, sinks):
    """attention_tc (decode attention on tensor cores, LEAT_CUDA_ATTENTION_TC=1) for a decode step after two prompts
    (slot 1's pages out of order): one token of each, and three of slot 1 (a verify step), against the float64
    attention over the same cache; whole, and cut into 3 splits of multiples of 16 keys and 5 of multiples of 64,
    merged as attention_combine merges them. Grouped-query heads (40 over 2: blocks of 16, 16 and 8 heads), a window,
    soft-capping and sinks. f16 queries and probabilities, flash attention's bound; another slot's pages are far off."""
    rng = np.random.default_rng(80 + dim + heads)
    cpu = CPUBackend("f64")
    kv = cpu.allocate_kv([KVLayout(kv_heads, dim, window=window)], 2, 112, page_size=16, dtype=dtype)
    cpu.set_pages(kv, 1, kv.page_table[1][::-1].copy())
    scale, group = dim**-0.5, heads // kv_heads
    logits = rng.standard_normal(heads) if sinks else None
    prompts = [(0, 0, 70), (1, 0, 45)]
    for step in (prompts, [(0, 70, 1), (1, 45, 3)]):
        batch = Batch([Row(s, a, np.zeros(n, int), all_logits=True) for s, a, n in step])
        q, k, v = (rng.standard_normal((sum(n for *_, n in step), h, dim)) for h in (heads, kv_heads, kv_heads))
        want = cpu.attention(q, k, v, kv, 0, batch, scale, softcap or None, logits).reshape(len(q), heads, dim)
    slots = np.array([0, 1, 1, 1], np.int32)
    pos = np.array([70, 45, 46, 47], np.int32)
    q8_0 = dtype == "q8_0"
    ks, vs = (np.ascontiguousarray(c[0]).view(np.uint16) if q8_0 else None for c in (kv.k_scale, kv.v_scale))
    kc, vc = (np.ascontiguousarray(c[0]) for c in (kv.k, kv.v))
    table = np.ascontiguousarray(kv.page_table, np.int32)
    q32, sinks32 = host.f32(q), (host.f32(logits) if sinks else None)

    def run(splits, keys, pages):
        out = np.full((4, heads, dim), np.nan, np.float32)
        ml, acc = np.zeros(4 * heads * splits * 2, np.float32), np.zeros(4 * heads * splits * dim, np.float32)
        kernels.decode(
            *map(host.ptr, (q32, kc, vc, ks, vs, pages, slots, pos)),
            4,
            *map(host.ptr, (out, ml, acc)),
            heads,
            kv_heads,
            table.shape[1],
            kv.page_size,
            window or 0,
            keys,
            splits,
            ctypes.c_float(scale),
            ctypes.c_float(softcap),
            host.ptr(sinks32),
            int(q8_0),
            dim,
        )
        if splits == 1:
            return out
        rows = (4 * heads, splits)
        merged = host.merged_splits(
            ml.reshape(*rows, 2), acc.reshape(*rows, dim), np.tile(logits, 4) if sinks else None
        )
        return merged.reshape(out.shape)

    for splits, keys in ((1, 16), (3, 16), (5, 64)):
        got = run(splits, keys, table)
        assert np.isfinite(got).all() and group > 0
        assert relative_error(got, want) < 3e-3, (splits, relative_error(got, want))
    wrong = table.copy()
    wrong[1, :2] = wrong[0, :2]  # slot 1's first two pages read from slot 0's
    assert relative_error(run(1, 16, wrong), want) > 0.1
