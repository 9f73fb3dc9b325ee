"""wgmma.cu's gemm_wg (Hopper's warpgroup products of 9-64 tokens) and wg_order_x compiled for the host with g++ and
run with each CUDA thread a fiber (test_moe_mla_on_host.py's harness), wgmma emulated by tests/host/wgmma.cuh from
PTX's fragment layout and the B descriptor's strides. Against float64 products of the f16 inputs the kernel takes:
every token tile, tokens that fill a tile and that do not, rows past the last block's, K whole and split into
partial sums. The GPU test (test_gpu_ops.py) runs the real instruction on an H100 or H200; this checks the kernel's
logic and layouts on any machine with g++ (skipped where it is missing)."""

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from leat.modelfile import Tensor
from leat.testing import relative_error
from leat_backend_cpu.backend import CPUBackend
from leat_backend_cuda import quants, wgmma

_spec = importlib.util.spec_from_file_location("moe_mla_on_host", Path(__file__).parent / "test_moe_mla_on_host.py")
host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host)
_spec = importlib.util.spec_from_file_location("gpu_ops", Path(__file__).parent / "test_gpu_ops.py")
gpu_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_ops)
ptr, f32 = host.ptr, host.f32
Q = gguf.GGMLQuantizationType
TYPES = (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.IQ4_XS, Q.F16)

HARNESS = r"""
#define WG_EXPORTS(T)                                                                                            \
    extern "C" void order_##T(const u16* xh, u16* xo, int n, int k, int nt) {                                  \
        launch({3, 1, 1}, 64, [=] {                                                                              \
            if (nt == 2) wg_order_x<T, 2>(xh, xo, n, k);                                                         \
            else if (nt == 4) wg_order_x<T, 4>(xh, xo, n, k);                                                    \
            else wg_order_x<T, 8>(xh, xo, n, k);                                                                 \
        });                                                                                                      \
    }                                                                                                            \
    extern "C" void gemm_##T(const u8* w, i64 nb, const u16* xo, const float* xscale, float* y,                 \
                             const float* bias, int m, int n, int k, int kchunk, int nt) {                       \
        const Dim grid{(unsigned)((m + 127) / 128), (unsigned)((k + kchunk - 1) / kchunk),                      \
                       (unsigned)((n + 8 * nt - 1) / (8 * nt))};                                                 \
        launch(grid, 256, [=] {                                                                                  \
            if (nt == 2) gemm_wg<T, 2>(w, nb, xo, xscale, y, bias, m, n, k, kchunk);                             \
            else if (nt == 4) gemm_wg<T, 4>(w, nb, xo, xscale, y, bias, m, n, k, kchunk);                        \
            else gemm_wg<T, 8>(w, nb, xo, xscale, y, bias, m, n, k, kchunk);                                     \
        });                                                                                                      \
    }
"""


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    source = host._kernel("wgmma.cu").replace(
        "extern __shared__ __align__(128) u16 xs[];", "u16* xs = (u16*)host_smem;"
    )
    assert "host_smem" in source  # the replacement took: the kernel's dynamic shared memory is the harness's
    structs = sorted({quants.LAYOUTS[q].struct for q in TYPES})
    harness = HARNESS + "".join(f"WG_EXPORTS({s})\n" for s in structs)
    headers = {name: host._kernel(name) for name in ("quants.cuh", "iq_grids.cuh")}
    headers["mma.cuh"] = (Path(__file__).parent / "host" / "mma.cuh").read_text()
    headers["wgmma.cuh"] = (Path(__file__).parent / "host" / "wgmma.cuh").read_text()
    return host.host_library(tmp_path_factory, "wgmma-host", source + harness, headers)


def _weights(qtype, rows, cols, rng):
    """A random matrix's device bytes, its blocks, and its exact values (test_gpu_ops.stored: quantized by gguf-py,
    or random blocks with small scales for the types gguf-py cannot quantize)."""
    data = gpu_ops.stored(qtype, rows, cols, rng)
    exact = CPUBackend("f64").upload(Tensor("w", qtype, (rows, cols), data))
    return quants.device_bytes(qtype, data), quants.blocks_of(qtype, rows, cols), np.asarray(exact, np.float64)


def _product(kernels, qtype, stored, blocks, xh, xscale, bias, m, k, kchunk):
    """gemm_wg's output (its split parts summed) for x's f16 rows ``xh``, through wg_order_x."""
    n = len(xh)
    nt = wgmma.wg_tile(n)
    struct = quants.LAYOUTS[qtype].struct
    xo = np.full((-(-n // (8 * nt)) * 8 * nt, k), 0x7E00, np.uint16)  # NaN where wg_order_x writes nothing
    getattr(kernels, f"order_{struct}")(ptr(xh), ptr(xo), n, k, nt)
    splits = -(-k // kchunk)
    y = np.full((splits, n, m), np.nan, np.float32)
    getattr(kernels, f"gemm_{struct}")(
        ptr(stored), blocks, ptr(xo), ptr(xscale), ptr(y), ptr(bias), m, n, k, kchunk, nt
    )
    return y.sum(axis=0, dtype=np.float64)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gemm_wg_against_float64_over_tiles_and_splits(kernels, qtype):
    """9, 16, 17, 33 and 64 tokens (tiles of 16, 32 and 64; the last two tiles part-empty), 136 rows (the second
    block's last 120 rows past M), 768 columns: K whole, and split into 512 + 256 and 3 x 256; a bias. Each output
    against the float64 product of the same f16 x (with its scales) and the exact weights."""
    rng = np.random.default_rng(9000 + int(qtype))
    m, k = 136, 768
    stored, blocks, exact = _weights(qtype, m, k, rng)
    bias = f32(rng.standard_normal(m))
    for n in (9, 16, 17, 33, 64):
        xh = rng.standard_normal((n, k)).astype(np.float16)
        xscale = f32(2.0 ** rng.integers(-4, 5, n))
        want = (xh.astype(np.float64) * xscale[:, None]) @ exact.T + bias
        for kchunk in (768, 512, 256):
            got = _product(kernels, qtype, stored, blocks, xh.view(np.uint16), xscale, bias, m, k, kchunk)
            assert np.isfinite(got).all(), (n, kchunk)
            for t in range(n):
                assert relative_error(got[t], want[t]) < 2e-3, (n, kchunk, t)


def test_the_check_fails_when_x_is_not_in_the_fragments_order(kernels):
    """The comparison above can fail: x copied in its own order (not wg_order_x's) gives wrong products."""
    rng = np.random.default_rng(1)
    qtype, m, k, n = Q.Q4_K, 128, 256, 16
    stored, blocks, exact = _weights(qtype, m, k, rng)
    xh = rng.standard_normal((n, k)).astype(np.float16)
    xscale, bias = np.ones(n, np.float32), np.zeros(m, np.float32)
    y = np.full((1, n, m), np.nan, np.float32)
    plain = np.ascontiguousarray(xh.view(np.uint16))
    kernels.gemm_TQ4_K(ptr(stored), blocks, ptr(plain), ptr(xscale), ptr(y), ptr(bias), m, n, k, k, 2)
    want = xh.astype(np.float64) @ exact.T
    assert relative_error(y[0, 0], want[0]) > 0.1
    got = _product(kernels, qtype, stored, blocks, plain, xscale, bias, m, k, k)
    assert relative_error(got[0], want[0]) < 2e-3


def test_the_order_is_a_permutation_of_each_chunk(kernels):
    """wg_order_x moves every value of a tile's chunk once and nothing across chunks; tokens past n are zeros."""
    k, n = 512, 9
    xh = np.arange(n * k, dtype=np.uint16).reshape(n, k)  # each value names its place (below 2^16)
    for qtype in TYPES:
        xo = np.full((16, k), 0xFFFF, np.uint16)
        getattr(kernels, f"order_{quants.LAYOUTS[qtype].struct}")(ptr(xh), ptr(xo), n, k, 2)
        flat = xo.reshape(-1)
        for chunk in range(k // wgmma.WG_KC):
            part = flat[chunk * 16 * wgmma.WG_KC : (chunk + 1) * 16 * wgmma.WG_KC]
            values = part[part != 0]  # tokens 9-15 are zeros (and so is x[0, 0])
            every = np.arange(1, n * k)
            assert np.array_equal(np.sort(values), every[(every % k) // wgmma.WG_KC == chunk]), (qtype, chunk)
