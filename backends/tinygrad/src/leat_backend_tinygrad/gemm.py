"""Many-row float16 products (prefill chunks) as a tinygrad kernel of our own whose optimisations are chosen per shape.

``y[n, o] = sum_k x[n, k] * w[o, k]``, x and w float16, the sums float32: the kernel tinygrad builds for
``x.matmul(w.T, dtype=dtypes.float32)`` (the same ranges, numbered as tinygrad numbers them, and the same reduce of
the float16 products cast to float32), written as a UOp program (``Tensor.custom_kernel``) so that its
``KernelInfo(opts_to_apply=...)`` carries the optimisations (tinygrad's ``Opt``: tensor cores, upcasts, locals): tinygrad
applies those in place of its hand-coded heuristic (``apply_opts`` in tinygrad/codegen/opt/postrange.py). tinygrad
0.14 offers no other way to pin a kernel's optimisations: ``Tensor.contiguous(arg=opts)`` is dropped before
``apply_opts`` (the kernel gets the heuristic's). With no opts for a shape the product is tinygrad's own matmul.

The opts (:data:`TC_OPTS`) were found by tinygrad's beam search (``BEAM=2``) on the H200 for a 512-row chunk of the 8B
file's products (issue #22): gate/up 4096 -> 14336 575.7 us against the heuristic's 935.0, k/v 4096 -> 1024 98.1
against 281.6, q/o 4096 -> 4096 238.3 against 262.6. A product takes the set found for the output size nearest its
own (:func:`opts_for`); shapes they do not divide, too few rows, or other devices keep tinygrad's own (:func:`tuned_opts`).
"""

from __future__ import annotations

import functools

from tinygrad import Tensor, UOp, dtypes
from tinygrad.codegen import full_rewrite_to_sink
from tinygrad.codegen.opt import KernelOptError, Opt, OptOps
from tinygrad.codegen.opt.tc import cuda_81616
from tinygrad.renderer import Renderer
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

TC, UPCAST, LOCAL, SWAP = OptOps.TC, OptOps.UPCAST, OptOps.LOCAL, OptOps.SWAP
#: (largest output size, opts) in order: a product takes the first whose bound its output size is under (None: any);
#: the bounds lie halfway (in log) between the output sizes the opts were found for (1024, 4096, 14336)
TC_OPTS: tuple[tuple[int | None, tuple[Opt, ...]], ...] = (
    (2048, (Opt(TC, 0, (-1, 0, 1)), Opt(UPCAST, 1, 4), Opt(UPCAST, 0, 2), Opt(SWAP, 0, 1))),  # k/v: 1024 outputs
    (7680, (Opt(TC, 0, (-1, 2, 1)), Opt(UPCAST, 1, 4), Opt(UPCAST, 0, 4))),  # q/o: 4096
    (None, (Opt(TC, 0, (-1, 2, 1)), Opt(UPCAST, 1, 7), Opt(UPCAST, 0, 4), Opt(LOCAL, 0, 8))),  # gate/up: 14336
)
#: the opts were found for 512-row chunks; products with fewer rows keep tinygrad's own choice
MIN_ROWS = 256


def _kernel(rows: int, outputs: int, inputs: int, opts: tuple[Opt, ...] | None):
    def fxn(out: UOp, x: UOp, w: UOp) -> UOp:
        # numbered as tinygrad's scheduler numbers a matmul's ranges (the reduce first): the opts' axes refer to them
        k, n, o = UOp.range(inputs, 0, AxisType.REDUCE), UOp.range(rows, 1), UOp.range(outputs, 2)
        total = (x[n, k] * w[o, k]).cast(dtypes.float32).reduce(k, arg=Ops.ADD)
        return out[n, o].store(total).end(n, o).sink(arg=KernelInfo(opts_to_apply=opts))

    return fxn


def opts_for(outputs: int) -> tuple[Opt, ...]:
    """The opts of :data:`TC_OPTS` for a product of ``outputs`` outputs."""
    return next(opts for bound, opts in TC_OPTS if bound is None or outputs < bound)


def applies(renderer: Renderer, rows: int, outputs: int, inputs: int, opts: tuple[Opt, ...]) -> bool:
    """Whether tinygrad can apply ``opts`` to the product of this shape with ``renderer`` (tensor cores there, sizes
    they divide): the kernel is taken through tinygrad's optimisation passes (no compiling), as its realize would;
    tinygrad raises KernelOptError on an opt that does not apply."""
    out, half = UOp.placeholder((rows, outputs), dtypes.float32, 0), dtypes.float16
    params = (out, UOp.placeholder((rows, inputs), half, 1), UOp.placeholder((outputs, inputs), half, 2))
    try:
        full_rewrite_to_sink(_kernel(rows, outputs, inputs, opts)(*params), renderer)
    except KernelOptError:
        return False
    return True


@functools.cache
def tuned_opts(renderer: Renderer, rows: int, outputs: int, inputs: int) -> tuple[Opt, ...] | None:
    """The opts of :data:`TC_OPTS` for a product of this shape, or None (tinygrad's own choice): a renderer without
    NVIDIA's sm_80+ float16 tensor cores (the opts were found on the H200 with them), fewer than MIN_ROWS rows, or
    opts tinygrad cannot apply to the shape."""
    if cuda_81616[0] not in renderer.tensor_cores or rows < MIN_ROWS:
        return None
    opts = opts_for(outputs)
    return opts if applies(renderer, rows, outputs, inputs, opts) else None


def half_product(x: Tensor, w: Tensor, opts: tuple[Opt, ...] | None = None) -> Tensor:
    """float32 [rows, outputs] = x [rows, inputs] @ w.T, x and w float16 (contiguous), as one kernel with ``opts``
    applied (None: tinygrad's own matmul, the same kernel with its heuristic's)."""
    if opts is None:
        return x.matmul(w.T, dtype=dtypes.float32).contiguous()
    (rows, inputs), outputs = x.shape, w.shape[0]
    out = Tensor.empty(rows, outputs, dtype=dtypes.float32, device=x.device)
    return out.custom_kernel(x, w, fxn=_kernel(rows, outputs, inputs, opts))[0]
