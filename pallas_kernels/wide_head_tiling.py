"""Default tiling of the wide-head kernel (:mod:`pallas_kernels.wide_head_decode`): block size,
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
    keep more bytes in flight. H100, GPU time of a call, 32-row blocks against 64-row ones
    (``benchmarks/draft_attention_gemma4_block_kv_h100.json``, batch 1 / 8, contexts 4k / 32k):
    Gemma 4 31B full layers, 40 rows (5 query rows) 0.92-0.95 from 268 MB read, 72 rows (9) 0.71-0.91;
    E4B, 36 rows 0.93-0.97 except batch 1 x 4k (1.08); 20 rows (E4B, 5 query rows) 1.06-1.24 below
    1 GB read (the halved blocks' fixed costs weigh more there), 0.99 at 1 GB."""
    return 32 if num_q * (num_q_heads // num_kv_heads) > ROWS // 2 else 64


def default_slots(block_kv, most) -> int:
    """Chunks in the K/V ring: all that fit at 64-row blocks (5), eight (two blocks) at 32 rows,
    which measured 1-8% faster than the ten that fit."""
    return most if block_kv >= 64 else min(most, 8)


def default_share_scores(block_kv, consumers) -> bool:
    """Whether the consumers split the scores ``q @ k.T`` by head_dim columns and add their partial
    scores through shared memory, instead of each computing them over the whole head_dim.

    Sharing halves the scores' tensor-core work at head_dim 512 for a round trip of ``64 x block_kv``
    fp32 per block: a full M tile is bound by that work (H100, 31B full layers, 9 query rows: 125 vs
    130 us at 268 MB read, 807 vs 872 us at 2 GB, 3285 vs 3416 at batch 32 x 32k, but 14.8 vs 14.2 ms
    at batch 32 x 128k; ties at 5 rows; ``benchmarks/draft_attention_gemma4_share_scores_h100.json``,
    ``draft_attention_gemma4_old_vs_new_h100.json``). Its double-buffered exchange fits beside the
    ring at 32-row blocks only."""
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
