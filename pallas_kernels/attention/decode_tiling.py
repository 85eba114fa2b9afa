"""Default tiling of the flash-decoding kernel (:mod:`pallas_kernels.attention.flash_decoding`): M block,
KV block, splits per sequence, warps and pipeline stages, from the shapes alone (static)."""

from __future__ import annotations

from pallas_kernels.attention.split_kv import _next_pow2

# Programs to aim for when choosing k_splits for multi-row blocks (~2 waves on a 132-SM H100).
_TARGET_PROGRAMS = 264
# Cache rows a one-row decode keeps in flight over the GPU (see _default_config).
_ROWS_IN_FLIGHT = 16384
# Shared memory the default tiling may plan for (of 227 KiB on H100/H200; Triton needs headroom).
# head_dim 512 with 5 query rows x GQA 8 under the head_dim-256 tiling would ask for ~256 KiB, which
# does not launch.
_SMEM_BUDGET = 168 * 1024
# From this head_dim up, M blocks hold 16 rows whatever the query rows x GQA group: a 16-row block
# already keeps ~200 registers per thread (q as a dot operand is 16 x head_dim per warp, plus a
# 16 x head_dim fp32 accumulator), and larger ones spill. More rows become more M blocks, which
# read the same K/V blocks side by side, mostly from L2.
_WIDE_HEAD_DIM = 256
# Programs in one wave on a 132-SM H100: a one-row decode whose whole cache fits in that many
# 64-row blocks reads one block per program (small models' short caches are bound by latency).
_ONE_WAVE_PROGRAMS = 132
_ONE_WAVE_BLOCK_K = 64


def _default_config(batch, num_kv_heads, m_blocks, rows, head_dim, block_m, *, windowed=False):
    """Tuning defaults, from GPU-time sweeps of the tilings (16-row blocks, larger blocks, head_dim
    256 / 512; figures: ``benchmarks/README.md``, decode attention and draft attention at Gemma 4
    shapes).

    ``rows``: the cache rows a sequence's queries can see at most (``max_len``, or a window's:
    ``windowed``).
    16-row M blocks (one query row x GQA <= 16: decode and frozen-KV drafting; any number of rows
    at head_dim >= 256) stream the cache, so what counts is how much of it is in flight:
    ``_ROWS_IN_FLIGHT`` cache rows over the GPU (programs x block_k x (stages - 1), ~8 MB at
    head_dim 128), spread over as few programs as that allows, because every extra split adds
    partials to merge. 3 stages; block_k 32 from 256 (sequence, KV head, M block) triples up (one
    split each), 64 from 64 up (batch 8: two splits; batch 16: one), 32 below (batch 1: 32 splits
    of 32-row blocks).
    Larger M blocks: about ``_TARGET_PROGRAMS`` programs, rounded down (each does more math),
    block_k 64, 3 stages.
    Short caches whose blocks fit one wave: one 64-row block per program (:func:`_one_wave`).
    Both: at least 4 KV blocks per split at full length (1 under a window: windowed calls are
    short, and small batches of them ran fastest with 1-2 blocks per split), at most 64 splits;
    head_dim 256: block_k 32; head_dim 512: 16-row blocks block_k 32 with 2 stages (faster than
    16 x 3 with several M blocks, the same with one), a 64-row block 16 x 3 (faster than the 2-stage
    or block_k-32 tilings); fewer stages where shared memory runs short.
    """
    base = batch * num_kv_heads * m_blocks
    num_stages = 3
    one_block_each = _one_wave(base, rows, block_m, head_dim)
    if one_block_each:
        block_k, k_splits = _ONE_WAVE_BLOCK_K, 64
    elif block_m <= 16:
        block_k = 64 if 64 <= base < 256 else 32
        k_splits = _next_pow2(-(-_ROWS_IN_FLIGHT // (base * block_k * (num_stages - 1))))
    else:
        block_k = 64
        k_splits = 1 << max(0, (_TARGET_PROGRAMS // base).bit_length() - 1)
    if head_dim > 128:
        block_k = min(block_k, 32)
    if head_dim > 256:  # 16-row blocks: 32 x 2 stages; one 64-row block: 16 x 3 (q takes 64 KiB of smem)
        block_k, num_stages = (32, 2) if block_m <= 16 else (16, 3)
    block_k = max(16, min(block_k, _next_pow2(rows)))
    n_blocks = -(-rows // block_k)
    min_blocks = 1 if windowed or one_block_each else 4
    k_splits = max(1, min(k_splits, 64, _next_pow2(max(1, n_blocks // min_blocks))))
    num_warps = 8 if block_m * head_dim >= 64 * 256 else 4
    while num_stages > 1 and _smem_bytes(block_m, block_k, head_dim, num_stages) > _SMEM_BUDGET:
        num_stages -= 1
    return dict(block_k=block_k, k_splits=k_splits, num_warps=num_warps, num_stages=num_stages)


def _one_wave(base, rows, block_m, head_dim):
    """Whether a short cache is read one ``_ONE_WAVE_BLOCK_K``-row block per program: 16-row M
    blocks at head_dim <= 128 whose (sequence, KV head, M block) triples x blocks fit one wave.
    There the call is bound by latency, not bandwidth: the programs' serial chains and the
    launches, so the most parallel tiling wins (over fewer, longer splits at SmolLM2, Llama-3.2-1B
    and Llama-3.1-8B heads; figures: ``benchmarks/README.md``, decode attention)."""
    return (block_m <= 16 and head_dim <= 128
            and base * -(-rows // _ONE_WAVE_BLOCK_K) <= _ONE_WAVE_PROGRAMS)


def tiling(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, *, window=None, **given):
    """The tiling ``decode_attention_pallas`` uses for these shapes (static): ``block_m`` (see
    :func:`_block_m`), ``block_k``, ``k_splits``, ``merge_in_kernel`` (see
    :func:`_merge_in_kernel`), ``num_warps``, ``num_stages``. With a ``window`` the splits are sized for the rows
    the window lets the queries see, not for ``max_len``. Knobs in ``given`` are kept and the
    others chosen around them."""
    rows_m = num_q * (num_q_heads // num_kv_heads)
    d_pad = max(16, _next_pow2(head_dim))
    block_m = given.get("block_m") or _block_m(rows_m, d_pad)
    rows = max_len if window is None else min(max_len, window + num_q - 1)
    cfg = _default_config(batch, num_kv_heads, -(-rows_m // block_m), rows, d_pad, block_m, windowed=rows < max_len)
    cfg = {**cfg, "block_m": block_m, **given}
    if given.get("merge_in_kernel") is None:
        cfg["merge_in_kernel"] = _merge_in_kernel(cfg["k_splits"])
    return cfg


def _merge_in_kernel(k_splits):
    """Few partials per sequence: the last program to arrive merges them (no second launch, only a
    zeroed counter per group). Many (batch 1..4): a combine kernel merges them in parallel, where
    the last program alone would read them all (slower at batch 1, and at 8-16 splits of small
    models' short caches the decode loop is slower with the merge in the kernel, though with fewer
    launches; figures: ``benchmarks/README.md``, decode attention)."""
    return k_splits <= 2


def _block_m(rows_m, head_dim):
    """Rows of an M block: query rows x GQA group, as a power of two in 16..64. At head_dim 256
    always 16 (several 16-row blocks beat one large one); at head_dim 512 one 64-row block for 33..64
    rows (31B's 5 query rows, E4B's 9: faster than three 16-row blocks reading the same K/V from
    L2), else 16 (two 16-row blocks still stream close to copy bandwidth)."""
    if head_dim > _WIDE_HEAD_DIM:
        return 64 if 32 < rows_m <= 64 else 16
    return 16 if head_dim == _WIDE_HEAD_DIM else max(16, min(_next_pow2(rows_m), 64))


def _smem_bytes(block_m, block_k, head_dim, num_stages, itemsize=2):
    """Shared memory a program needs, roughly: pipelined K and V tiles, q, the probabilities."""
    return num_stages * 2 * block_k * head_dim * itemsize + block_m * head_dim * itemsize + block_m * block_k * 4
