"""Decode attention for wide heads (head_dim 512: Gemma 4's full layers) on Hopper, in Mosaic GPU.

Same shapes and visibility rule as :mod:`pallas_kernels.attention.decode_attention` (no ``tail_mask``, no
window: full layers have neither outside tree verification). At head_dim 512 the Triton kernel
streams well short of copy bandwidth once the query rows x GQA group pass 16 (every 16-row slice
re-reads the K/V tile from shared memory, and a 64 x 512 fp32 accumulator leaves Triton no
registers). This kernel is built the way FlashMLA runs 512-wide heads:

* one CTA per (KV head, M tile, split, sequence); the query rows x GQA group are WGMMA M tiles of
  64 rows, each held in shared memory for the whole call, so K and V are read from HBM once per KV
  head and M tile (the tiles of one head run as one cluster and, at 32-row blocks, the default for
  several tiles, receive each K/V chunk by one multicast copy: it crosses from L2 to shared memory
  once for all of them). A GQA
  group of whole 8-row tiles (31B: 8) is copied from q's own layout, one TMA copy per query; a
  smaller one (E4B: 4) is transposed and padded by XLA first (a launch of its own);
* a producer warpgroup streams K and V by TMA in chunks of ``block_kv`` rows x 256 columns (per
  K/V block: K's chunks, then V's) into a ring of ``slots`` chunks. At head_dim 512 a whole K and V
  block (128 KiB) beside q (64 KiB) leaves no room for a second one; five 32 KiB chunks let the next
  block's K stream in while this block's V is consumed. A CTA streams only as fast as the chunks it
  keeps in flight, so a fuller M tile takes 32-row blocks (a ring of eight 16 KiB chunks, which free
  sooner: :func:`default_block_kv`);
* ``head_dim // 256`` consumer warpgroups each own 256 output columns (a 64 x 256 fp32
  accumulator, WGMMA's widest N) and compute their share of ``p @ v``. The scores ``q @ k.T`` at
  32-row blocks (full M tiles) are split the same way: each consumer multiplies its 256 columns
  and the partial scores are added through shared memory, halving the tensor-core work that bounds
  a full tile (faster at 72 rows); a consumer waits for the block's V chunks between posting
  its partial scores and reading the other's, so that wait fills the exchange's. At 64-row blocks
  (light tiles) each consumer computes the scores over the whole head_dim itself, which costs idle
  tensor-core time instead of a round trip;
* splits of the KV axis write normalised partials (a tile's real rows only) and base-2
  log-sum-exps, merged in one launch straight into the output's layout
  (:mod:`pallas_kernels.attention.wide_head_merge`; ``k_splits == 1`` writes the output directly); the
  limits are scalar work inside the kernel, not XLA ops around it (each of those is a launch of
  its own, a sizeable share of a small call).

Masking: row ``r`` sees cache rows ``[0, limit_r)`` with ``limit_r = min(L, p_r + 1)``; only
blocks past the smallest limit are masked, and rows past ``L`` (which may hold NaN) are zeroed in
V's shared-memory tile before the product (``0 * NaN`` is NaN). Cache rows go unread past the
largest limit.

The consumer's steps are named regions (``wait_q``, ``blocks``: ``wait_k``, ``scores``, ``exchange``,
``softmax``, ``wait_v``, ``pv``; ``write_out``; the producer's ``stream``), which the Mosaic GPU
profiler times per warpgroup.

Needs an H100-class GPU; on a machine without one it runs in the Mosaic GPU interpreter
(``plgpu.InterpretGPUParams``, jax >= 0.12), which is how the CPU tests exercise it.
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
from pallas_kernels.attention.wide_head_merge import merge_splits
from pallas_kernels.attention.wide_head_tiling import (COLUMNS, ROWS, SMEM_BYTES, default_block_kv, default_share_scores,
                                             default_slots, default_splits, m_tiles, supports)


def online_softmax(s, m, l, acc, *, keys_axis):
    """One block of the online softmax (base 2) over the scores ``s``'s ``keys_axis``, the query
    rows on the other axis of ``s`` and of ``acc``: ``(m, p, l, acc)``, the running max, the block's
    probabilities, the running sum and the accumulator rescaled to the new max."""
    rows_axis = 1 - keys_axis
    m_new = jnp.maximum(m, s.max(axis=keys_axis))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [rows_axis]))
    l = l * alpha + p.sum(axis=keys_axis)
    return m_new, p, l, acc * lax.broadcast_in_dim(alpha, acc.shape, [rows_axis])


def accumulate(acc, a, b, *, interpret, a_smem=None):
    """``acc + a @ b`` on the tensor cores, in place; ``a`` from registers or shared memory, ``b``
    from shared memory. The interpreter takes WGMMA operands from shared memory only (``a_smem``:
    where a register ``a`` goes there) and runs it only on a fresh accumulator, so there the product
    is added in registers."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        if a_smem is not None:
            a_smem[...] = a
            a = a_smem

        def product(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))

    def accumulate_in_place(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(accumulate_in_place)(plgpu.ACC.init(acc))


def copy_queries(q_ref, q_smem, barrier, *, b, head, prepared, queries, group):
    """The producer's copies of a CTA's query rows into q's 256-column chunks in shared memory, all
    arriving on ``barrier``: one TMA copy per query's GQA group and chunk from q's own layout
    (``queries``: the queries, in row order), or without ``queries`` one per chunk of the rows
    :func:`query_rows` prepared (``q_ref[b, prepared]``)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for j, chunk in enumerate(q_smem):
        columns = pl.ds(j * COLUMNS, COLUMNS)
        if queries is None:
            plgpu.copy_gmem_to_smem(q_ref.at[b, prepared, :, columns], chunk, barrier)
            continue
        for i, query in enumerate(queries):
            plgpu.copy_gmem_to_smem(q_ref.at[b, query, head, :, columns], chunk.at[pl.ds(i * group, group)], barrier)


def zero_rows_past_length(v_tile, start, length, layout):
    """Rows of a V tile (cache rows from ``start``) past ``length`` set to zero in shared memory:
    p is 0 there, but 0 * NaN is not."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tile = plgpu.load(v_tile, layout=layout)
    r = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=layout)
    v_tile[...] = jnp.where(start + r < length, tile, jnp.zeros_like(tile))
    plgpu.commit_smem()


def query_rows(q, dtype, num_kv_heads, padded):
    """``q [batch, num_q, num_q_heads, head_dim]`` as each KV head's query rows x GQA group (row
    ``r``: query ``r // group``), zero-padded to ``padded``: ``[batch, num_kv_heads, padded,
    head_dim]`` (an XLA transpose + pad: a launch of its own)."""
    batch, num_q, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rows = q.astype(dtype).reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    return jnp.pad(rows.reshape(batch, num_kv_heads, num_q * group, head_dim),
                   ((0, 0), (0, 0), (0, padded - num_q * group), (0, 0)))


def decode_attention_wide(q, k, v, kv_lengths, *, q_positions, scale=None, block_kv=None, slots=None,
                          k_splits=None, share_scores=None, multicast=None, interpret=None):
    """``q [batch, num_q, num_q_heads, head_dim]``, ``k, v [batch, num_kv_heads, max_len, head_dim]``,
    ``kv_lengths [batch]``, ``q_positions [batch, num_q]`` -> ``[batch, num_q, num_q_heads, head_dim]``.

    Needs head_dim a multiple of 256, ``max_len`` a multiple of ``block_kv`` (a multiple of 32), a
    16-bit cache; num_q x GQA group rows run in M tiles of 64. ``block_kv``: see
    :func:`default_block_kv`; ``slots``: K/V chunks in the ring (at least one block's, at most what
    227 KiB of shared memory hold beside q; default :func:`default_slots`); ``k_splits``: see
    :func:`default_splits`; ``share_scores``: see :func:`default_share_scores`; ``multicast``: whether
    a cluster of M tiles receives each K/V chunk by one multicast copy (default: wherever a head has
    several tiles and the blocks are 32 rows; ``True`` at other blocks is a ValueError).
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu

    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    rows = num_q * group
    tiles = m_tiles(num_q, num_q_heads, num_kv_heads)
    block_kv = block_kv or default_block_kv(num_q, num_q_heads, num_kv_heads)
    if block_kv % 32 or not supports(num_q, num_q_heads, num_kv_heads, max_len, head_dim, k.dtype,
                                     block_kv=block_kv):
        raise ValueError(
            f"decode_attention_wide needs head_dim a multiple of {COLUMNS} (got {head_dim}), max_len a multiple "
            f"of block_kv (got {max_len}, {block_kv}; block_kv a multiple of 32) and a 16-bit cache (got {k.dtype})")
    interpret = interpret_mode() if interpret is None else interpret
    # A head's M tiles as one cluster: launched together, they share their K/V reads in L2 (as
    # neighbouring programs they drift apart at large batches, and run slower). The interpreter runs no clusters.
    cluster_tiles = tiles > 1 and not interpret
    # Every tile of a head reads the same K/V chunks: as one multicast copy a chunk crosses from L2
    # to shared memory once for the cluster, not once a tile (faster for 31B's 72 rows at large reads).
    # Only at 32-row blocks, the default wherever a head has several tiles: at 64-row blocks (a ring
    # of one block) the kernel hangs.
    if multicast and block_kv != 32:
        raise ValueError(f"multicast=True needs 32-row blocks (got block_kv={block_kv}): at 64-row blocks "
                         "the multicast ring hangs")
    multicast = multicast is not False and cluster_tiles and block_kv == 32
    consumers = head_dim // COLUMNS
    n_blocks = max_len // block_kv
    chunks = 2 * consumers  # per K/V block: K's column chunks, then V's
    # q (then the output), then limits and lse (1 KiB-aligned allocations), barriers. Row reductions stay
    # inside a warp in the WGMMA layout, so no cross-warp reduction scratch is reserved.
    share_scores = default_share_scores(block_kv, consumers) if share_scores is None else share_scores
    exchange_bytes = 2 * consumers * ROWS * block_kv * 4 if share_scores else 0  # two blocks' partial scores
    free_bytes = SMEM_BYTES - ROWS * head_dim * k.dtype.itemsize - 2 * 1024 - 256 - exchange_bytes
    most = free_bytes // (block_kv * COLUMNS * k.dtype.itemsize)
    slots = default_slots(block_kv, most) if slots is None else slots
    if not chunks <= slots <= most:
        raise ValueError(f"slots={slots}: the K/V ring holds one block's {chunks} chunks at least, and at most "
                         f"the {most} chunks of {block_kv} x {COLUMNS} that fit the {SMEM_BYTES} bytes of shared "
                         f"memory a Hopper CTA has beside q at head_dim {head_dim}")
    k_splits = k_splits or default_splits(batch, num_kv_heads, max_len, block_kv, tiles)
    blocks_per_split = pl.cdiv(n_blocks, k_splits)
    k_splits = pl.cdiv(n_blocks, blocks_per_split)  # no split left without blocks at full length
    scale = head_dim**-0.5 if scale is None else scale
    logit_scale = float(scale) * math.log2(math.e)  # softmax in base 2: exp2 is one instruction
    dtype = k.dtype

    # Query rows x GQA group -> M tiles per (sequence, KV head): row r = query r // group.
    padded = tiles * ROWS
    tile_rows = [min(ROWS, pl.cdiv(rows - i * ROWS, 8) * 8) for i in range(tiles)]
    # A group of whole 8-row smem tiles is copied straight from q, one query's group per copy (an XLA
    # transpose + pad before the call costs a launch); rows past the last query are left as
    # they are: rows never mix in WGMMA or the row reductions, and only real rows are written out.
    q_in_place = group % 8 == 0
    copies_per_chunk = min(ROWS // group, num_q) if q_in_place else 1
    if q_in_place:
        q_rows = q.astype(dtype).reshape(batch, num_q, num_kv_heads, group, head_dim)
    else:  # whole tiles as leading indices (the kernel's dynamic indices stay on leading axes, as for heads)
        q_rows = query_rows(q, dtype, num_kv_heads, padded).reshape(batch, num_kv_heads * tiles, ROWS, head_dim)
    lengths, positions = kv_lengths.astype(jnp.int32), q_positions.astype(jnp.int32)

    # WGMMA's K groups are one swizzle wide and both operands share it: the product with V sums over
    # block_kv rows, so 32-row blocks take 64-byte swizzles everywhere.
    swizzle = min(128, block_kv * dtype.itemsize)
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = wgmma_layout.reduce(1)
    # The layout of a plain copy of a swizzled tile: takes a K/V chunk of any block_kv (WGMMA's needs 64 rows).
    copy_layout = plgpu.Layout.SMEM_GMEM_COPY((block_kv, COLUMNS), dtype, swizzle)

    def kernel(q_ref, k_ref, v_ref, length_ref, position_ref, out_ref, lse_ref, scratch):
        b, split, wg = (lax.axis_index(name) for name in ("batch", "split", "wg"))
        if cluster_tiles:
            h, t = lax.axis_index("heads"), lax.axis_index("tile")
            head_tile = h * tiles + t
        else:
            head_tile = lax.axis_index("heads")
            h, t = head_tile // tiles, lax.rem(head_tile, tiles)
        (q_smem, ring, lse_smem, p_smem, score_smem), (q_ready, ready), (free, done, shared, leave) = scratch
        # Query i sees cache rows [0, limit_i); the tile reads the blocks its queries see (scalar work,
        # here rather than in XLA ops around the call: each of those is a launch).
        length = jnp.clip(length_ref[b], 0, max_len)
        limits = [jnp.maximum(jnp.minimum(length, position_ref[b, i] + 1), 0) for i in range(num_q)]

        def in_tile(i):  # whether query i's rows [i * group, (i + 1) * group) meet this tile's
            return True if tiles == 1 else (i * group < (t + 1) * ROWS) & ((i + 1) * group > t * ROWS)

        lowest = functools.reduce(jnp.minimum, [jnp.where(in_tile(i), x, max_len) for i, x in enumerate(limits)])
        # A multicast cluster streams one range of blocks: the union of its tiles' (masking covers the rest).
        highest = functools.reduce(jnp.maximum, [x if multicast else jnp.where(in_tile(i), x, 0)
                                                 for i, x in enumerate(limits)])
        first = split * blocks_per_split
        end = jnp.minimum(first + blocks_per_split, pl.cdiv(highest, block_kv))

        def consumer(c):
            plgpu.set_max_registers(232, action="increase")
            with jax.named_scope("wait_q"):  # named regions: what the Mosaic GPU profiler times per warpgroup
                plgpu.barrier_wait(q_ready.at[0])
            # Each row's limit (one query: all rows share it); padding rows take the last query's, which
            # never widens the tile's range.
            row_limit = limits[-1]
            if num_q > 1:
                row_query = (t * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=row_layout)) // group
                row_limit = functools.reduce(lambda acc, i: jnp.where(row_query == i, limits[i], acc),
                                             range(num_q - 2, -1, -1), row_limit)
            m = plgpu.layout_cast(jnp.full((ROWS,), _MASK_VALUE, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((ROWS, COLUMNS), jnp.float32), wgmma_layout)
            for slot in range(slots):  # every slot starts free: the producer waits on each chunk's slot alike
                plgpu.barrier_arrive(free.at[slot])

            def step(block, carry):
                acc, m, l = carry
                slot = [lax.rem((block - first) * chunks + j, slots) for j in range(chunks)]  # K chunks, V chunks
                start = block * block_kv
                with jax.named_scope("wait_k"):
                    for j in range(consumers):
                        plgpu.barrier_wait(ready.at[slot[j]])
                        if share_scores and j != c:
                            plgpu.barrier_arrive(free.at[slot[j]])
                own = [c] if share_scores else range(consumers)

                def wait_v():
                    with jax.named_scope("wait_v"):
                        for j in range(consumers):  # every consumer passes every chunk's barriers, in order
                            plgpu.barrier_wait(ready.at[slot[consumers + j]])
                            if j != c:
                                plgpu.barrier_arrive(free.at[slot[consumers + j]])

                def scores(acc_ref):
                    for j in own:
                        plgpu.wgmma(acc_ref, q_smem[j], ring.at[slot[j]].transpose((1, 0)))
                    return acc_ref[...]

                with jax.named_scope("scores"):
                    s = pl.run_scoped(scores, plgpu.ACC((ROWS, block_kv), jnp.float32))
                for j in own:
                    plgpu.barrier_arrive(free.at[slot[j]])
                if share_scores:  # the consumers' partial scores, added in one order by all: the same s everywhere
                    with jax.named_scope("exchange"):
                        half = lax.rem(block - first, 2)
                        exchange = score_smem.at[half]
                        exchange.at[c][...] = s
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(shared.at[half])
                        # The V waits fill the wait for the other consumer's scores (faster from
                        # 256 MB read).
                        wait_v()
                        plgpu.barrier_wait(shared.at[half])
                        parts = [s if j == c else plgpu.load(exchange.at[j], layout=wgmma_layout)
                                 for j in range(consumers)]
                        s = functools.reduce(jnp.add, parts)
                s = s * logit_scale

                def mask(s):  # -inf, not _MASK_VALUE: a row that sees nothing here keeps p = 0
                    cols = start + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=wgmma_layout)
                    limit = row_limit if num_q == 1 else lax.broadcast_in_dim(row_limit, s.shape, [0])
                    return jnp.where(cols < limit, s, -jnp.inf)

                with jax.named_scope("softmax"):
                    s = lax.cond(start + block_kv > lowest, mask, lambda s: s, s)
                    m_new, p, l, acc = online_softmax(s, m, l, acc, keys_axis=1)
                if not share_scores:
                    wait_v()
                v_tile = ring.at[slot[consumers + c]]

                pl.when(start + block_kv > length)(
                    functools.partial(zero_rows_past_length, v_tile, start, length, copy_layout))
                with jax.named_scope("pv"):
                    acc = accumulate(acc, p.astype(dtype), v_tile, interpret=interpret,
                                     a_smem=None if p_smem is None else p_smem[c])
                plgpu.barrier_arrive(free.at[slot[consumers + c]])
                return acc, m_new, l

            with jax.named_scope("blocks"):
                acc, m, l = lax.fori_loop(first, end, step, (acc, m, l))
            if multicast:  # no tile leaves while the other may still arrive on its ring's barriers
                plgpu.barrier_arrive(leave.at[0])
                plgpu.barrier_wait(leave.at[0])
            with jax.named_scope("write_out"):
                # Every consumer is past its last read of q_smem, which now takes the output.
                plgpu.barrier_arrive(done.at[0])
                plgpu.barrier_wait(done.at[0])
                l_safe = jnp.where(l > 0, l, jnp.ones_like(l))  # a split that saw nothing writes zeros
                q_smem[c][...] = (acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])).astype(dtype)
                if c == 0 and k_splits > 1:
                    lse_smem[...] = jnp.where(l > 0, m + jnp.log2(l_safe), -jnp.inf)
                plgpu.commit_smem()
                out_tile = out_ref.at[b, head_tile] if k_splits == 1 else out_ref.at[b, head_tile, split]

                def write(n):  # a tile's real rows only (rounded up to whole 8-row smem tiles): the merge reads no more
                    plgpu.copy_smem_to_gmem(q_smem[c].at[pl.ds(0, n)],
                                            out_tile.at[pl.ds(0, n), pl.ds(c * COLUMNS, COLUMNS)])

                if tiles == 1:
                    write(tile_rows[0])
                else:  # the tile index is dynamic, each tile's row count static
                    for i, n in enumerate(tile_rows):
                        pl.when(t == i)(functools.partial(write, n))
                if c == 0 and k_splits > 1:
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, head_tile, split])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        for c in range(consumers):
            pl.when(wg == c)(functools.partial(consumer, c))

        @pl.when(wg == consumers)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            # the tile's i-th query (the last one again past num_q)
            queries = [jnp.minimum(t * (ROWS // group) + i, num_q - 1) for i in range(copies_per_chunk)]
            copy_queries(q_ref, q_smem, q_ready.at[0], b=b, head=h, prepared=head_tile,
                         queries=queries if q_in_place else None, group=group)

            with jax.named_scope("stream"):
                @pl.loop(first, end)
                def _stream(block):
                    rows_ = pl.ds(block * block_kv, block_kv)
                    for j in range(chunks):
                        n = (block - first) * chunks + j
                        slot = lax.rem(n, slots)
                        plgpu.barrier_wait(free.at[slot])
                        source = (k_ref, v_ref)[j // consumers].at[b, h, rows_, pl.ds(j % consumers * COLUMNS, COLUMNS)]
                        plgpu.copy_gmem_to_smem(source, ring.at[slot], ready.at[slot],
                                                collective_axes="tile" if multicast else None)

    cluster_barrier = (functools.partial(plgpu.ClusterBarrier, collective_axes=("tile",)) if multicast
                       else plgpu.Barrier)

    def entry(*refs):
        swizzled = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
        pl.run_scoped(
            lambda *scratch: kernel(*refs, scratch),
            # Every operand in 256-column chunks, one allocation each: TMA copies and WGMMA take whole,
            # contiguous chunks (and a static index into a shared-memory ref fails to lower on jax 0.11).
            ([plgpu.SMEM((ROWS, COLUMNS), dtype, transforms=swizzled)] * consumers,
             plgpu.SMEM((slots, block_kv, COLUMNS), dtype, transforms=swizzled),
             plgpu.SMEM((ROWS,), jnp.float32),
             [plgpu.SMEM((ROWS, block_kv), dtype, transforms=swizzled)] * consumers if interpret else None,
             plgpu.SMEM((2, consumers, ROWS, block_kv), jnp.float32) if share_scores else None),
            (plgpu.Barrier(num_arrivals=consumers * copies_per_chunk, num_barriers=1),
             plgpu.Barrier(num_barriers=slots)),
            # A multicast chunk lands in every tile's ring: its slot is free once all tiles' consumers are done.
            (cluster_barrier(num_arrivals=consumers, num_barriers=slots),
             plgpu.Barrier(num_arrivals=consumers, num_barriers=1),
             plgpu.Barrier(num_arrivals=consumers, num_barriers=2) if share_scores else None,
             cluster_barrier(num_arrivals=consumers, num_barriers=1) if multicast else None),
            collective_axes="wg",
        )

    if k_splits == 1:
        out_type = [jax.ShapeDtypeStruct((batch, num_kv_heads * tiles, ROWS, head_dim), dtype),
                    jax.ShapeDtypeStruct((1,), jnp.float32)]
    else:
        out_type = [jax.ShapeDtypeStruct((batch, num_kv_heads * tiles, k_splits, ROWS, head_dim), dtype),
                    jax.ShapeDtypeStruct((batch, num_kv_heads * tiles, k_splits, ROWS), jnp.float32)]
    clusters = dict(cluster=(tiles,), cluster_names=("tile",)) if cluster_tiles else {}
    out, lse = plgpu.kernel(
        entry, out_type=out_type, grid=(num_kv_heads * (1 if cluster_tiles else tiles), k_splits, batch),
        grid_names=("heads", "split", "batch"), **clusters,
        num_threads=consumers + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(q_rows, k, v, lengths, positions)
    if k_splits == 1:
        out = out.reshape(batch, num_kv_heads, padded, head_dim)[:, :, :rows]
        out = out.reshape(batch, num_kv_heads, num_q, group, head_dim).transpose(0, 2, 1, 3, 4)
        return out.astype(q.dtype).reshape(batch, num_q, num_q_heads, head_dim)
    return merge_splits(out, lse, num_q=num_q, num_kv_heads=num_kv_heads, group=group, dtype=q.dtype,
                        interpret=interpret)
