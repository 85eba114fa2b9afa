"""Default tiling of the wide-head kernel (:mod:`pallas_kernels.attention.wide_head_decode`): block size,
ring depth, score sharing and splits, from the shapes alone (static), and the shapes it runs."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 64  # WGMMA's M tile: query rows x GQA group, padded
COLUMNS = 256  # output columns per consumer warpgroup (WGMMA's largest N)
SMEM_BYTES = 227 * 1024  # shared memory of one Hopper CTA
NUM_SMS = 132  # H100 / H200: the default split count aims at one CTA per SM


def default_block_kv(num_q, num_q_heads, num_kv_heads) -> int:
    """K/V rows per block: 32 once the query rows x GQA group fill more than half an M tile, else 64.

    A chunk of the ring is held until both consumers are done with it; 32-row chunks free sooner and
    keep more bytes in flight. In GPU time of a call, 32-row blocks beat 64-row ones at Gemma 4 31B's
    full layers (40 and 72 rows) and E4B's 36 rows, but lose at 20 rows (E4B, 5 query rows) below
    1 GB read, where the halved blocks' fixed costs weigh more (figures: ``benchmarks/README.md``,
    draft attention at Gemma 4 shapes)."""
    return 32 if num_q * (num_q_heads // num_kv_heads) > ROWS // 2 else 64


def default_slots(block_kv, most) -> int:
    """Chunks in the K/V ring: all that fit at 64-row blocks (5), eight (two blocks) at 32 rows,
    which run faster than the ten that fit."""
    return most if block_kv >= 64 else min(most, 8)


def default_share_scores(block_kv, consumers) -> bool:
    """Whether the consumers split the scores ``q @ k.T`` by head_dim columns and add their partial
    scores through shared memory, instead of each computing them over the whole head_dim.

    Sharing halves the scores' tensor-core work at head_dim 512 for a round trip of ``64 x block_kv``
    fp32 per block: a full M tile is bound by that work (31B full layers, 9 query rows: faster with
    sharing up to batch 32 x 32k, a little slower only at the largest caches; ties at 5 rows; figures:
    ``benchmarks/README.md``, draft attention at Gemma 4 shapes). Its double-buffered exchange fits
    beside the ring at 32-row blocks only."""
    return consumers > 1 and block_kv == 32


def supports(num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, *, block_kv=None) -> bool:
    """Whether these shapes fit the kernel (the dispatcher's test; the kernel raises otherwise)."""
    block_kv = block_kv or default_block_kv(num_q, num_q_heads, num_kv_heads)
    return (head_dim % COLUMNS == 0 and max_len % block_kv == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def m_tiles(num_q, num_q_heads, num_kv_heads) -> int:
    """WGMMA M tiles of query rows x GQA group per KV head."""
    return pl.cdiv(num_q * (num_q_heads // num_kv_heads), ROWS)


def default_splits(batch, num_kv_heads, max_len, block_kv, tiles=1) -> int:
    """About one CTA per SM, at least 4 KV blocks per split."""
    return max(1, min(NUM_SMS // (batch * num_kv_heads * tiles), max_len // block_kv // 4))
