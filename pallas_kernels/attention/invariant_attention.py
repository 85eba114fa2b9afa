"""Row-invariant few-query attention (Triton backend): each query row's output is bitwise the same
whatever else is computed with it: other query rows (decode vs verify vs prefill), other sequences
of the batch, the cache's capacity.

Same shapes and visibility rule as :mod:`pallas_kernels.attention.decode_attention`, tree attention
(``tail_mask``) included. The reduction structure is pinned, never chosen from the shapes:

* query rows x GQA group are cut into M tiles of :data:`BLOCK_M` rows, so every dot has the same
  shape whatever the number of rows (row ``r`` = query ``r // group``, head ``r % group``);
* the cache is read in blocks of ``block_k`` rows at fixed positions, in order, with an online
  softmax; a block a row cannot see leaves its running max, sum and accumulator exactly as they
  were (its probabilities are zeroed, not just small), so the blocks a tile's other rows make it
  visit change nothing;
* the KV axis is split at fixed positions (every ``split_rows`` cache rows), one program per split,
  and the splits' partials are merged one after another in split order by a second kernel; a
  split a row sees nothing of (e.g. past the length, however large the cache) is an exact no-op
  in that merge;
* a tree (``tail_mask``) is read as the chain each of its rows is on: a node at depth ``d`` sees
  the prefix and then its ancestors and itself, which the kernel reads at the positions a chain
  would have written them to (the prefix's end + 0..d), gathered from their tree slots. Blocks,
  splits and dots then hold the same values in the same places as in the chain's verify pass and
  in plain decoding, so a tree verifies bitwise as they decode. (Reading the ancestors where the
  tree put them, with the others masked, adds the same products in another grouping inside the
  tensor-core dot, so a self-drafted tree could diverge from plain greedy decoding.)

The price against :mod:`pallas_kernels.attention.flash_decoding` (which balances a ragged batch's blocks over
its programs and merges in chunks): no stream-K, and more programs per short sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.dispatch import interpret_mode
from pallas_kernels.attention.split_kv import _MASK_VALUE, _next_pow2

BLOCK_M = 16  # rows of every M tile: the smallest 16-bit tensor-core dot
# Blocks of 64 rows, splits of 256 (not 32 / 512): more programs with fewer sequential blocks
# each, which makes the decode step faster (figures: ``benchmarks/README.md``, invariant mode).
BLOCK_K = 64  # cache rows per block
SPLIT_ROWS = 256  # cache rows per split: split boundaries at multiples of this


def _dot(a, b, dtype):
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
    return jnp.dot(a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


def _split_kernel(q_ref, k_ref, v_ref, lo_ref, hi_ref, len_ref, *refs, block_k, split_rows, scale, compute_dtype,
                  num_tail, group):
    # q_ref [BLOCK_M, d] (this program's tile), k_ref / v_ref [max_len, d] (this sequence and head),
    # lo_ref / hi_ref [BLOCK_M] (each row sees cache rows [lo, hi)), len_ref [] (the sequence's valid rows),
    # with num_tail > 0 (a tree): k_path_ref / v_path_ref [num_tail, path_width, d], query i's chain from
    # the block holding the tail's start (see the wrapper), o_ref [BLOCK_M, d], m_ref / l_ref [BLOCK_M].
    (k_path_ref, v_path_ref), (o_ref, m_ref, l_ref) = (refs[:2], refs[2:]) if num_tail else ((None, None), refs)
    tile, split = pl.program_id(2), pl.program_id(3)
    q = plgpu.load(q_ref)
    lo, hi = plgpu.load(lo_ref), plgpu.load(hi_ref)
    length = len_ref[...]
    sees = hi > lo
    tile_lo = jnp.min(jnp.where(sees, lo, jnp.iinfo(jnp.int32).max))
    tile_hi = jnp.max(jnp.where(sees, hi, 0))
    start = split * split_rows
    first = jnp.maximum(start, tile_lo) // block_k
    last = jnp.maximum(first, (jnp.minimum(start + split_rows, tile_hi) + block_k - 1) // block_k)
    first_path_block = (length - num_tail) // block_k
    one_step = jnp.minimum(length, 1)  # a trip count the compiler cannot see (every visited block has length >= 1)

    def block(index, carry, *, tail):
        m, l, acc = carry
        rows = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        cols = index * block_k + jnp.arange(block_k, dtype=jnp.int32)
        visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        if tail:  # each query's own chain: one dot per query of the tile, each row keeping its query's
            path_rows = pl.ds(pl.multiple_of((index - first_path_block) * block_k, block_k), block_k)
            row_query = (tile * BLOCK_M + jnp.arange(BLOCK_M)) // group
            queries = (tile * BLOCK_M // group, jnp.minimum((tile * BLOCK_M + BLOCK_M - 1) // group, num_tail - 1) + 1)

            def scores(i, s):
                return jnp.where((row_query == i)[:, None], _dot(q, plgpu.load(k_path_ref.at[i, path_rows, :]).T,
                                                                 compute_dtype), s)

            s = lax.fori_loop(*queries, scores, jnp.zeros((BLOCK_M, block_k), jnp.float32))
        else:
            s = _dot(q, plgpu.load(k_ref.at[rows, :]).T, compute_dtype)
        s = jnp.where(visible, s * scale, _MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        # Both branches add their dots to the scaled accumulator as a loop carry (the chain's loop has
        # one step): a compiler then fuses that add into the dot, or the scaling into the add, alike
        # in both, so a tree row and a chain row get the same bits.
        if tail:  # each row gets its own query's products; the other queries' dots add exact zeros
            def values(i, acc):
                v = plgpu.load(v_path_ref.at[i, path_rows, :])
                return acc + _dot(jnp.where((row_query == i)[:, None], p, 0.0).astype(v.dtype), v, compute_dtype)
        else:
            def values(_, acc):
                v = jnp.where((cols < length)[:, None], plgpu.load(v_ref.at[rows, :]), 0)  # NaN past the length
                return acc + _dot(p.astype(v.dtype), v, compute_dtype)
        acc = lax.fori_loop(*(queries if tail else (0, one_step)), values, acc * alpha[:, None])
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((BLOCK_M,), _MASK_VALUE, jnp.float32), jnp.zeros((BLOCK_M,), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    if num_tail:  # the same blocks in the same order; from the tail's first block on, each query's chain
        first_tail = jnp.clip(first_path_block, first, last)
        carry = lax.fori_loop(first, first_tail, functools.partial(block, tail=False), init)
        m, l, acc = lax.fori_loop(first_tail, last, functools.partial(block, tail=True), carry)
    else:
        m, l, acc = lax.fori_loop(first, last, functools.partial(block, tail=False), init)
    plgpu.store(o_ref, acc)
    plgpu.store(m_ref, m)
    plgpu.store(l_ref, l)


def _chain_paths(k, v, tail_mask, lengths, *, block_k):
    """Each tree query's chain, as plain decoding would have cached it: ``[batch, num_kv_heads, num_q,
    path_width, head_dim]`` K and V rows for the positions from the block holding the tail's start
    (``(length - num_q) // block_k * block_k``) on: prefix rows, then the query's visible tail rows
    (its ancestors and itself, in slot order, which is depth order) one after another, then filler
    (a valid row, never visible: it lies past the query's position)."""
    num_q = tail_mask.shape[-1]
    tail_start = lengths - num_q  # [batch]
    # [batch, num_q, num_q]: chain position j past the tail's start -> the j-th tail slot the query sees
    slot_at = jnp.argsort(~tail_mask.astype(bool), axis=-1, stable=True)
    path_width = pl.cdiv(block_k - 1 + num_q, block_k) * block_k
    positions = (tail_start // block_k * block_k)[:, None] + jnp.arange(path_width)  # [batch, path_width]
    past_start = positions - tail_start[:, None]
    in_chain = jnp.take_along_axis(slot_at, jnp.clip(past_start, 0, num_q - 1)[:, None, :].repeat(num_q, 1), -1)
    source = jnp.where(past_start[:, None, :] < 0, positions[:, None, :], tail_start[:, None, None] + in_chain)
    source = jnp.where(past_start[:, None, :] < num_q, source, tail_start[:, None, None])  # [batch, num_q, width]
    gather = jax.vmap(lambda cache, rows: cache[:, rows])  # [heads, len, d], [num_q, width] -> [heads, num_q, width, d]
    return gather(k, source), gather(v, source)


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *, num_splits):
    # o_ref [num_splits, BLOCK_M, d], m_ref / l_ref [num_splits, BLOCK_M] -> out_ref [BLOCK_M, d]
    def split(s, carry):
        m, l, acc = carry
        m_s = plgpu.load(m_ref.at[s])
        m_new = jnp.maximum(m, m_s)
        old, new = jnp.exp(m - m_new), jnp.exp(m_s - m_new)
        acc = acc * old[:, None] + plgpu.load(o_ref.at[s]) * new[:, None]
        return m_new, l * old + plgpu.load(l_ref.at[s]) * new, acc

    init = (jnp.full((BLOCK_M,), _MASK_VALUE, jnp.float32), jnp.zeros((BLOCK_M,), jnp.float32),
            jnp.zeros(out_ref.shape, jnp.float32))
    _, l, acc = lax.fori_loop(0, num_splits, split, init)
    plgpu.store(out_ref, (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(out_ref.dtype))


@functools.partial(jax.jit, static_argnames=("window", "scale", "block_k", "split_rows", "interpret"))
def decode_attention_invariant(q, k, v, kv_lengths, *, q_positions, tail_mask=None, window=None, scale=None,
                               block_k=BLOCK_K, split_rows=SPLIT_ROWS, interpret=None):
    """``q [batch, num_q, num_q_heads, head_dim]``, ``k, v [batch, num_kv_heads, max_len, head_dim]``,
    ``kv_lengths [batch]``, ``q_positions [batch, num_q]``, ``tail_mask [batch, num_q, num_q]`` (optional,
    tree attention) -> ``[batch, num_q, num_q_heads, head_dim]``.

    A tree's rows are its nodes in slot order (each node's ancestors before it, as ``jspec.tree`` lays
    them out), the mask holds each node's ancestors and itself, and a node's position is the tail's
    start + its depth.

    ``block_k`` and ``split_rows`` (a multiple of it) fix the reduction order: results are invariant
    only between calls with the same values (and the same ``head_dim`` and dtypes).
    """
    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    if split_rows % block_k or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16 and split_rows a multiple of it, got {block_k}, "
                         f"{split_rows}")
    interpret = interpret_mode() if interpret is None else interpret
    group = num_q_heads // num_kv_heads
    rows = num_q * group
    padded = pl.cdiv(rows, BLOCK_M) * BLOCK_M
    d = max(16, _next_pow2(head_dim))
    cache_len = pl.cdiv(max_len, block_k) * block_k
    if (d, cache_len) != (head_dim, max_len):  # whole blocks for the loads (zeros change no dot product)
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, cache_len - max_len), (0, d - head_dim))) for x in (k, v))
    q_rows = q.astype(k.dtype).reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = jnp.pad(q_rows.reshape(batch, num_kv_heads, rows, head_dim),
                     ((0, 0), (0, 0), (0, padded - rows), (0, d - head_dim)))
    lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, max_len)
    pos = q_positions.astype(jnp.int32)
    # [batch, num_q]; a query at p < 0 sees nothing. A tree's node at depth j has position (tail start + j): it
    # sees the positions of its chain below it, which the kernel reads from the chain paths.
    hi = jnp.clip(jnp.minimum(lengths[:, None], pos + 1), 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.clip(pos - window + 1, 0)
    def per_row(x):  # [batch, num_q, ...] -> [batch, padded, ...]: each query's value on its group's rows
        return jnp.pad(jnp.repeat(x, group, axis=1), ((0, 0), (0, padded - rows)) + ((0, 0),) * (x.ndim - 2))

    row_lo, row_hi = per_row(lo), per_row(hi)
    extra_in, extra_specs = [], []
    if tail_mask is not None:
        paths = _chain_paths(k, v, tail_mask, lengths, block_k=block_k)
        extra_in += paths
        extra_specs += [pl.BlockSpec((None, None) + paths[0].shape[2:], lambda b, h, t, s: (b, h, 0, 0, 0))] * 2
    num_splits = pl.cdiv(max_len, split_rows)
    scale = head_dim**-0.5 if scale is None else scale
    compute_dtype = jnp.float32 if interpret else k.dtype  # XLA:CPU lacks some 16-bit dots; fp32 products are exact

    tile = lambda b, h, t, s: (b, h, t, 0)  # noqa: E731
    o_part, m_part, l_part = pdl.pallas_call(
        functools.partial(_split_kernel, block_k=block_k, split_rows=split_rows, scale=float(scale),
                          compute_dtype=compute_dtype, num_tail=0 if tail_mask is None else num_q, group=group),
        grid=(batch, num_kv_heads, padded // BLOCK_M, num_splits),
        in_specs=[pl.BlockSpec((None, None, BLOCK_M, d), tile),
                  pl.BlockSpec((None, None, cache_len, d), lambda b, h, t, s: (b, h, 0, 0)),
                  pl.BlockSpec((None, None, cache_len, d), lambda b, h, t, s: (b, h, 0, 0)),
                  pl.BlockSpec((None, BLOCK_M), lambda b, h, t, s: (b, t)),
                  pl.BlockSpec((None, BLOCK_M), lambda b, h, t, s: (b, t)),
                  pl.BlockSpec((None,), lambda b, h, t, s: (b,)), *extra_specs],
        out_specs=[pl.BlockSpec((None, None, None, BLOCK_M, d), lambda b, h, t, s: (b, h, s, t, 0)),
                   pl.BlockSpec((None, None, None, BLOCK_M), lambda b, h, t, s: (b, h, s, t)),
                   pl.BlockSpec((None, None, None, BLOCK_M), lambda b, h, t, s: (b, h, s, t))],
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, padded, d), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, padded), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, padded), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="invariant_attention",
    )(q_rows, k, v, row_lo, row_hi, lengths, *extra_in)
    out = pdl.pallas_call(
        functools.partial(_merge_kernel, num_splits=num_splits),
        grid=(batch, num_kv_heads, padded // BLOCK_M),
        in_specs=[pl.BlockSpec((None, None, num_splits, BLOCK_M, d), lambda b, h, t: (b, h, 0, t, 0)),
                  pl.BlockSpec((None, None, num_splits, BLOCK_M), lambda b, h, t: (b, h, 0, t)),
                  pl.BlockSpec((None, None, num_splits, BLOCK_M), lambda b, h, t: (b, h, 0, t))],
        out_specs=pl.BlockSpec((None, None, BLOCK_M, d), lambda b, h, t: (b, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, padded, d), q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="invariant_attention_merge",
    )(o_part, m_part, l_part)
    out = out[:, :, :rows, :head_dim].reshape(batch, num_kv_heads, num_q, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_q, num_q_heads, head_dim)
