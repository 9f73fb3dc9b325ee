"""A decode step's q and k products (and v's, where it has their weight type) with RoPE and the KV cache writes in the
kernel's epilogue: ``gemv.py``'s product of several weights of one x (``gemv_segments``), each thread's two
neighbouring outputs a rotation pair (2i, 2i + 1: the rotation of ``rope`` without ``neox``, as Llama's files
store q and k), rotated as ``attention.rope_write`` rotates them (a * cos - b * sin, a * sin + b * cos; entries past
the rotated ones copied), q stored rotated, k rotated and v into the layer's float storage at the row's position
(through its page table). Where v has another weight type (Q6_K in some layers of a Q4_K_M file) its product is its
own kernel and this one writes it into the storage beside k. One kernel where there were two (the products, then
``rope_write``): the CUDA backend's ``GEMV_Q_ROPE`` epilogue does the same.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.uop.ops import KernelInfo

from leat_backend_tinygrad import lanesum
from leat_backend_tinygrad.attention import storage_row
from leat_backend_tinygrad.gemv import (
    LAYOUTS,
    Shape,
    Threads,
    flat_buffer,
    plain_rows,
    segment_reader,
    within_rows,
    x_inputs,
    x_params,
)


def fitted(shape: Shape, sizes: tuple[int, ...], local: bool) -> Shape | None:
    """``shape`` fitted to the products' outputs as ``gemv_segments`` fits it, where each thread's outputs pair up
    (an even number a thread), else None."""
    fit = shape.fitting(math.gcd(*sizes), local)
    return fit if fit.per_thread % 2 == 0 else None


def _kernel(
    qtype, rows, sizes, blocks, local, shape, heads, kv_heads, dim, rotated, page_size, v_apart, integer, lane_sum
):
    layout = LAYOUTS[qtype]
    outputs, count = sum(sizes), len(sizes)
    words_a_block = layout.block_bytes(qtype) // layout.word.itemsize
    starts = [sum(sizes[:i]) for i in range(count)]  # each product's first output (q, k, then v where it is here)
    inputs = x_params(qtype, integer)

    def fxn(q_out: UOp, keys: UOp, values: UOp, *rest: UOp) -> UOp:
        x, rest = rest[:inputs], rest[inputs:]
        weights, (cos, sin, table, at), v_in = rest[:count], rest[count : count + 4], rest[count + 4 :]
        kind = keys.dtype
        storage_entries = keys.shape[0] * kv_heads * dim
        threads = Threads.make(layout, outputs, blocks, local, shape, lane_sum)
        stores, copies = [], []  # the products' results; v's copy where v is made apart (no sum: every lane's)
        products = [
            threads.products(
                qtype,
                segment_reader(weights, sizes, threads.first + r, threads.block, blocks, layout, words_a_block),
                x,
                integer,
            )
            for r in range(shape.per_thread)
        ]
        for j in range(shape.per_thread // 2):
            o = threads.first + 2 * j  # even: a rotation pair (o, o + 1) within one head of one product
            for n in range(rows):
                a, b = products[2 * j](n), products[2 * j + 1](n)
                position = at[n]
                stored = storage_row(table, n, position, keys, page_size)
                for s, (first, size) in enumerate(zip(starts, sizes)):
                    within = within_rows(o, first, size)
                    entry = o - first
                    head, e = entry // dim, entry % dim
                    if s == 2:  # v: as made
                        ya, yb = a, b
                    else:
                        pair = e // 2
                        if rotated == dim:
                            c, sn = cos[n, pair], sin[n, pair]
                        else:  # entries past the rotated ones copied
                            turned = e < rotated
                            inside = turned.where(pair, 0)
                            c, sn = turned.where(cos[n, inside], 1.0), turned.where(sin[n, inside], 0.0)
                        ya, yb = a * c - b * sn, a * sn + b * c
                    if s == 0:
                        at_q = n * size + entry
                        stores += [q_out[threads.gate(at_q, within)].store(ya)]
                        stores += [q_out[threads.gate(at_q + 1, within)].store(yb)]
                        continue
                    flat = (stored * kv_heads + head) * dim + e  # the storage's entry, flat (a gated store's index)
                    storage = (keys if s == 1 else values).reshape((storage_entries,))
                    stores += [storage[threads.gate(flat, within)].store(ya.cast(kind))]
                    stores += [storage[threads.gate(flat + 1, within)].store(yb.cast(kind))]
                    if s == 1 and v_apart:  # v made by its own kernel: written beside k
                        flat_values = values.reshape((storage_entries,))
                        for d in (0, 1):
                            value = v_in[0].reshape((rows * kv_heads * dim,))[
                                (n * kv_heads * dim + entry + d).valid(within)
                            ]
                            copies.append(flat_values[(flat + d).valid(within)].store(value.cast(kind)))
        name = f"gemv_{qtype.name.lower()}_{rows}_{outputs}_{blocks}" + ("_i16" if integer else "") + "_rope"
        ended = [store.end(*threads.ends) for store in stores] + [copy.end(*threads.apart) for copy in copies]
        return UOp.sink(*ended, arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn


def rope_write_products(
    x: Any,
    weights: list[Tensor],
    qtype: gguf.GGMLQuantizationType,
    shape: Shape,
    v: Tensor | None,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    table: Tensor,
    at: Tensor,
    page_size: int,
    rotated: int,
) -> Tensor:
    """q rotated, float32 [rows, heads, dim], from x [rows, k] (float, or for Q4_K and Q6_K ``intx.Quantized``) and
    the blocks' words of q's and k's weights (and v's, a third, where ``v`` is None; else ``v`` [rows, kv_heads * dim] is v's
    product, written as it is); k rotated and v written into ``keys`` and ``values`` [storage rows, kv_heads, dim] at
    each row's position ``at`` [rows] through its page table ``table`` [rows, pages]; ``cos`` and ``sin`` [rows,
    rotated / 2] each row's at its position. ``shape`` must be ``fitted``."""
    rows, blocks = x.shape[0], weights[0].shape[1]
    sizes = tuple(w.shape[0] for w in weights)
    dim = keys.shape[2]
    heads, kv_heads, half = sizes[0] // dim, keys.shape[1], rotated // 2
    local = Device[x.device].renderer.has_local
    x_in, integer = x_inputs(x, qtype)
    lane_sum, v_apart = lanesum.mode(x.device), v is not None
    fxn = _kernel(
        qtype, rows, sizes, blocks, local, shape, heads, kv_heads, dim, rotated, page_size, v_apart, integer, lane_sum
    )
    inputs = [*x_in, *(flat_buffer(w) for w in weights)]
    inputs += [cos.reshape(rows, half).contiguous(), sin.reshape(rows, half).contiguous()]
    inputs += [table.cast(dtypes.int32).contiguous(), at.cast(dtypes.int32).contiguous()]
    inputs += [plain_rows(v)] if v is not None else []
    q_out = Tensor.empty(rows * heads * dim, dtype=dtypes.float32, device=x.device)
    q_rot, written_k, written_v = q_out.custom_kernel(keys, values, *inputs, fxn=fxn)[:3]
    Tensor.realize(q_rot, written_k, written_v)
    return q_rot.reshape(rows, heads, dim)
