"""The split merge of :mod:`pallas_kernels.attention.wide_head_decode` as one Triton launch.

The wide-head kernel's splits write normalised partials ``[batch, kv_heads * tiles, splits, 64,
head_dim]`` (a tile's real rows) and base-2 log-sum-exps ``[batch, kv_heads * tiles, splits, 64]``.
In XLA (:func:`merge_splits_reference`) their merge takes three to six fusions, as XLA lays it out
(a transpose of the partials at some split counts), each a launch of its own: a noticeable share
of the whole call (figures: ``benchmarks/README.md``, draft attention at Gemma 4 shapes). Here one
program per (sequence, KV head, query, column chunk) loads every split's ``group x chunk`` block at
once, weighs them and writes the block of the output ``[batch, num_q, num_q_heads, head_dim]`` (the
query's GQA group of one KV head is contiguous there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.attention.split_kv import _next_pow2


def _floor_pow2(n: int) -> int:
    return 1 << (int(n).bit_length() - 1)


def _merge_kernel(lse_ref, part_ref, out_ref, *, num_kv_heads, tiles, tile_rows, k_splits, group, columns, head_dim):
    bh, query, chunk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b, h = bh // num_kv_heads, bh % num_kv_heads
    row = query * group  # the query's first row among the head's rows; a group never straddles two tiles
    head_tile = (b * num_kv_heads + h) * tiles + row // tile_rows
    splits = jnp.arange(_next_pow2(k_splits), dtype=jnp.int32)
    real = splits < k_splits
    rows = (head_tile * k_splits + jnp.minimum(splits, k_splits - 1))[:, None] * tile_rows + row % tile_rows \
        + jnp.arange(group, dtype=jnp.int32)[None, :]  # [splits, group] flat rows of the partials
    lse = plgpu.load(lse_ref.at[rows], mask=real[:, None], other=-jnp.inf)
    top = jnp.max(lse, axis=0)
    weights = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0)[None, :])  # 0 where a split saw nothing
    total = jnp.maximum(jnp.sum(weights, axis=0), 1e-30)
    cols = chunk * columns + jnp.arange(columns, dtype=jnp.int32)
    part = plgpu.load(part_ref.at[rows[:, :, None] * head_dim + cols[None, None, :]],
                      mask=jnp.broadcast_to(real[:, None, None], (*rows.shape, columns)), other=0.0)
    out = jnp.sum(part.astype(jnp.float32) * weights[:, :, None], axis=0) / total[:, None]
    out_ref[0, 0, :, :] = out.astype(out_ref.dtype)


def _check(partials, lse, num_q, num_kv_heads, group):
    batch, head_tiles, k_splits, tile_rows, _ = partials.shape
    tiles = head_tiles // num_kv_heads
    if (head_tiles % num_kv_heads or lse.shape != partials.shape[:4] or tile_rows % 8
            or (tiles > 1 and tile_rows % group)):
        raise ValueError(f"merge_splits needs partials [batch, kv_heads * tiles, splits, tile_rows, head_dim] and lse "
                         f"of their first four dims, tile_rows a multiple of 8 and, with several tiles, of the GQA "
                         f"group (got {partials.shape}, {lse.shape}, group {group})")
    if num_q * group > tiles * tile_rows:
        raise ValueError(f"{num_q} queries x group {group} do not fit {tiles} tiles of {tile_rows}")


def merge_splits_reference(partials, lse, *, num_q, num_kv_heads, group, dtype, interpret=False):
    """The merge in XLA ops: same signature as :func:`merge_splits` (``interpret`` unused)."""
    del interpret
    _check(partials, lse, num_q, num_kv_heads, group)
    batch, head_tiles, k_splits, _, head_dim = partials.shape
    tiles, rows = head_tiles // num_kv_heads, num_q * group
    # tiles back into rows, then a log-sum-exp merge of the splits (base 2); rows no split saw get zeros
    tile_rows = partials.shape[3]
    out = partials.reshape(batch, num_kv_heads, tiles, k_splits, tile_rows, head_dim).transpose(0, 1, 3, 2, 4, 5)
    out = out.reshape(batch, num_kv_heads, k_splits, tiles * tile_rows, head_dim)[:, :, :, :rows]
    lse = lse.reshape(batch, num_kv_heads, tiles, k_splits, tile_rows).transpose(0, 1, 3, 2, 4)
    lse = lse.reshape(batch, num_kv_heads, k_splits, tiles * tile_rows)[..., :rows]
    top = jnp.max(lse, axis=2, keepdims=True)
    weights = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.maximum(jnp.sum(weights, axis=2), 1e-30).reshape(batch, num_kv_heads, num_q, group)
    weights = weights.reshape(batch, num_kv_heads, k_splits, num_q, group)
    out = out.reshape(batch, num_kv_heads, k_splits, num_q, group, head_dim).astype(jnp.float32)
    out = jnp.einsum("bhsqg,bhsqgd->bqhgd", weights, out, precision=lax.Precision.HIGHEST)
    out = out / total.transpose(0, 2, 1, 3)[..., None]
    return out.astype(dtype).reshape(batch, num_q, num_kv_heads * group, head_dim)


def merge_splits(partials, lse, *, num_q, num_kv_heads, group, dtype, interpret=False):
    """``partials [batch, kv_heads * tiles, splits, tile_rows, head_dim]`` (64-row M tiles of the
    wide-head kernel, or one tile of all the rows of the N-axis one), ``lse [batch, kv_heads * tiles,
    splits, tile_rows]`` (base 2; -inf where a split saw nothing) -> ``[batch, num_q, kv_heads * group,
    head_dim]``. Rows no split saw come out zero."""
    _check(partials, lse, num_q, num_kv_heads, group)
    batch, head_tiles, k_splits, tile_rows, head_dim = partials.shape
    tiles = head_tiles // num_kv_heads
    # Each program loads a [splits, group, columns] block: about 8k elements, one round trip to memory.
    columns = min(head_dim, _floor_pow2(max(16, 8192 // (_next_pow2(k_splits) * group))))
    kernel = functools.partial(_merge_kernel, num_kv_heads=num_kv_heads, tiles=tiles, tile_rows=tile_rows,
                               k_splits=k_splits, group=group, columns=columns, head_dim=head_dim)
    return pdl.pallas_call(
        kernel,
        grid=(batch * num_kv_heads, num_q, head_dim // columns),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=pl.BlockSpec((1, 1, group, columns),
                               lambda bh, query, chunk: (bh // num_kv_heads, query, bh % num_kv_heads, chunk)),
        out_shape=jax.ShapeDtypeStruct((batch, num_q, num_kv_heads * group, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="jspec_wide_head_merge",
    )(lse.reshape(-1), partials.reshape(-1))
