"""Default tiling of the flash-decoding kernel (:mod:`pallas_kernels.flash_decoding`): M block,
KV block, splits per sequence, warps and pipeline stages, from the shapes alone (static)."""

from __future__ import annotations

from pallas_kernels.split_kv import _next_pow2

# Programs to aim for when choosing k_splits for multi-row blocks (~2 waves on a 132-SM H100).
_TARGET_PROGRAMS = 264
# Cache rows a one-row decode keeps in flight over the GPU (see _default_config).
_ROWS_IN_FLIGHT = 16384
# Shared memory the default tiling may plan for (of 227 KiB on H100/H200; Triton needs headroom).
# head_dim 512 with 5 query rows x GQA 8 and the head_dim-256 tiling asked for ~256 KiB and failed
# to launch on an H200.
_SMEM_BUDGET = 160 * 1024


def _default_config(batch, num_kv_heads, m_blocks, max_len, head_dim, block_m):
    """Tuning defaults, from the GPU-time sweeps in ``benchmarks/decode_attention_tiling_h100.json``
    (16-row blocks) and ``benchmarks/decode_attention.json`` (larger blocks, H200).

    16-row M blocks (one query row x GQA <= 16: decode and frozen-KV drafting) stream the cache,
    so what counts is how much of it is in flight: ``_ROWS_IN_FLIGHT`` cache rows over the GPU
    (programs x block_k x (stages - 1), ~8 MB at head_dim 128), spread over as few programs as
    that allows, because every extra split adds partials to merge. 3 stages; block_k 32 from 256
    (sequence, KV head) pairs up (one split each), 64 from 64 pairs up (batch 8: two splits; batch
    16: one), 32 below (batch 1: 32 splits of 32-row blocks).
    Larger M blocks: about ``_TARGET_PROGRAMS`` programs, rounded down (each does more math),
    block_k 64, 3 stages.
    Both: at least 4 KV blocks per split at full length, at most 64 splits; block_k 32 for
    head_dim 256 and 16 above, and fewer stages where shared memory runs short.
    """
    base = batch * num_kv_heads * m_blocks
    num_stages = 3
    if block_m <= 16:
        block_k = 64 if 64 <= base < 256 else 32
        k_splits = _next_pow2(-(-_ROWS_IN_FLIGHT // (base * block_k * (num_stages - 1))))
    else:
        block_k = 64
        k_splits = 1 << max(0, (_TARGET_PROGRAMS // base).bit_length() - 1)
    if head_dim > 128:
        block_k = min(block_k, 32 if head_dim <= 256 else 16)
    block_k = max(16, min(block_k, _next_pow2(max_len)))
    n_blocks = -(-max_len // block_k)
    k_splits = max(1, min(k_splits, 64, _next_pow2(max(1, n_blocks // 4))))
    num_warps = 8 if block_m * head_dim >= 64 * 256 else 4
    while num_stages > 1 and _smem_bytes(block_m, block_k, head_dim, num_stages) > _SMEM_BUDGET:
        num_stages -= 1
    return dict(block_k=block_k, k_splits=k_splits, num_warps=num_warps, num_stages=num_stages)


def default_config(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim):
    """The tiling ``decode_attention_pallas`` uses for these shapes: ``_default_config`` plus
    ``block_m`` (query rows x GQA group, padded to a power of two in 16..64)."""
    rows_m = num_q * (num_q_heads // num_kv_heads)
    block_m = max(16, min(_next_pow2(rows_m), 64))
    d_pad = max(16, _next_pow2(head_dim))
    return dict(_default_config(batch, num_kv_heads, -(-rows_m // block_m), max_len, d_pad, block_m), block_m=block_m)


def _smem_bytes(block_m, block_k, head_dim, num_stages, itemsize=2):
    """Shared memory a program needs, roughly: pipelined K and V tiles, q, the probabilities."""
    return num_stages * 2 * block_k * head_dim * itemsize + block_m * head_dim * itemsize + block_m * block_k * 4
