"""Decode attention (every row of a batch one token) for all rows at once, as tinygrad kernels of our own (UOp
programs, ``Tensor.custom_kernel``, the pattern of ``gemv.py``), reading keys and values straight from the paged KV
storage through each row's page table (no gather of a row's pages into a copy first).

Before them ``write_rows`` writes every row's new key (then value) into float storage as one kernel, at the
storage row its page table gives its position (q8_0 storage is written row by row, as a prompt's). Then three
kernels a layer, whatever the batch's rows:

1. ``scores``: a thread per (row, KV head, position t) reads the key at t once, through the row's page table
   (storage row ``table[row, t // page_size] * page_size + t % page_size``), and makes the score of every query
   head of its GQA group: the dot product times ``scale``, soft-capped where a cap is given, -inf where t is
   past the row's own position or, in a windowed layer, ``window`` or more positions before it.
2. ``chunks``: flash-decoding's split. The positions are cut into chunks of ``CHUNK``; a thread per (row, KV head,
   chunk, value entry d) takes each head of its group through its chunk's scores three times (their max m, the sum
   of exp(score - m), the sum of exp(score - m) * value[t, d], the value read once for the group) and stores the
   three. A chunk with every position masked stores m = -1e30 and zero sums, which the third step weighs by 0.
3. ``combine``: a thread per (row, head, value entry d) takes the chunks' maxima to their max M (and the head's sink
   logit, where sinks are given) and writes sum_c exp(m_c - M) * num_c / (sum_c exp(m_c - M) * den_c + exp(sink - M)).

On a device with thread groups (a GPU) the first two are one kernel (``_fused_kernel``; the backend's default,
``LEAT_TINYGRAD_FUSED_ATTENTION=0`` keeps them apart): a thread group a (row, KV head, chunk) writes its chunk's
scores into local memory and takes them through the second kernel's three passes, so the scores never go to global
memory and a layer's attention is two launches. Its combine shares each value entry's chunks among up to 32 lanes
(``combine_lanes``: each loads its few chunks' values at once, then the lanes take the max and the sums through
``lanesum.py``, warp shuffles on CUDA) rather than one thread looping over every chunk.

The positions are all of a row's table (pages x page_size, the slot's capacity, as the row-by-row path's gather),
those past the row's own masked. On a GPU a thread group (a CUDA block) is up to 32 positions of one (row, KV head)
in the first kernel and the value entries of one (row, head[, chunk]) in the others; ``chunks`` stores m and the
exponents' sum once per entry d (the same value), which ``combine`` reads at d = 0. Every exponent has its max
subtracted (no overflow). KV storage of float32, float16 or q8_0 (int8 quants and a
float16 scale per 32 values) is read as stored and dequantized as it is read. Devices without local memory
(tinygrad's CPU device) run the rows as its one global axis and every other thread axis as a loop.
"""

from __future__ import annotations

import math

from tinygrad import Device, Tensor, UOp, dtypes
from tinygrad.dtype import AddrSpace
from tinygrad.uop.ops import AxisType, KernelInfo, Ops

from leat_backend_tinygrad import lanesum
from leat_backend_tinygrad.gemv import plain_rows, row_entry

CHUNK = 64  # positions of one chunk of the second kernel at most (or the largest power of two dividing the positions)
# ... halved down to MIN_CHUNK while there are fewer than CHUNKS chunks: the second kernel has a thread per (row, KV
# head, chunk, value entry), so a small cache in few long chunks leaves most of a GPU idle (docs/benchmarks.md: the
# tinygrad decode's device time by cache size)
MIN_CHUNK, CHUNKS = 16, 32
# ... down to FUSED_MIN_CHUNK for the fused kernel, whose thread group takes its chunk's scores itself: on the H200 a
# 640-position slot's attention took 15.45 us a layer in 20 chunks of 32 against 20.42 in 40 of 16 (docs/benchmarks.md,
# thirty-second session, scripts/tinygrad_attention_times.py)
FUSED_MIN_CHUNK = 32
KEY_VECTOR = 32  # a key's entries a thread loads at once in the scores kernel (64 bytes of float16)
SCORES_SLOT = 900  # the fused kernel's local buffer (its id apart from the kernel's own buffers' slots)
COMBINE_LANES, COMBINE_THREADS, COMBINE_PER = 32, 128, 16  # the combine's lanes a value entry at most, its
# threads a group, and chunks a lane at most
EMPTY = -1e30  # the max of a chunk with every position masked: finite, so exp(score - max) is 0, never NaN


def _range(size: int, axis: int, kind: AxisType) -> UOp:
    """A range, or for a size of one the constant 0 (tinygrad folds a range of one into 0, and a reduce or an END
    over it would then have no range)."""
    return UOp.range(size, axis, kind) if size > 1 else UOp.range(2, axis, kind).const_like(0)


def _reduce(x: UOp, r: UOp, op: Ops) -> UOp:
    """x reduced over range r (nothing to reduce over a constant: a range of one)."""
    return x.reduce(r, arg=op) if r.op is Ops.RANGE else x


def _end(x: UOp, *ranges: UOp) -> UOp:
    """x ended over the ranges that are ranges (not constants: a range of one)."""
    return x.end(*(r for r in ranges if r.op is Ops.RANGE))


def _value(storage: UOp, scales: UOp | None, row: UOp, head: UOp, d: UOp, seen: UOp) -> UOp:
    """float32 of a stored K or V entry (a q8_0 quant times its block's float16 scale), read only where ``seen``
    (else 0, no load: a position the row does not attend costs no memory traffic)."""
    row = row.valid(seen)
    x = storage[row, head, d].cast(dtypes.float32)
    return x if scales is None else x * scales[row, head, d // 32].cast(dtypes.float32)


def storage_row(table: UOp, row: UOp, position: UOp, storage: UOp, page_size: int) -> UOp:
    """The storage row of row ``row``'s ``position`` through its page table, the table's entry clamped to the
    storage's pages (every entry is one already): with the entry's bounds known, tinygrad drops the wrap-around it
    otherwise computes for each index into the storage, and neighbouring entries' loads become one wide load."""
    entry = table[row, position // page_size].cast(dtypes.weakint)
    return entry.maximum(0).minimum(storage.shape[0] // page_size - 1) * page_size + position % page_size


def _seen(t: UOp, own: UOp, window: int | None) -> UOp:
    """Whether a row at position ``own`` attends position ``t``: t <= own, and within its last ``window``."""
    seen = t <= own
    return seen if window is None else seen & (t > own - window)


def _scores_kernel(rows, heads, kv_heads, dim, positions, page_size, scale, window, softcap, local, quantized):
    group = heads // kv_heads
    tile = math.gcd(positions, 32) if local else 1  # positions of one thread group (a CUDA block)

    def fxn(out: UOp, q: UOp, keys: UOp, table: UOp, at: UOp, *scales: UOp) -> UOp:
        loop = AxisType.GLOBAL if local else AxisType.LOOP
        row = _range(rows, 0, AxisType.GLOBAL)
        head = _range(kv_heads, 1, loop)
        tiles = _range(positions // tile, 2, loop)
        inner = _range(tile, 3, AxisType.LOCAL) if tile > 1 else None
        # a key's entries VECTOR at a time (one wide load; a q8_0 block's VECTOR share its scale)
        vector = math.gcd(dim, KEY_VECTOR)
        d = _range(dim // vector, 4, AxisType.REDUCE)
        t = tiles * tile + inner if inner is not None else tiles
        stored = storage_row(table, row, t, keys, page_size)
        seen = _seen(t, at[row], window)
        entries = [d * vector + j for j in range(vector)]
        key = [_value(keys, scales[0] if quantized else None, stored, head, e, seen) for e in entries]
        stores = []
        for g in range(group):
            terms = [q[row, head * group + g, e] * k for e, k in zip(entries, key)]
            score = _reduce(sum(terms[1:], terms[0]), d, Ops.ADD) * scale
            if softcap is not None:
                score = (score / softcap).tanh() * softcap
            stores.append(out[row, head * group + g, t].store(seen.where(score, -math.inf)))
        # the group's stores in one loop nest (an END each would be a loop nest each, the key loaded in each)
        ends = (row, head, tiles) if inner is None else (row, head, tiles, inner)
        return UOp.sink(
            _end(UOp.group(*stores), *ends),
            arg=KernelInfo(name=f"attn_scores_{rows}_{heads}_{positions}", opts_to_apply=()),
        )

    return fxn


def _chunks_kernel(rows, heads, kv_heads, value_dim, positions, page_size, chunk, window, local, quantized):
    group, chunks = heads // kv_heads, positions // chunk

    def fxn(num: UOp, peak: UOp, den: UOp, scores: UOp, values: UOp, table: UOp, at: UOp, *scales: UOp) -> UOp:
        loop = AxisType.GLOBAL if local else AxisType.LOOP
        row = _range(rows, 0, AxisType.GLOBAL)
        head = _range(kv_heads, 1, loop)
        c = _range(chunks, 2, loop)
        d = _range(value_dim, 3, AxisType.LOCAL if local else AxisType.LOOP)
        # three passes over the chunk, each its own loop: the max, the exponents' sum, the values' weighted sum
        t1, t2, t3 = (_range(chunk, 4 + i, AxisType.REDUCE) for i in range(3))
        t = c * chunk + t3
        stored = storage_row(table, row, t, values, page_size)
        seen = _seen(t, at[row], window)  # a position not seen has score -inf: weight 0, its value not read
        value = _value(values, scales[0] if quantized else None, stored, head, d, seen)  # one load for the group
        stores = []
        for g in range(group):
            h = head * group + g
            m = _reduce(scores[row, h, c * chunk + t1], t1, Ops.MAX).maximum(EMPTY)
            s = _reduce((scores[row, h, c * chunk + t2] - m).exp(), t2, Ops.ADD)
            n = _reduce((scores[row, h, t] - m).exp() * value, t3, Ops.ADD)
            for buffer, x in ((num, n), (peak, m), (den, s)):
                stores.append(buffer[row, h, c, d].store(x))
        return UOp.sink(
            _end(UOp.group(*stores), row, head, c, d),
            arg=KernelInfo(name=f"attn_chunks_{rows}_{heads}_{positions}", opts_to_apply=()),
        )

    return fxn


def _fused_kernel(rows, heads, kv_heads, dim, value_dim, positions, page_size, chunk, scale, window, softcap, q8):
    """``scores`` and ``chunks`` as one kernel (thread groups only): a thread group a (row, KV head, chunk), a thread
    a value entry d. The group's scores of the chunk's positions go to local memory (each thread makes
    ``passes`` of them: pair p = g * chunk + i, head g of the group at the chunk's position i), then each thread takes
    them through the chunks kernel's three passes for its d. The scores never reach global memory."""
    group, chunks = heads // kv_heads, positions // chunk
    pairs = group * chunk
    passes = -(-pairs // value_dim)
    vector = math.gcd(dim, KEY_VECTOR)

    def fxn(num: UOp, peak: UOp, den: UOp, q: UOp, keys: UOp, values: UOp, table: UOp, at: UOp, *scales: UOp):
        row = _range(rows, 0, AxisType.GLOBAL)
        head = _range(kv_heads, 1, AxisType.GLOBAL)
        c = _range(chunks, 2, AxisType.GLOBAL)
        d = _range(value_dim, 3, AxisType.LOCAL)
        own = at[row]
        shared = UOp.placeholder((passes * value_dim,), dtypes.float32, SCORES_SLOT, AddrSpace.LOCAL)
        writes = []
        for j in range(passes):
            p = d + j * value_dim
            g, t = p // chunk, c * chunk + p % chunk
            inside = p < pairs if (j + 1) * value_dim > pairs else None  # the last pass's threads past the pairs
            seen = _seen(t, own, window) if inside is None else _seen(t, own, window) & inside
            stored = storage_row(table, row, t, keys, page_size)
            e = _range(dim // vector, 4 + j, AxisType.REDUCE)
            entries = [e * vector + k for k in range(vector)]
            key = [_value(keys, scales[0] if q8 else None, stored, head, x, seen) for x in entries]
            terms = [q[row, head * group + g, x] * k for x, k in zip(entries, key)]
            score = _reduce(sum(terms[1:], terms[0]), e, Ops.ADD) * scale
            if softcap is not None:
                score = (score / softcap).tanh() * softcap
            writes.append(shared.index(p).store(seen.where(score, -math.inf)))
        written = UOp.group(*writes).end(d)
        scores = shared.after(written)
        t1, t2, t3 = (_range(chunk, 4 + passes + i, AxisType.REDUCE) for i in range(3))
        t = c * chunk + t3
        seen = _seen(t, own, window)
        value = _value(values, scales[1] if q8 else None, storage_row(table, row, t, values, page_size), head, d, seen)
        stores = []
        for g in range(group):
            m = _reduce(scores.index(g * chunk + t1), t1, Ops.MAX).maximum(EMPTY)
            s = _reduce((scores.index(g * chunk + t2) - m).exp(), t2, Ops.ADD)
            n = _reduce((scores.index(g * chunk + t3) - m).exp() * value, t3, Ops.ADD)
            for buffer, x in ((num, n), (peak, m), (den, s)):
                stores.append(buffer[row, head * group + g, c, d].store(x))
        return UOp.sink(
            _end(UOp.group(*stores), row, head, c, d),
            arg=KernelInfo(name=f"attn_fused_{rows}_{heads}_{positions}", opts_to_apply=()),
        )

    return fxn


def _combine_kernel(rows, heads, value_dim, chunks, local, sinks):
    def fxn(out: UOp, num: UOp, peak: UOp, den: UOp, *sink: UOp) -> UOp:
        row = _range(rows, 0, AxisType.GLOBAL)
        head = _range(heads, 1, AxisType.GLOBAL if local else AxisType.LOOP)
        d = _range(value_dim, 2, AxisType.LOCAL if local else AxisType.LOOP)
        c1, c2 = _range(chunks, 3, AxisType.REDUCE), _range(chunks, 4, AxisType.REDUCE)
        top = _reduce(peak[row, head, c1, 0], c1, Ops.MAX)
        if sinks:
            top = top.maximum(sink[0][head])
        weight = (peak[row, head, c2, 0] - top).exp()
        total = _reduce(weight * den[row, head, c2, 0], c2, Ops.ADD)
        if sinks:
            total = total + (sink[0][head] - top).exp()
        value = _reduce(weight * num[row, head, c2, d], c2, Ops.ADD) / total
        name = f"attn_combine_{rows}_{heads}_{chunks}"
        store = out[row, head * value_dim + d].store(value)  # [rows, heads * value_dim]: the product after reads it
        return UOp.sink(_end(store, row, head, d), arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn


def combine_lanes(chunks: int) -> int | None:
    """Threads that share a (row, head, value entry)'s chunks in the combine (each takes every lanes-th chunk, the
    lanes then add up: ``lanesum.py``), or None where the chunks split too unevenly (the loop kernel then)."""
    n = math.gcd(chunks, COMBINE_LANES)
    if n < 4:  # chunks few or odd (a slot of 9 pages): a power of two of lanes, the last lanes' last chunk none
        n = 1 << (min(chunks, COMBINE_LANES).bit_length() - 1)
    return n if n >= 4 and -(-chunks // n) <= COMBINE_PER else None


def _combine_lanes_kernel(rows, heads, value_dim, chunks, sinks, lanes, lane_sum):
    """``combine`` with a value entry's chunks shared by ``lanes`` threads: each thread loads its few chunks' three
    values at once (no chain of dependent loads over all the chunks), then the lanes take the max and the two sums
    (warp shuffles on CUDA), and the first lane stores."""
    per, inner = -(-chunks // lanes), math.gcd(value_dim, max(COMBINE_THREADS // lanes, 1))

    def fxn(out: UOp, num: UOp, peak: UOp, den: UOp, *sink: UOp) -> UOp:
        row, head = _range(rows, 0, AxisType.GLOBAL), _range(heads, 1, AxisType.GLOBAL)
        tile = _range(value_dim // inner, 2, AxisType.GLOBAL)
        threads = lanesum.Lanes.make((lanes,), 3, lane_sum, True)
        entry = _range(inner, 8, AxisType.LOCAL)  # above the lanes' ids: the lanes are the fastest threads
        threads.outer = [entry] if entry.op is Ops.RANGE else []
        d = tile * inner + entry
        raw = [threads.at(0) + lanes * k for k in range(per)]  # neighbouring lanes, neighbouring chunks
        # past the last chunk (where lanes do not divide the chunks): no load, an empty chunk's max (its weight 0)
        inside = [None if (k + 1) * lanes <= chunks else c < chunks for k, c in enumerate(raw)]
        cs = [c if i is None else c.valid(i) for c, i in zip(raw, inside)]
        peaks = [
            peak[row, head, c, 0] if i is None else i.where(peak[row, head, c, 0], EMPTY) for c, i in zip(cs, inside)
        ]
        top = peaks[0]
        for m in peaks[1:]:
            top = top.maximum(m)
        top = threads.reduce(top, op=Ops.MAX)
        if sinks:
            top = top.maximum(sink[0][head])
        weights = [(m - top).exp() for m in peaks]
        parts = [w * den[row, head, c, 0] for w, c in zip(weights, cs)]
        total = threads.reduce(sum(parts[1:], parts[0]), after=True)
        if sinks:
            total = total + (sink[0][head] - top).exp()
        parts = [w * num[row, head, c, d] for w, c in zip(weights, cs)]
        value = threads.reduce(sum(parts[1:], parts[0]), after=True) / total
        ends = (row, head, tile, *threads.outer, *threads.ends())
        store = out[row, threads.gate(head * value_dim + d)].store(value)
        name = f"attn_combine_{rows}_{heads}_{chunks}_lanes"
        return UOp.sink(_end(store, *ends), arg=KernelInfo(name=name, opts_to_apply=()))

    return fxn


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    table: Tensor,
    at: Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    scales: tuple[Tensor, Tensor] | None = None,
    fused: bool = True,
) -> Tensor:
    """Attention of one query token per row: float32 [rows, heads * value_dim].

    ``q`` [rows, heads, dim] float32; ``keys`` [storage rows, kv_heads, dim] and ``values`` [storage rows, kv_heads,
    value_dim] the layer's paged storage (float32, float16, or int8 with ``scales``, their q8_0 scales [storage rows,
    kv_heads, dim / 32] float16); ``table`` [rows, pages] int32 each row's page table (every entry a valid page),
    ``at`` [rows] int32 each row's position (it sees positions 0 .. at, or its last ``window`` of them); ``sinks``
    [heads] float32 each head's extra logit in its softmax's denominator. ``fused``: the scores and the chunks in one
    kernel, and the combine's lanes, where the device has thread groups (the backend's ``fused_attention``)."""
    rows, heads, dim = q.shape
    kv_heads, value_dim = keys.shape[1], values.shape[2]
    positions = table.shape[1] * page_size
    local = Device[q.device].renderer.has_local
    chunk, fused = math.gcd(positions, CHUNK), fused and local
    while positions // chunk < CHUNKS and chunk > (FUSED_MIN_CHUNK if fused else MIN_CHUNK):
        chunk //= 2
    while positions // chunk < 2 and chunk > 1:  # one chunk: the combine would not read the chunks' max (exp(m - m)
        chunk //= 2  # folds to 1) and tinygrad would leave that buffer out of the kernel's arguments, shifting the rest
    assert positions // chunk >= 2, "decode_attention needs two positions or more"
    extra = list(scales) if scales is not None else []
    q, table, at = (
        q.cast(dtypes.float32).contiguous(),
        table.cast(dtypes.int32).contiguous(),
        at.cast(dtypes.int32).contiguous(),
    )
    parts = [Tensor.empty(rows, heads, positions // chunk, value_dim, dtype=dtypes.float32, device=q.device)]
    parts += [Tensor.empty(*parts[0].shape, dtype=dtypes.float32, device=q.device) for _ in range(2)]
    if fused:
        fxn = _fused_kernel(
            rows, heads, kv_heads, dim, value_dim, positions, page_size, chunk, scale, window, softcap, bool(extra)
        )
        num, peak, den = parts[0].custom_kernel(parts[1], parts[2], q, keys, values, table, at, *extra, fxn=fxn)[:3]
    else:
        score = Tensor.empty(rows, heads, positions, dtype=dtypes.float32, device=q.device)
        fxn = _scores_kernel(
            rows, heads, kv_heads, dim, positions, page_size, scale, window, softcap, local, bool(extra)
        )
        score = score.custom_kernel(q, keys, table, at, *extra[:1], fxn=fxn)[0]
        fxn = _chunks_kernel(rows, heads, kv_heads, value_dim, positions, page_size, chunk, window, local, bool(extra))
        num, peak, den = parts[0].custom_kernel(parts[1], parts[2], score, values, table, at, *extra[1:], fxn=fxn)[:3]
    out = Tensor.empty(rows, heads * value_dim, dtype=dtypes.float32, device=q.device)
    lanes = combine_lanes(positions // chunk) if fused else None
    if lanes is not None:
        fxn = _combine_lanes_kernel(
            rows, heads, value_dim, positions // chunk, sinks is not None, lanes, lanesum.mode(q.device)
        )
    else:
        fxn = _combine_kernel(rows, heads, value_dim, positions // chunk, local, sinks is not None)
    extra = [sinks.cast(dtypes.float32).contiguous()] if sinks is not None else []
    return out.custom_kernel(num, peak, den, *extra, fxn=fxn)[0]


def write_rows(storage: Tensor, values: Tensor, table: Tensor, at: Tensor, page_size: int) -> None:
    """Each row's one new key or value [rows, kv_heads, dim] into float storage [storage rows, kv_heads, dim] at its
    position ``at`` [rows] through its page table ``table`` [rows, pages], as one kernel for all rows (realized; rows
    that share a position write the same values)."""
    rows, kv_heads, dim = values.shape
    local, kind = Device[values.device].renderer.has_local, storage.dtype

    def fxn(out: UOp, x: UOp, table_u: UOp, at_u: UOp) -> UOp:
        row = _range(rows, 0, AxisType.GLOBAL)
        head = _range(kv_heads, 1, AxisType.GLOBAL if local else AxisType.LOOP)
        d = _range(dim, 2, AxisType.LOCAL if local else AxisType.LOOP)
        position = at_u[row]
        stored = table_u[row, position // page_size] * page_size + position % page_size
        store = out[stored, head, d].store(x[row, head * dim + d].cast(kind))
        name = f"kv_write_{rows}_{kv_heads}_{dim}"
        return UOp.sink(_end(store, row, head, d), arg=KernelInfo(name=name, opts_to_apply=()))

    # flat rows [rows, kv_heads * dim]: a product's output as it is (its [rows, kv_heads, dim] view made contiguous
    # would be a copy)
    flat = values.reshape(rows, kv_heads * dim).cast(dtypes.float32).contiguous()
    inputs = (flat, table.cast(dtypes.int32).contiguous(), at.cast(dtypes.int32))
    storage.custom_kernel(*inputs, fxn=fxn)[0].realize()


def rope_write(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    table: Tensor,
    at: Tensor,
    page_size: int,
    rotated: int,
    neox: bool,
) -> Tensor:
    """One decode token a row: q and k rotated (RoPE), k and v written into float storage, in one kernel. Returns q
    rotated, float32 [rows, heads, dim].

    ``q`` [rows, heads, dim], ``k`` and ``v`` [rows, kv_heads, dim] before RoPE (float32; heads a multiple of
    kv_heads); ``cos`` and ``sin`` [rows, rotated / 2] each row's at its position; ``keys`` and ``values`` [storage
    rows, kv_heads, dim] the layer's storage, written at the row of position ``at`` [rows] through the page table
    ``table`` [rows, pages]. The first ``rotated`` entries of a head are rotated in pairs, (i, i + rotated / 2) with
    ``neox`` (GPT-NeoX's halves) or (2i, 2i + 1), as the backend's ``rope`` does (a * cos - b * sin, a * sin + b *
    cos); the other entries are copied. A thread takes one pair of entries of one KV head: its key's and value's,
    and the query heads' of its GQA group."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    group, half, local = heads // kv_heads, rotated // 2, Device[q.device].renderer.has_local
    assert heads % kv_heads == 0 and rotated % 2 == 0 and (dim - rotated) % 2 == 0
    assert v.shape == k.shape and k.shape[2] == dim
    kind = keys.dtype

    def fxn(q_out: UOp, keys_u: UOp, values_u: UOp, *inputs: UOp) -> UOp:
        q_in, k_in, v_in, cos_u, sin_u, table_u, at_u = inputs
        row = _range(rows, 0, AxisType.GLOBAL)
        kv_head = _range(kv_heads, 1, AxisType.GLOBAL if local else AxisType.LOOP)
        pair = _range(dim // 2, 2, AxisType.LOCAL if local else AxisType.LOOP)
        if half * 2 == dim:  # every entry rotated (no pair past them)
            first = pair if neox else pair * 2
            second = pair + half if neox else first + 1
            c, s = cos_u[row, pair], sin_u[row, pair]
        else:
            turned = pair < half
            if neox:
                first = turned.where(pair, pair * 2)  # past the rotated: entries rotated + 2 (pair - half) and + 1
                second = turned.where(pair + half, pair * 2 + 1)
            else:
                first, second = pair * 2, pair * 2 + 1
            inside = turned.where(pair, 0)
            c, s = turned.where(cos_u[row, inside], 1.0), turned.where(sin_u[row, inside], 0.0)  # past: a copy
        position = at_u[row]
        stored = table_u[row, position // page_size] * page_size + position % page_size
        stores = []
        for g in range(group):
            h = kv_head * group + g
            a, b = (
                row_entry(q_in, row, h * dim + first, heads * dim),
                row_entry(q_in, row, h * dim + second, heads * dim),
            )
            stores += [q_out[row, h, first].store(a * c - b * s), q_out[row, h, second].store(a * s + b * c)]
        a, b = (row_entry(k_in, row, kv_head * dim + d, kv_heads * dim) for d in (first, second))
        stores += [keys_u[stored, kv_head, first].store((a * c - b * s).cast(kind))]
        stores += [keys_u[stored, kv_head, second].store((a * s + b * c).cast(kind))]
        for d in (first, second):
            value = row_entry(v_in, row, kv_head * dim + d, kv_heads * dim)
            stores.append(values_u[stored, kv_head, d].store(value.cast(kind)))
        name = f"rope_kv_write_{rows}_{heads}_{kv_heads}_{dim}"
        return UOp.sink(_end(UOp.group(*stores), row, kv_head, pair), arg=KernelInfo(name=name, opts_to_apply=()))

    flat = [plain_rows(t) for t in (q, k, v)]
    inputs = [*flat, cos.reshape(rows, half).contiguous(), sin.reshape(rows, half).contiguous()]
    inputs += [table.cast(dtypes.int32).contiguous(), at.cast(dtypes.int32).contiguous()]
    q_out = Tensor.empty(rows, heads, dim, dtype=dtypes.float32, device=q.device)
    q_rot, written_k, written_v = q_out.custom_kernel(keys, values, *inputs, fxn=fxn)[:3]
    Tensor.realize(q_rot, written_k, written_v)
    return q_rot
