"""RMS norm of a few rows as one tinygrad kernel of our own (a UOp program, ``Tensor.custom_kernel``, as ``gemv.py``).

``y[n, i] = x[n, i] / sqrt(mean(x[n] ** 2) + eps) * w[i]``. tinygrad's own schedule of ``rms_norm``'s Tensor ops is
two kernels: the sum of squares (for the 8B file's rows of 4096, one thread group of 16 threads, each looping over
256 values one load at a time: a chain of dependent loads) and the scaling. Here a thread group (a CUDA block) is a
row: each of its ``lanes(k)`` threads loads its values at once as 128-bit loads (4 floats, neighbouring threads
neighbouring words), adds their squares, the group adds the lanes' sums (``lanesum.py``: warp shuffles on CUDA,
local memory elsewhere), and each thread scales and stores the values it holds in registers. Devices without
local memory (tinygrad's CPU device) keep the Tensor ops.
"""

from __future__ import annotations

from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.uop.ops import AxisType, KernelInfo

from leat_backend_tinygrad import intx, lanesum
from leat_backend_tinygrad.gemv import plain_rows, row_entry

VECTOR = 4  # floats a load (128 bits)
MOST_LANES, FEWEST_LANES = 128, 32  # threads a row: the most that divide it, at least FEWEST_LANES
MOST_VALUES = 64  # values a thread holds at most (registers)


def lanes(k: int) -> int | None:
    """Threads of a row of ``k`` values (each VECTOR values a load, at most MOST_VALUES), or None where none fit."""
    n = MOST_LANES
    while n >= FEWEST_LANES:
        if k % (n * VECTOR) == 0:
            return n if k // n <= MOST_VALUES else None
        n //= 2
    return None


def run_lanes(k: int) -> int | None:
    """Threads of a row of ``k`` values where each holds whole runs of 32 (``intx.RUN``; one or two, at most
    MOST_LANES threads), for the kernel that also quantizes its output; None where none fit."""
    if k % intx.RUN:
        return None
    runs = k // intx.RUN
    for per_lane in (1, 2):
        if runs % per_lane == 0 and runs // per_lane <= MOST_LANES:
            return runs // per_lane
    return None


def applies(x: Tensor) -> bool:
    """Whether ``x`` (float32 rows [rows, k]) takes the kernel: a device with local memory and a row it divides."""
    return len(x.shape) == 2 and lanes(x.shape[1]) is not None and Device[x.device].renderer.has_local


def _ring_entry(out: UOp, row: UOp, column: int | UOp, depth: int) -> UOp:
    """Where entry (row, column) of x goes in ring.py's interleaved float16 layout (:func:`ring.interleaved`, whose
    thread writes it as entry j of its unit): rows g and g + 8 of a 16-row tile as one row of pairs, each slice of
    ``depth`` inputs in quarters t, a quarter's halves in units swapped on odd g, a unit's words of the two rows
    alternating."""
    tile, g, upper = row // 16, row % 8, (row // 8) % 2
    part, at = column // depth, column % depth
    t, within = at // (depth // 4), at % (depth // 4)
    unit = (within // 4 + g) % 2  # the quarter's half holding the column, swapped on odd g
    j = (within % 4) // 2 * 4 + upper * 2 + within % 2
    return out[tile * 8 + g, (part * 8 + t * 2 + unit) * 8 + j]


def _kernel(rows: int, k: int, eps: float, weighted: bool, quantized: bool, kind: str, ring_depth: int = 0):
    """The norm's kernel: out [rows, k] float32 (with ``quantized``, intx's three outputs first), or, with
    ``ring_depth``, out in ring.py's interleaved float16 layout of that depth (rows: the padded count)."""
    n = run_lanes(k) if quantized else lanes(k)
    assert n is not None

    def fxn(out: UOp, *params: UOp) -> UOp:
        quants, (x, *weight) = (params[:3], params[3:]) if quantized else ((), params)
        row = UOp.range(rows, 0, AxisType.GLOBAL)
        threads = lanesum.Lanes.make((n,), 1, kind, True)
        lane = threads.at(0)
        if quantized:  # the lane's whole runs, one after the other (each run's integers made from its own values)
            per_lane = k // (n * intx.RUN)
            at = [(lane * per_lane + m) * intx.RUN + j for m in range(per_lane) for j in range(intx.RUN)]
        else:  # VECTOR neighbours at a time, the row's n lanes covering n * VECTOR neighbours a load
            at = [(s * n + lane) * VECTOR + v for s in range(k // (n * VECTOR)) for v in range(VECTOR)]
        values = [row_entry(x, row, i, k) for i in at]
        squares = [v * v for v in values]
        total = threads.sum(sum(squares[1:], squares[0]))
        factor = (total * (1.0 / k) + eps).rsqrt()
        stores, ys = [], []
        for i, v in zip(at, values):  # the values the thread loaded, scaled: no second load of x
            y = v * factor
            ys.append(y * weight[0][i] if weighted else y)
            place = _ring_entry(out, row, i, ring_depth) if ring_depth else out[row, i]
            stores.append(place.store(ys[-1].cast(dtypes.float16) if ring_depth else ys[-1]))
        if quantized:
            for m in range(len(ys) // intx.RUN):
                run = lane * (len(ys) // intx.RUN) + m
                stores += intx.run_stores(quants, row, run, ys[m * intx.RUN : (m + 1) * intx.RUN])
        return UOp.sink(
            UOp.group(*stores).end(row, *threads.threads()),
            arg=KernelInfo(
                name=f"rms_norm_{rows}_{k}" + ("_i16" if quantized else "_ring" if ring_depth else ""), opts_to_apply=()
            ),
        )

    return fxn


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """float32 [rows, k]: ``x`` [rows, k] over its rows' root mean square, times ``weight`` [k] (or not), as one kernel
    (``applies`` must hold)."""
    rows, k = x.shape
    out = Tensor.empty(rows, k, dtype=dtypes.float32, device=x.device)
    extra = [] if weight is None else [weight.reshape(k).cast(dtypes.float32).contiguous()]
    fxn = _kernel(rows, k, eps, weight is not None, False, lanesum.mode(x.device))
    return out.custom_kernel(plain_rows(x), *extra, fxn=fxn)[0]


def rms_norm_laid_out(x: Tensor, weight: Tensor | None, eps: float, depth: int, rows: int) -> Tensor:
    """``rms_norm``'s output as ring.py's kernel reads it (:func:`ring.interleaved`: float16, ``rows`` padded with
    zero rows, each tile's rows interleaved in pairs for slices of ``depth``), written so by the norm's own kernel:
    no float32 output, no interleave kernel after it (``applies`` must hold; ``depth`` a multiple of 16)."""
    n, k = x.shape
    out = Tensor.empty(rows // 2, 2 * k, dtype=dtypes.float16, device=x.device)
    extra = [] if weight is None else [weight.reshape(k).cast(dtypes.float32).contiguous()]
    fxn = _kernel(rows, k, eps, weight is not None, False, lanesum.mode(x.device), depth)
    source = plain_rows(x) if rows == n else x.pad(((0, rows - n), (0, 0))).contiguous()  # zero rows: zero norms
    return out.custom_kernel(source, *extra, fxn=fxn)[0]


def rms_norm_quantized(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, intx.Quantized]:
    """``rms_norm``'s output and, from the same kernel, that output as ``intx.quantize`` makes it (for integer
    products); each thread holds whole runs of 32 (``run_lanes`` must fit, besides ``applies``)."""
    rows, k = x.shape
    out = Tensor.empty(rows, k, dtype=dtypes.float32, device=x.device)
    extra = [] if weight is None else [weight.reshape(k).cast(dtypes.float32).contiguous()]
    fxn = _kernel(rows, k, eps, weight is not None, True, lanesum.mode(x.device))
    made = out.custom_kernel(*intx.empty(rows, k, x.device), plain_rows(x), *extra, fxn=fxn)
    return made[0], intx.Quantized(*made[1:4])
