"""Time formulations of a one-row product with a quantized weight on tinygrad's device (Llama-3-8B shapes):
tinygrad's fused plan, sums split in 8/16/32/per block, nibbles without concatenation, Q4_K scale planes decoded
at load; `--beam` adds a BEAM=2 search of the fused 4096 x 4096 product. On the lent H200: DEV=CUDA (see
backends/tinygrad/README.md for the figures). Needs tinygrad, gguf and leat-backend-tinygrad."""

import sys
import time

import gguf
import numpy as np
from leat_backend_tinygrad.quants import DEQUANTIZERS
from tinygrad import Device, Tensor, TinyJit, dtypes

Q = gguf.GGMLQuantizationType
dev = Device.DEFAULT
rng = np.random.default_rng(0)


def weight(qtype, n, k):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:
        b[..., :4] = np.array([3e-5, 3e-5], np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        b[..., -2:] = np.array([3e-5], np.float16).view(np.uint8)
    return Tensor(b, device=dev).realize(), b


def variants(qtype, w, n, k, host):
    deq = lambda: DEQUANTIZERS[qtype](w).reshape(n, k)

    def plain(x):
        return x @ deq().T

    def split(s):
        def f(x):
            return (x.reshape(1, 1, s, k // s) * deq().reshape(1, n, s, k // s)).sum(-1).contiguous().sum(-1)

        return f

    def nocat(x):  # Q4_K without the nibble cat: low and high nibbles multiply their own halves of x
        from leat_backend_tinygrad.quants import _f16, _k_scale_min

        nb = k // 256
        d, dmin = _f16(w[..., :2]), _f16(w[..., 2:4])
        sc, mn = _k_scale_min(w[..., 4:16])
        scale, minv = (d * sc).reshape(1, n, nb, 4, 2), (dmin * mn).reshape(1, n, nb, 4, 2)
        qs = w[..., 16:].reshape(1, n, nb, 4, 32).cast(dtypes.int32)
        xs = x.reshape(1, 1, nb, 4, 2, 32)
        lo = ((qs % 16).cast(dtypes.float32) * xs[..., 0, :]).sum(-1)
        hi = ((qs // 16).cast(dtypes.float32) * xs[..., 1, :]).sum(-1)
        sums = xs.sum(-1)
        part = scale[..., 0] * lo + scale[..., 1] * hi - (minv * sums).sum(-1)
        return part.reshape(1, n, nb * 4).sum(-1)

    def planes(x):  # Q4_K with per-sub-block scale and min planes made on the host at load (float32)
        nb = k // 256
        flat = host.reshape(-1, 144)
        d = flat[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(flat[:, 4:16].copy())
        if not hasattr(planes, "t"):
            planes.t = (
                Tensor((d * sc).reshape(n, nb, 8, 1), device=dev).realize(),
                Tensor((dmin * mn).reshape(n, nb, 8, 1), device=dev).realize(),
                Tensor(np.ascontiguousarray(flat[:, 16:]).reshape(n, nb, 4, 1, 32), device=dev).realize(),
            )
        scale, minv, qs = planes.t
        qs = qs.cast(dtypes.int32)
        q = (qs % 16).cat(qs // 16, dim=-2).reshape(n, nb, 8, 32).cast(dtypes.float32)
        wv = (scale * q - minv).reshape(1, n, 16, k // 16)
        return (x.reshape(1, 1, 16, k // 16) * wv).sum(-1).contiguous().sum(-1)

    extra = {"nocat": nocat, "planes split 16": planes} if qtype == Q.Q4_K else {}
    return {
        **extra,
        "fused x@W.T": plain,
        "split 8": split(8),
        "split 16": split(16),
        "split 32": split(32),
        "split blocks": split(k // 256),
    }


for qtype, n, k in (
    (Q.Q4_K, 14336, 4096),
    (Q.Q4_K, 4096, 4096),
    (Q.Q4_K, 4096, 14336),
    (Q.Q6_K, 4096, 14336),
    (Q.Q6_K, 128256, 4096),
):
    w, host = weight(qtype, n, k)
    want = None
    x = Tensor(rng.standard_normal((1, k)).astype(np.float32), device=dev).realize()
    nbytes = host.nbytes
    for name, f in variants(qtype, w, n, k, host).items():
        try:
            jit = TinyJit(lambda x, f=f: f(x).realize())
            for _ in range(3):
                out = jit(x)
            Device[dev].synchronize()
            t = time.perf_counter()
            reps = 20
            for _ in range(reps):
                out = jit(x)
            Device[dev].synchronize()
            dt = (time.perf_counter() - t) / reps
            got = out.numpy().reshape(-1)
            if want is None:
                want = got
            err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
            print(
                f"{qtype.name} {n}x{k} {name:14s} {dt * 1e3:8.3f} ms {nbytes / dt / 1e9:7.1f} GB/s  err {err:.1e}",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, the rest still run
            print(f"{qtype.name} {n}x{k} {name}: {type(e).__name__} {str(e)[:200]}", flush=True)

if "--beam" in sys.argv:
    from tinygrad.helpers import Context

    qtype, n, k = Q.Q4_K, 4096, 4096
    w, host = weight(qtype, n, k)
    x = Tensor(rng.standard_normal((1, k)).astype(np.float32), device=dev).realize()
    t0 = time.perf_counter()
    with Context(BEAM=2):
        jit = TinyJit(lambda x: (x @ DEQUANTIZERS[qtype](w).reshape(n, k).T).realize())
        for _ in range(3):
            out = jit(x)
    print("beam search seconds", round(time.perf_counter() - t0, 1))
    Device[dev].synchronize()
    t = time.perf_counter()
    for _ in range(20):
        out = jit(x)
    Device[dev].synchronize()
    dt = (time.perf_counter() - t) / 20
    print(f"Q4_K 4096x4096 fused BEAM=2 {dt * 1e3:8.3f} ms {host.nbytes / dt / 1e9:7.1f} GB/s")
