"""The flash-decoding Pallas kernel (Triton backend) behind :func:`pallas_kernels.attention.decode_attention`.

Shapes, the visibility rule and the ``impl`` dispatch: ``pallas_kernels/attention/decode_attention.py``.

Grid ``(m_blocks, num_kv_heads, programs)``; the query heads of one KV head times the query rows
are folded into the M dimension (row ``r`` = query ``r // group``, head ``r % group``), padded to
``block_m >= 16``; each program runs an online softmax over its share of the KV blocks. The shares
come from a work split over the whole batch (:func:`_work_split`, computed in every program from the
lengths and positions): the blocks each sequence can see (``[lo, hi)`` from ``kv_lengths``,
positions and window; blocks past the length are never read) are laid end to end and cut into
``batch * k_splits`` equal chunks, one per program, so a ragged batch spends its programs on its
long sequences and no program idles (a static split per sequence, or one that rounds each
sequence up to whole chunks, is slower: ``benchmarks/README.md``, decode attention). A program
whose chunk crosses into the next sequence goes on with it. A sequence read by one program has its
output written by that program; otherwise its programs store fp32 partials, merged
(:mod:`pallas_kernels.attention.split_kv`) in one of two ways, chosen by ``k_splits``: with <= 2 splits per
sequence on average, by the last of the sequence's programs to arrive, found with an atomic count
(one launch); with more (small batches), by a second small kernel, in parallel over the rows.
The kernel reads q, the lengths and the positions as they are (no XLA preparation ops). Masks are
explicit (rows past the length may hold anything, NaN included); K and V are passed as they are
(never copied) when ``max_len`` is a multiple of ``block_k`` and ``head_dim`` a power of two >=
16, and padded to whole blocks otherwise. The tree mask travels as per-row bit words (32 tail
columns per int32).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.dispatch import interpret_mode
from pallas_kernels.attention.decode_tiling import tiling
from pallas_kernels.attention.split_kv import (
    _MASK_VALUE,
    _block_range,
    _max_slots,
    _merge_partials,
    _next_pow2,
    _pick,
    _store_rows,
    _work_split,
    combine_partials,
)

_LOG2E = math.log2(math.e)


def _effective_tail_mask(tail_mask, q_positions, window):
    """tail_mask[b, i, c] & window rule measured between query positions p_i and p_c."""
    tail = tail_mask.astype(bool)
    if window is not None:
        pos = q_positions.astype(jnp.int32)
        tail &= (pos[:, :, None] - pos[:, None, :]) < window
    return tail


def _decode_kernel(
    len_ref,  # [batch] int32 kv lengths
    pos_ref,  # [batch * num_q] int32 query positions
    tail_ref,  # [batch * n_words * num_q] int32 tail-mask bit words, or None
    q_ref,  # [batch * num_q * num_q_heads * head_dim] flat q
    k_ref,  # [batch * num_kv_heads, max_len, head_dim] the whole cache
    v_ref,  # [batch * num_kv_heads, max_len, head_dim]
    out_ref,  # [batch * num_q * num_q_heads * head_dim] the output (q's dtype)
    split_refs,  # None (one program per sequence), else the refs through which split programs meet:
    #   o [(num_programs + batch) * num_q * num_q_heads * head_dim] fp32 unnormalised partials,
    #   m, l [(num_programs + batch) * num_q * num_q_heads] fp32 running max (log2 units), denominator,
    #   arrived [batch * num_kv_heads * m_blocks] int32, zero on entry: partials stored per group
    *,
    batch: int,
    block_m: int,
    m_blocks: int,
    block_k: int,
    num_programs: int,
    num_q: int,
    group: int,
    num_kv_heads: int,
    max_len: int,
    qk_scale: float,
    window: int | None,
    n_words: int,
    interpret: bool,
):
    head_dim = k_ref.shape[-1]
    num_q_heads = group * num_kv_heads
    rows = num_q * num_q_heads  # output rows (query, head) per sequence
    # Program ids are read here, outside pl.when: the interpreter substitutes them at the top level only.
    m_block, kv_head, program = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d = jnp.arange(head_dim, dtype=jnp.int32)

    def m_rows(n):
        # The first n M rows of this program: row r = query r // group, query head kv_head * group +
        # r % group. Returns r, whether r is a real row, the query index, the index into (num_q, heads).
        r = m_block * block_m + jnp.arange(n, dtype=jnp.int32)
        qi = jnp.minimum(r // group, num_q - 1)
        return r, r < num_q * group, qi, qi * num_q_heads + kv_head * group + r % group

    def place(row_ok, r, row, buffer_rows):
        # Padding rows point past the end of the buffer, each to its own place: their stores are
        # masked on the GPU, and the interpreter (a scatter) drops them instead of racing real rows.
        return jnp.where(row_ok, row, buffer_rows + r)

    def dot(a, b, contract_b):  # [m, k] x b -> [m, n] with fp32 accumulation
        if interpret:  # the CPU interpreter has no bf16 x bf16 -> f32 dot; products are exact in f32
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        # fp32 operands: HIGHEST = IEEE fp32 in Triton (DEFAULT would be TF32).
        precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return lax.dot_general(
            a, b, (((1,), (contract_b,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    r, row_ok, qi, head_row = m_rows(block_m)
    qo_mask = jnp.broadcast_to(row_ok[:, None], (block_m, head_dim))
    iota_k = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

    def attend(b, length, first, last):
        """Online softmax of this M block of sequence ``b`` over KV blocks ``[first, last)`` (cut to
        what its rows can see) -> unnormalised o [block_m, head_dim], m and l [block_m]."""
        q_offsets = (b * rows + head_row)[:, None] * head_dim + d[None, :]  # [block_m, head_dim]
        pos = plgpu.load(pos_ref.at[b * num_q + qi], mask=row_ok, other=-1)  # padding rows: -1, they see nothing
        words = [plgpu.load(tail_ref.at[(b * n_words + w) * num_q + qi], mask=row_ok, other=0)[:, None]
                 for w in range(n_words)]
        tail_start = length - num_q
        pmin = jnp.min(jnp.where(row_ok, pos, jnp.iinfo(jnp.int32).max))
        blk_lo, blk_hi = _block_range(length, pmin, jnp.max(pos), block_k=block_k, num_q=num_q, window=window,
                                      has_tail=bool(n_words))
        first = jnp.maximum(first, blk_lo)
        trips = jnp.maximum(jnp.minimum(last, blk_hi) - first, 0)
        q = plgpu.load(q_ref.at[q_offsets], mask=qo_mask, other=0)
        qpos = pos[:, None]  # [block_m, 1]
        cache = b * num_kv_heads + kv_head

        def visible(j):  # j: [1, block_k] absolute row indices -> bool [block_m, block_k]
            vis = (j < length) & (j <= qpos)
            if window is not None:
                vis &= (qpos - j) < window
            if n_words:
                col = j - tail_start
                bit = jnp.zeros((block_m, block_k), jnp.int32)
                for w, word in enumerate(words):
                    shift = jnp.broadcast_to(jnp.clip(col - 32 * w, 0, 31), (block_m, block_k))
                    in_word = (col >= 32 * w) & (col < 32 * w + 32)
                    word_bits = lax.shift_right_logical(jnp.broadcast_to(word, (block_m, block_k)), shift) & 1
                    bit |= jnp.where(in_word, word_bits, 0)
                in_tail = (col >= 0) & (j < length)
                vis = jnp.where(in_tail, bit != 0, vis)
            return vis

        def body(t, carry):
            o, m, l = carry
            start = pl.multiple_of((first + t) * block_k, block_k)
            j = start + iota_k
            k = k_ref[cache, pl.ds(start, block_k), :]
            vis = visible(j)
            s = jnp.where(vis, dot(q, k, 1) * qk_scale, _MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            corr = jnp.exp2(m - m_new)
            p = jnp.where(vis, jnp.exp2(s - m_new[:, None]), 0.0)
            l = l * corr + jnp.sum(p, axis=1)
            # Rows past the length may be NaN: load them as zeros (0 * NaN would poison o).
            v_ok = jnp.broadcast_to((j < length).reshape(block_k, 1), (block_k, head_dim))
            v = plgpu.load(v_ref.at[cache, pl.ds(start, block_k), :], mask=v_ok, other=0)
            return o * corr[:, None] + dot(p.astype(v.dtype), v, 0), m_new, l

        carry = (jnp.zeros((block_m, head_dim), jnp.float32), jnp.full((block_m,), _MASK_VALUE, jnp.float32),
                 jnp.zeros((block_m,), jnp.float32))
        return lax.fori_loop(0, trips, body, carry)

    def write_output(b, o, l, row_ok, r, head_row):
        _store_rows(out_ref, o, l, place(row_ok, r, b * rows + head_row, batch * rows), row_ok)

    if split_refs is None:  # one program per sequence and KV head reads it all
        b = program
        o, _, l = attend(b, jnp.clip(len_ref[b], 0, max_len), jnp.int32(0), jnp.int32(jnp.iinfo(jnp.int32).max))
        write_output(b, o, l, row_ok, r, head_row)
        return

    o_part, m_part, l_part, *arrived = split_refs
    bvec, lengths, seq_lo, seq_blocks, seq_start, seq_first, seq_last, chunk = _work_split(
        len_ref, pos_ref, batch=batch, num_q=num_q, max_len=max_len, block_k=block_k, window=window,
        has_tail=bool(n_words), num_programs=num_programs,
    )
    real = bvec < batch
    # The sequences this program reads a piece of (usually one or two), in order.
    b_begin = jnp.sum(jnp.where(real & (seq_last < program), 1, 0))
    b_end = jnp.sum(jnp.where(real & (seq_first <= program), 1, 0))

    def piece(b, carry):
        line_start = _pick(seq_start, bvec, b)
        lo = _pick(seq_lo, bvec, b)
        first = lo + jnp.maximum(program * chunk - line_start, 0)
        last = lo + jnp.minimum((program + 1) * chunk - line_start, _pick(seq_blocks, bvec, b))
        o, m, l = attend(b, _pick(lengths, bvec, b), first, last)
        first_program = _pick(seq_first, bvec, b)
        owned = _pick(seq_last, bvec, b) - first_program + 1

        @pl.when(owned == 1)
        def _():  # the sequence's only program: nothing to merge
            write_output(b, o, l, row_ok, r, head_row)

        @pl.when(owned > 1)
        def _():
            part_row = place(row_ok, r, (program + b) * rows + head_row, m_part.shape[0])
            plgpu.store(o_part.at[part_row[:, None] * head_dim + d[None, :]], o, mask=qo_mask)
            plgpu.store(m_part.at[part_row], m, mask=row_ok)
            plgpu.store(l_part.at[part_row], l, mask=row_ok)
            if not arrived:  # a combine kernel merges
                return
            if not interpret:  # the interpreter runs programs one by one (and has no barrier)
                plgpu.debug_barrier()  # every thread's partials are stored before the count goes up
            # The last of the sequence's programs to arrive (per KV head and M block) merges them all.
            counter = (b * num_kv_heads + kv_head) * m_blocks + m_block
            before = plgpu.atomic_add(arrived[0], counter, jnp.int32(1))  # acquire-release, GPU scope

            @pl.when(before == owned - 1)
            def _():
                merge_rows = min(block_m, _next_pow2(num_q * group))  # the M rows that can be real
                mr, mr_ok, _, mr_head = m_rows(merge_rows)
                o, l = _merge_partials(o_part, m_part, l_part, first_program + b, owned, mr_ok, mr_head, rows=rows,
                                       max_slots=_max_slots(num_programs, max_len, block_k), volatile=True)
                write_output(b, o, l, mr_ok, mr, mr_head)

        return carry  # nothing to carry; a constant here fails to lower on jax 0.11

    lax.fori_loop(b_begin, b_end, piece, jnp.int32(0))


def _decode_call(
    q, k, v, kv_lengths, q_positions, tail_mask, window, scale, *, block_m, block_k, k_splits, merge_in_kernel,
    num_warps, num_stages, interpret,
):
    """Run the kernel -> the output [B, Q * Hq, Dp].

    Every operand is passed whole (the kernel finds its sequence from the work split) and flat
    where the kernel gathers rows from it. With k_splits > 1 the kernel also gets scratch outputs
    for the split programs' partials and a zeroed arrival counter per (sequence, KV head, M block).
    """
    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    m_blocks = -(-(num_q * group) // block_m)
    d_pad = max(16, _next_pow2(head_dim))
    s_pad = -(-max_len // block_k) * block_k
    bh = batch * num_kv_heads
    rows = num_q * num_q_heads

    qf = q.astype(k.dtype)
    kk = k.reshape(bh, max_len, head_dim)
    vv = v.reshape(bh, max_len, head_dim)
    if d_pad != head_dim:  # a copy: only for odd head dims
        qf = jnp.pad(qf, ((0, 0), (0, 0), (0, 0), (0, d_pad - head_dim)))
    if s_pad != max_len or d_pad != head_dim:  # a copy: only for odd cache shapes
        kk = jnp.pad(kk, ((0, 0), (0, s_pad - max_len), (0, d_pad - head_dim)))
        vv = jnp.pad(vv, ((0, 0), (0, s_pad - max_len), (0, d_pad - head_dim)))

    n_words = 0
    args = [kv_lengths.astype(jnp.int32), q_positions.astype(jnp.int32).reshape(batch * num_q)]
    if tail_mask is not None:  # bit c % 32 of word c // 32 of query i = tail_mask[b, i, c] (+ window)
        tail = _effective_tail_mask(tail_mask, q_positions, window)  # [B, Q, Q]
        n_words = -(-num_q // 32)
        tail = jnp.pad(tail, ((0, 0), (0, 0), (0, 32 * n_words - num_q)))
        tail = tail.reshape(batch, num_q, n_words, 32).astype(jnp.uint32)
        bits = jnp.sum(tail << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
        bits = lax.bitcast_convert_type(bits, jnp.int32).transpose(0, 2, 1)  # [B, W, Q]
        args.append(bits.reshape(batch * n_words * num_q))
    args += [qf.reshape(batch * rows * d_pad), kk, vv]
    out_shape = [jax.ShapeDtypeStruct((batch * rows * d_pad,), q.dtype)]
    aliases = {}
    num_programs = batch * k_splits  # per KV head and M block
    split = num_programs > 1  # else one program per KV head does it all
    merge_in_kernel = split and merge_in_kernel
    if split:
        slots = num_programs + batch  # one per (program, sequence) pair, see _work_split
        out_shape += [
            jax.ShapeDtypeStruct((slots * rows * d_pad,), jnp.float32),
            jax.ShapeDtypeStruct((slots * rows,), jnp.float32),
            jax.ShapeDtypeStruct((slots * rows,), jnp.float32),
        ]
        if merge_in_kernel:
            out_shape.append(jax.ShapeDtypeStruct((bh * m_blocks,), jnp.int32))
            aliases = {len(args): len(out_shape) - 1}  # the counters start at zero
            args.append(jnp.zeros((bh * m_blocks,), jnp.int32))

    def kernel(*refs):
        len_ref, pos_ref, *refs = refs
        tail_ref = refs.pop(0) if n_words else None
        q_ref, k_ref, v_ref, *refs = refs
        if aliases:
            del refs[0]  # the counters' input, aliased to the last output
        out_ref, *split_refs = refs
        _decode_kernel(
            len_ref, pos_ref, tail_ref, q_ref, k_ref, v_ref, out_ref, split_refs or None,
            batch=batch, block_m=block_m, m_blocks=m_blocks, block_k=block_k, num_programs=num_programs, num_q=num_q,
            group=group, num_kv_heads=num_kv_heads, max_len=max_len, qk_scale=float(scale) * _LOG2E,
            window=None if window is None else int(window), n_words=n_words, interpret=bool(interpret),
        )

    outs = pdl.pallas_call(
        kernel,
        # The M blocks of one KV head come next to each other in launch order: they read the same
        # K/V blocks at about the same time, so all but the first find them in L2.
        grid=(m_blocks, num_kv_heads, num_programs),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jspec_decode_attention",
    )(*args)
    if split and not merge_in_kernel:
        outs = [combine_partials(
            outs[0], *outs[1:4], args[0], args[1], batch=batch, num_q=num_q, rows=rows, max_len=max_len,
            block_k=block_k, window=window, has_tail=bool(n_words), num_programs=num_programs, k_splits=k_splits,
            interpret=interpret,
        )]
    return outs[0].reshape(batch, rows, d_pad)


def decode_attention_pallas(
    q, k, v, kv_lengths, *, q_positions, tail_mask=None, window=None, scale=None,
    block_m=None, block_k=None, k_splits=None, merge_in_kernel=None, num_warps=None, num_stages=None, interpret=None,
):
    """The Pallas kernel (one launch); knobs default from the shapes (:func:`pallas_kernels.attention.decode_tiling.tiling`).

    ``k_splits``: split programs per sequence on average (the batch's KV blocks are shared out
    evenly over ``batch * k_splits`` of them, see :func:`_work_split`; the last of a sequence's
    programs to finish merges their partials); 1 with batch 1 = one program per KV head.
    ``merge_in_kernel``: whether split partials are merged by the last of a sequence's programs to
    arrive (one launch) or by a second kernel, in parallel over the rows.
    """
    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    given = dict(block_m=block_m, block_k=block_k, k_splits=k_splits, merge_in_kernel=merge_in_kernel,
                 num_warps=num_warps, num_stages=num_stages)
    cfg = tiling(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, window=window,
                 **{name: val for name, val in given.items() if val is not None})
    for name in ("block_k", "block_m"):
        if cfg[name] < 16 or cfg[name] & (cfg[name] - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {cfg[name]}")
    if cfg["k_splits"] < 1:
        raise ValueError(f"k_splits must be >= 1, got {cfg['k_splits']}")
    interpret = interpret_mode() if interpret is None else interpret
    scale = head_dim**-0.5 if scale is None else scale
    out = _decode_call(q, k, v, kv_lengths, q_positions, tail_mask, window, scale, interpret=interpret, **cfg)
    d_pad = max(16, _next_pow2(head_dim))
    return out.reshape(batch, num_q, num_q_heads, d_pad)[..., :head_dim]
