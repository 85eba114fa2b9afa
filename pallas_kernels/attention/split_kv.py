"""Split-KV bookkeeping for the flash-decoding kernel (:mod:`pallas_kernels.attention.flash_decoding`): how a
batch's visible KV blocks are shared out over split programs, and how their partial softmax
results are merged.

A split program writes, per output row, an unnormalised ``o [head_dim]``, its running max ``m``
(log2 units) and denominator ``l``, all fp32. The merge is a log-sum-exp over the sequence's
slots in slot order, so its result never depends on which program finished first. It runs
either at the end of the main kernel, in the last of a sequence's programs to arrive, or in
:func:`combine_partials`, a second small kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl

# Finite so that a fully masked row never produces inf - inf = NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _block_range(length, pos_min, pos_max, *, block_k, num_q, window, has_tail):
    """KV blocks ``[lo, hi)`` that queries at positions ``pos_min..pos_max`` can see (elementwise)."""
    if has_tail:
        hi = jnp.where(pos_max >= 0, length, 0)
    else:
        hi = jnp.minimum(length, pos_max + 1)
    lo = jnp.zeros_like(length)
    if window is not None:
        lo = jnp.maximum(pos_min - window + 1, 0)
        if has_tail:
            lo = jnp.minimum(lo, jnp.maximum(length - num_q, 0))
    return lo // block_k, (hi + block_k - 1) // block_k


def _pick(values, index_vec, index):
    """values[index] for a traced scalar index (a masked sum: Triton has no vector subscript)."""
    return jnp.sum(jnp.where(index_vec == index, values, 0))


def _work_split(len_ref, pos_ref, *, batch, num_q, max_len, block_k, window, has_tail, num_programs):
    """Share the visible KV blocks of the whole batch out evenly over ``num_programs`` split programs.

    The sequences' visible blocks (``[lo, hi)`` each) are laid end to end, sequence 0 first, and
    program ``p`` reads blocks ``[p * chunk, (p + 1) * chunk)`` of that line, ``chunk =
    ceil(total / num_programs)``: every program reads the same number of blocks whatever the
    lengths, finishing one sequence and starting the next where its chunk crosses a boundary
    (stream-K). A uniform batch whose sequences hold a whole number of chunks gets ``num_programs /
    batch`` splits each, as a static split would. Sequence ``b`` is read by programs ``first[b] ..
    last[b]`` (one program for a sequence that sees nothing: it writes the zero output). The pair
    (program ``p``, sequence ``b``) stores its partials in slot ``p + b``: a sequence's slots are
    contiguous, ``first[b] + b ..``, and no two pairs share one (``num_programs + batch - 1``
    slots). Computed alike by every program from the lengths and positions alone (no XLA
    preparation op). Returns vectors ``[b_pad]``: sequence index, length, first visible block,
    visible blocks, start on the line, first and last program; and the scalar chunk.
    """
    b_pad = max(16, _next_pow2(batch))
    bvec = jnp.arange(b_pad, dtype=jnp.int32)
    b_ok = bvec < batch
    b_idx = jnp.minimum(bvec, batch - 1)
    lengths = jnp.clip(plgpu.load(len_ref.at[b_idx], mask=b_ok, other=0), 0, max_len)
    qvec = jnp.arange(max(16, _next_pow2(num_q)), dtype=jnp.int32)
    ok = b_ok[:, None] & (qvec < num_q)[None, :]
    pos = plgpu.load(pos_ref.at[b_idx[:, None] * num_q + jnp.minimum(qvec, num_q - 1)[None, :]], mask=ok, other=-1)
    pos_max = jnp.max(pos, axis=1)
    pos_min = jnp.min(jnp.where(ok, pos, jnp.iinfo(jnp.int32).max), axis=1)
    blk_lo, blk_hi = _block_range(lengths, pos_min, pos_max, block_k=block_k, num_q=num_q, window=window,
                                  has_tail=has_tail)
    blocks = jnp.where(b_ok, jnp.maximum(blk_hi - blk_lo, 0), 0)
    start = jnp.sum(jnp.where(bvec[None, :] < bvec[:, None], blocks[None, :], 0), axis=1)  # exclusive cumsum
    chunk = jnp.maximum((jnp.sum(blocks) + num_programs - 1) // num_programs, 1)
    # Trailing sequences that see nothing start at the end of the line: the last program takes them.
    first = jnp.minimum(start // chunk, num_programs - 1)
    last = jnp.where(blocks > 0, (start + blocks - 1) // chunk, first)
    return bvec, lengths, blk_lo, blocks, start, first, last, chunk


def _store_rows(out_ref, o, l, out_row, row_ok):
    """Normalise ``o [n, head_dim]`` by ``l [n]`` (a row that saw nothing gets 0) and store it at
    ``out_row [n]`` of the flat output."""
    head_dim = o.shape[1]
    o = o / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(out_ref.at[out_row[:, None] * head_dim + jnp.arange(head_dim, dtype=jnp.int32)[None, :]],
                o.astype(out_ref.dtype), mask=jnp.broadcast_to(row_ok[:, None], o.shape))


def _max_slots(num_programs, max_len, block_k):
    """A bound on the slots of one sequence: its blocks meet at most one program per chunk, plus one."""
    return _next_pow2(min(num_programs, -(-max_len // block_k) + 1))


def _merge_partials(o_part, m_part, l_part, first_slot, owned, row_ok, head_row, *, rows, max_slots, volatile):
    """Log-sum-exp merge of one group's partials, slots ``[first_slot, first_slot + owned)``, in
    slot order (the same sum whichever program arrives last). Returns ``o [n, head_dim]`` and
    ``l [n]`` for the ``n`` rows given. Slots that saw nothing (m = _MASK_VALUE, l = 0) weigh nothing.
    Loads are volatile (not served from L1): the partials were written by other SMs."""
    head_dim = o_part.shape[0] // m_part.shape[0]
    n = head_row.shape[0]
    d = jnp.arange(head_dim, dtype=jnp.int32)
    # Chunks of g slots, a [g, n, head_dim] fp32 tile = ~64 registers per thread; m, l and o of a
    # chunk are loaded together (one round trip to L2), so a merge of <= g slots waits once.
    g = max(1, min(max_slots, 8192 // (n * head_dim)))

    def add_chunk(c, carry):
        acc, m_run, l_run = carry
        s = c * g + jnp.arange(g, dtype=jnp.int32)
        ok = (s < owned)[:, None] & row_ok[None, :]  # [g, n]
        part = (first_slot + jnp.minimum(s, owned - 1))[:, None] * rows + head_row[None, :]
        m = plgpu.load(m_part.at[part], mask=ok, other=_MASK_VALUE, volatile=volatile)
        l = plgpu.load(l_part.at[part], mask=ok, other=0.0, volatile=volatile)
        o = plgpu.load(o_part.at[part[:, :, None] * head_dim + d[None, None, :]],
                       mask=jnp.broadcast_to(ok[:, :, None], (g, n, head_dim)), other=0.0, volatile=volatile)
        m_new = jnp.maximum(m_run, jnp.max(m, axis=0))
        corr = jnp.exp2(m_run - m_new)
        w = jnp.exp2(m - m_new[None, :])
        return (acc * corr[:, None] + jnp.sum(o * w[:, :, None], axis=0), m_new,
                l_run * corr + jnp.sum(l * w, axis=0))

    carry = (jnp.zeros((n, head_dim), jnp.float32), jnp.full((n,), _MASK_VALUE, jnp.float32),
             jnp.zeros((n,), jnp.float32))
    if max_slots <= g:  # one chunk holds every slot: no loop
        acc, _, total = add_chunk(0, carry)
    else:
        acc, _, total = lax.fori_loop(0, (owned + g - 1) // g, add_chunk, carry)
    return acc, total


def _combine_kernel(len_ref, pos_ref, o_ref, m_ref, l_ref, _, out_ref, *, batch, num_q, rows, rows_per_program,
                    max_len, block_k, window, has_tail, num_programs):
    # Program (b, i) merges rows [i * rows_per_program, ...) of sequence b from its slots in the
    # work split; a sequence read by one program had its output written by the main kernel (the
    # output comes in aliased, as the unnamed input).
    b, row_block = pl.program_id(0), pl.program_id(1)
    bvec, _, _, _, _, first, last, _ = _work_split(
        len_ref, pos_ref, batch=batch, num_q=num_q, max_len=max_len, block_k=block_k, window=window,
        has_tail=has_tail, num_programs=num_programs,
    )
    first, owned = _pick(first, bvec, b), _pick(last - first + 1, bvec, b)
    head_row = row_block * rows_per_program + jnp.arange(rows_per_program, dtype=jnp.int32)
    row_ok = head_row < rows

    @pl.when(owned > 1)
    def _():
        o, l = _merge_partials(o_ref, m_ref, l_ref, first + b, owned, row_ok, head_row, rows=rows,
                               max_slots=_max_slots(num_programs, max_len, block_k), volatile=False)
        _store_rows(out_ref, o, l, b * rows + head_row, row_ok)


def combine_partials(out, o_part, m_part, l_part, kv_lengths, q_positions, *, batch, num_q, rows, max_len, block_k,
                     window, has_tail, num_programs, k_splits, interpret):
    """The combine kernel: merges the partials of every sequence that owns several slots into
    ``out`` (flat ``[batch * rows * d_pad]``, aliased: the rows of one-slot sequences stay as the
    main kernel wrote them). Each program takes ``rows_per_program`` rows of one sequence, as many
    as make a ``[k_splits, rows, d_pad]`` fp32 tile of ~8k elements."""
    d_pad = o_part.shape[0] // m_part.shape[0]
    rows_per_program = max(1, min(_next_pow2(rows), 1 << (max(1, 8192 // (k_splits * d_pad)).bit_length() - 1)))
    kernel = functools.partial(
        _combine_kernel, batch=batch, num_q=num_q, rows=rows, rows_per_program=rows_per_program, max_len=max_len,
        block_k=block_k, window=None if window is None else int(window), has_tail=has_tail, num_programs=num_programs,
    )
    return pdl.pallas_call(
        kernel,
        grid=(batch, -(-rows // rows_per_program)),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={5: 0},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jspec_decode_attention_combine",
    )(kv_lengths, q_positions, o_part, m_part, l_part, out)
