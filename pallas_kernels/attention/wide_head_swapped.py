"""Wide-head decode attention with the query rows on WGMMA's N axis (Mosaic GPU, Hopper).

Same shapes, visibility rule and outputs as :func:`pallas_kernels.attention.wide_head_decode.decode_attention_wide`.
That kernel puts the query rows x GQA group on WGMMA's M axis in tiles of 64: at 72 rows (Gemma 4
31B verifying 8 drafts) a second tile carries 8 real rows, yet runs the whole per-block chain on an
SM of its own, and both tiles stream the same K/V (well short of copy bandwidth). Here the
products are transposed so that all the rows (up to 256, a multiple of 8) are one N:

* ``s^T [64 keys, rows] = K [64, head_dim] @ q^T``: K's block straight from the ring as WGMMA's A,
  q (held in shared memory for the whole call, as there) as a transposed B. Each consumer
  warpgroup computes the block's scores over the whole head_dim;
* the softmax runs down the keys (axis 0, across the warpgroup's warps), keeping a max and a sum
  per row;
* ``out^T [256 columns, rows] += V^T @ p^T``: the CTA owns 256 of head_dim's columns, their V
  chunk transposed as A, ``p^T`` through shared memory as B (stored transposed: ``p [rows, 64]``).

64-key blocks stream in 256-column chunks through a producer ring as in the M-axis kernel; the
output (transposed back through q's shared memory) and the base-2 log-sum-exps go to the same split
merge. The consumer holds a 256 x rows fp32 accumulator (144 registers a thread at 72 rows) beside
the scores and a few values per row, so a CTA has one consumer warpgroup (248 registers) and owns
256 output columns: at head_dim 512 a cluster of two CTAs splits the columns, both reading K (shared
in L2) and each its half of V. (Two consumers in one CTA, 232 registers each, run slower and give
wrong results on the GPU from 20 rows on, though the interpreter agrees with the reference.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import interpret_mode
from pallas_kernels.attention.split_kv import _MASK_VALUE
from pallas_kernels.attention.wide_head_decode import (accumulate, copy_queries, online_softmax, query_rows,
                                             zero_rows_past_length)
from pallas_kernels.attention.wide_head_merge import merge_splits
from pallas_kernels.attention.wide_head_tiling import COLUMNS, NUM_SMS, SMEM_BYTES

BLOCK_KV = 64  # keys per block: WGMMA's M
MAX_ROWS = 256  # WGMMA's largest N
GROUP_ROWS = 40  # the most rows a CTA takes by default (see default_row_groups)
REDUCTION_SCRATCH = 2048  # shared memory bytes for the softmax's reductions across a warpgroup's warps


def group_rows(num_q, num_q_heads, num_kv_heads, row_groups) -> int:
    """Rows of one CTA's N: its share of the query rows x GQA group, whole queries where the group
    fills whole 8-row tiles (q is then copied per query), rounded up to WGMMA's N granularity (8)."""
    group = num_q_heads // num_kv_heads
    if group % 8 == 0:
        return pl.cdiv(num_q, row_groups) * group
    return pl.cdiv(pl.cdiv(num_q * group, row_groups), 8) * 8


def default_row_groups(num_q, num_q_heads, num_kv_heads) -> int:
    """CTAs sharing a KV head's query rows: as few as keep each at most ``GROUP_ROWS`` rows.

    A CTA's 256 x rows fp32 accumulator sits in its consumer's registers: 40 rows in one CTA stream
    close to copy bandwidth (Gemma 4 31B full layers verifying 4 drafts), where 72 rows are far
    slower than the M-axis kernel (figures: ``benchmarks/README.md``, draft attention at Gemma 4
    shapes)."""
    group = num_q_heads // num_kv_heads
    row_groups = 1
    while group_rows(num_q, num_q_heads, num_kv_heads, row_groups) > max(GROUP_ROWS, group):
        row_groups += 1
    return row_groups


def supports(num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype) -> bool:
    """Whether these shapes fit the kernel (it raises otherwise)."""
    return (head_dim % COLUMNS == 0 and max_len % BLOCK_KV == 0 and num_q_heads // num_kv_heads <= MAX_ROWS
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def default_splits(batch, ctas, max_len) -> int:
    """About one CTA per SM (``ctas``: CTAs per sequence and split), at least 4 blocks per split."""
    return max(1, min(NUM_SMS // (batch * ctas), max_len // BLOCK_KV // 4))


def decode_attention_swapped(q, k, v, kv_lengths, *, q_positions, scale=None, row_groups=None, slots=None,
                             k_splits=None, interpret=None):
    """``q [batch, num_q, num_q_heads, head_dim]``, ``k, v [batch, num_kv_heads, max_len, head_dim]``,
    ``kv_lengths [batch]``, ``q_positions [batch, num_q]`` -> ``[batch, num_q, num_q_heads, head_dim]``.

    Needs head_dim a multiple of 256, ``max_len`` a multiple of 64, a 16-bit cache and a GQA group
    <= 256. ``row_groups``: CTAs sharing a KV head's rows (see :func:`default_row_groups`); ``slots``:
    K/V chunks in the ring (a block's head_dim / 256 K chunks + its V chunk at least; default: all
    that fit); ``k_splits``: see :func:`default_splits`.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    rows = num_q * group
    if not supports(num_q, num_q_heads, num_kv_heads, max_len, head_dim, k.dtype):
        raise ValueError(
            f"decode_attention_swapped needs head_dim a multiple of {COLUMNS} (got {head_dim}), max_len a multiple "
            f"of {BLOCK_KV} (got {max_len}), a GQA group of at most {MAX_ROWS} (got {group}) and a 16-bit cache "
            f"(got {k.dtype})")
    row_groups = row_groups or default_row_groups(num_q, num_q_heads, num_kv_heads)
    rows_pad = group_rows(num_q, num_q_heads, num_kv_heads, row_groups)  # one CTA's N
    if rows_pad > MAX_ROWS or (row_groups - 1) * rows_pad >= rows:
        raise ValueError(f"row_groups={row_groups}: every group of {rows} query rows x GQA group needs rows of its "
                         f"own and at most {MAX_ROWS}")
    interpret = interpret_mode() if interpret is None else interpret
    dtype = k.dtype
    k_chunks = head_dim // COLUMNS  # every CTA's scores read all of K; a CTA per chunk of output columns
    chunks = k_chunks + 1  # per K/V block: K's column chunks, then the V chunk of the CTA's columns
    n_blocks = max_len // BLOCK_KV
    # q (then the output), p, the log-sum-exps (1 KiB-aligned allocations), barriers, the reductions' scratch
    free_bytes = (SMEM_BYTES - rows_pad * (head_dim + BLOCK_KV) * dtype.itemsize - 2 * 1024 - 256
                  - REDUCTION_SCRATCH)
    most = free_bytes // (BLOCK_KV * COLUMNS * dtype.itemsize)
    slots = most if slots is None else slots
    if not chunks <= slots <= most:
        raise ValueError(f"slots={slots}: the K/V ring holds one block's {chunks} chunks at least, and at most the "
                         f"{most} chunks of {BLOCK_KV} x {COLUMNS} that fit beside q and p at {rows} rows")
    k_splits = k_splits or default_splits(batch, num_kv_heads * row_groups * k_chunks, max_len)
    blocks_per_split = pl.cdiv(n_blocks, k_splits)
    k_splits = pl.cdiv(n_blocks, blocks_per_split)
    scale = head_dim**-0.5 if scale is None else scale
    logit_scale = float(scale) * math.log2(math.e)

    q_in_place = group % 8 == 0  # whole 8-row smem tiles: one TMA copy per query's group
    group_queries = rows_pad // group if q_in_place else None  # queries of a row group
    if q_in_place:
        q_rows = q.astype(dtype).reshape(batch, num_q, num_kv_heads, group, head_dim)
    else:
        q_rows = query_rows(q, dtype, num_kv_heads, row_groups * rows_pad).reshape(
            batch, num_kv_heads * row_groups, rows_pad, head_dim)
    lengths, positions = kv_lengths.astype(jnp.int32), q_positions.astype(jnp.int32)

    swizzle = 128
    wgmma_layout = plgpu.Layout.WGMMA
    column_layout = wgmma_layout.reduce(0)  # one value per query row (the accumulators' N axis)
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((BLOCK_KV, COLUMNS), dtype, swizzle)

    # A head's column chunks as one cluster: launched together, they share their K reads in L2. The
    # interpreter runs no clusters.
    clustered = k_chunks > 1 and not interpret

    def kernel(q_ref, k_ref, v_ref, length_ref, position_ref, out_ref, lse_ref, scratch):
        split, b, wg = (lax.axis_index(name) for name in ("split", "batch", "wg"))
        if clustered:
            tile, column = lax.axis_index("heads"), lax.axis_index("cols")
        else:
            tile, column = lax.axis_index("heads") // k_chunks, lax.rem(lax.axis_index("heads"), k_chunks)
        h, row_group = tile // row_groups, lax.rem(tile, row_groups)  # tile: the KV head's row group
        (q_smem, ring, p_smem, lse_smem), (q_ready, ready, free) = scratch
        length = jnp.clip(length_ref[b], 0, max_len)
        limits = [jnp.maximum(jnp.minimum(length, position_ref[b, i] + 1), 0) for i in range(num_q)]
        lowest, highest = functools.reduce(jnp.minimum, limits), functools.reduce(jnp.maximum, limits)
        first = split * blocks_per_split
        end = jnp.minimum(first + blocks_per_split, pl.cdiv(highest, BLOCK_KV))

        @pl.when(wg == 0)
        def _consumer():
            plgpu.set_max_registers(248, action="increase")
            plgpu.barrier_wait(q_ready.at[0])
            row_limit = limits[-1]  # padding rows take the last query's limit: the range stays the queries'
            if num_q > 1:
                row_query = (row_group * rows_pad
                             + plgpu.broadcasted_iota(jnp.int32, (rows_pad,), 0, layout=column_layout)) // group
                row_limit = functools.reduce(lambda acc, i: jnp.where(row_query == i, limits[i], acc),
                                             range(num_q - 2, -1, -1), row_limit)
            m = plgpu.layout_cast(jnp.full((rows_pad,), _MASK_VALUE, jnp.float32), column_layout)
            l = plgpu.layout_cast(jnp.zeros((rows_pad,), jnp.float32), column_layout)
            acc = plgpu.layout_cast(jnp.zeros((COLUMNS, rows_pad), jnp.float32), wgmma_layout)
            for slot in range(slots):
                plgpu.barrier_arrive(free.at[slot])

            def step(block, carry):
                acc, m, l = carry
                slot = [lax.rem((block - first) * chunks + j, slots) for j in range(chunks)]
                start = block * BLOCK_KV
                for j in range(k_chunks):
                    plgpu.barrier_wait(ready.at[slot[j]])

                def scores(acc_ref):
                    for j in range(k_chunks):
                        plgpu.wgmma(acc_ref, ring.at[slot[j]], q_smem[j].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((BLOCK_KV, rows_pad), jnp.float32))  # [keys, rows]
                for j in range(k_chunks):
                    plgpu.barrier_arrive(free.at[slot[j]])
                s = s * logit_scale

                def mask(s):  # -inf: a row that sees nothing here keeps p = 0
                    keys = start + plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=wgmma_layout)
                    limit = row_limit if num_q == 1 else lax.broadcast_in_dim(row_limit, s.shape, [1])
                    return jnp.where(keys < limit, s, -jnp.inf)

                s = lax.cond(start + BLOCK_KV > lowest, mask, lambda s: s, s)
                m_new, p, l, acc = online_softmax(s, m, l, acc, keys_axis=0)
                p_smem.transpose((1, 0))[...] = p.astype(dtype)
                plgpu.commit_smem()
                v_tile = ring.at[slot[k_chunks]]
                plgpu.barrier_wait(ready.at[slot[k_chunks]])
                pl.when(start + BLOCK_KV > length)(
                    functools.partial(zero_rows_past_length, v_tile, start, length, copy_layout))
                acc = accumulate(acc, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)), interpret=interpret)
                plgpu.barrier_arrive(free.at[slot[k_chunks]])
                return acc, m_new, l

            acc, m, l = lax.fori_loop(first, end, step, (acc, m, l))
            # The scores' last reads of q_smem are done (their accumulator was read): it takes the output.
            l_safe = jnp.where(l > 0, l, jnp.ones_like(l))  # a split that saw nothing writes zeros
            out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [1])
            q_smem[0].transpose((1, 0))[...] = out.astype(dtype)
            last_word = k_splits > 1  # every CTA's log-sum-exps are the same: column chunk 0's go out
            if last_word:
                lse_smem[...] = jnp.where(l > 0, m + jnp.log2(l_safe), -jnp.inf)
            plgpu.commit_smem()
            out_tile = out_ref.at[b, tile] if k_splits == 1 else out_ref.at[b, tile, split]
            plgpu.copy_smem_to_gmem(q_smem[0], out_tile.at[:, pl.ds(column * COLUMNS, COLUMNS)])
            if last_word:
                pl.when(column == 0)(lambda: plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, tile, split]))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 1)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            # a last row group's queries past num_q copy the last one again: rows to discard, but finite
            queries = [jnp.minimum(row_group * group_queries + i, num_q - 1) for i in range(group_queries)] \
                if q_in_place else None
            copy_queries(q_ref, q_smem, q_ready.at[0], b=b, head=h, prepared=tile, queries=queries, group=group)

            @pl.loop(first, end)
            def _stream(block):
                keys = pl.ds(block * BLOCK_KV, BLOCK_KV)
                for j in range(chunks):  # K's chunks, then the V chunk of this CTA's columns
                    slot = lax.rem((block - first) * chunks + j, slots)
                    plgpu.barrier_wait(free.at[slot])
                    source = k_ref.at[b, h, keys, pl.ds(j * COLUMNS, COLUMNS)] if j < k_chunks else \
                        v_ref.at[b, h, keys, pl.ds(column * COLUMNS, COLUMNS)]
                    plgpu.copy_gmem_to_smem(source, ring.at[slot], ready.at[slot])

    def entry(*refs):
        swizzled = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
        copies = k_chunks * (group_queries if q_in_place else 1)
        pl.run_scoped(
            lambda *scratch: kernel(*refs, scratch),
            ([plgpu.SMEM((rows_pad, COLUMNS), dtype, transforms=swizzled)] * k_chunks,
             plgpu.SMEM((slots, BLOCK_KV, COLUMNS), dtype, transforms=swizzled),
             plgpu.SMEM((rows_pad, BLOCK_KV), dtype, transforms=swizzled),
             plgpu.SMEM((rows_pad,), jnp.float32)),
            (plgpu.Barrier(num_arrivals=copies, num_barriers=1), plgpu.Barrier(num_barriers=slots),
             plgpu.Barrier(num_barriers=slots)),
            collective_axes="wg",
        )

    tiles = num_kv_heads * row_groups
    if k_splits == 1:
        out_type = [jax.ShapeDtypeStruct((batch, tiles, rows_pad, head_dim), dtype),
                    jax.ShapeDtypeStruct((1,), jnp.float32)]
    else:
        out_type = [jax.ShapeDtypeStruct((batch, tiles, k_splits, rows_pad, head_dim), dtype),
                    jax.ShapeDtypeStruct((batch, tiles, k_splits, rows_pad), jnp.float32)]
    clusters = dict(cluster=(k_chunks,), cluster_names=("cols",)) if clustered else {}
    out, lse = plgpu.kernel(
        entry, out_type=out_type, grid=(tiles * (1 if clustered else k_chunks), k_splits, batch),
        grid_names=("heads", "split", "batch"), **clusters, num_threads=2, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=REDUCTION_SCRATCH),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_rows, k, v, lengths, positions)
    if k_splits == 1:
        out = out.reshape(batch, num_kv_heads, row_groups * rows_pad, head_dim)[:, :, :rows]
        out = out.reshape(batch, num_kv_heads, num_q, group, head_dim).transpose(0, 2, 1, 3, 4)
        return out.astype(q.dtype).reshape(batch, num_q, num_q_heads, head_dim)
    return merge_splits(out, lse, num_q=num_q, num_kv_heads=num_kv_heads, group=group, dtype=q.dtype,
                        interpret=interpret)
