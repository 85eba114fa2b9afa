"""Tilings of the skinny matmul (:mod:`pallas_kernels.matmul.skinny_matmul`): the swept tables per weight
shape and row bucket, the rule for other shapes, and the row-invariant and gated variants."""

from __future__ import annotations

import dataclasses
import math

from jax.experimental import pallas as pl

GEMV_MAX_M = 4  # rows a gemv tiling takes: an accumulator as large as a weight tile for each
INVARIANT_BLOCK_M = 64  # rows per M tile of ``impl="invariant"``: a Hopper warpgroup dot (WGMMA)
_NUM_SMS = 132  # H100 SXM; the split-K heuristic aims at a few waves of programs


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Tiling of the Pallas kernel (all sizes static). ``block_m``: rows per M tile, a grid axis
    over any number of rows (None: all rows in one tile of 16..64, padded to a power of two).
    ``ordered_splits``: add the split-K partials one after another in split order (each output
    element the same chain of adds whatever the shape) instead of XLA's reduction, whose order
    may follow the shape. ``gemv``: no dot for up to ``GEMV_MAX_M`` rows: each row's products with a
    weight tile accumulate elementwise in fp32 (CUDA cores, the tile never staged for the tensor
    cores), summed over K once at the end."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int | None = None
    ordered_splits: bool = False
    gemv: bool = False


# Tilings from the sweeps of the Llama-3.2-1B / 3.1-8B projection shapes as the model fuses them
# (qkv, o, gate_up, down, LM head), by M bucket (M <= 2 -> 1, 3..8 -> 5, 9..16 -> 16, 17..64 -> 32):
# ((block_n, block_k, split_k, num_warps, num_stages), whether ``impl="auto"`` takes the kernel
# there). The flag is set where the best tiling beat XLA's dot beyond the noise in the sweep *and*
# again in a separate measurement. The 8B shapes' tilings come from a sweep by the kernels' GPU time
# (steady where wall time is not). Figures: ``benchmarks/README.md``, skinny matmul.
_TUNED = {
    (4096, 6144): {1: ((64, 128, 1, 4, 6), True), 5: ((64, 128, 1, 4, 6), False), 16: ((64, 128, 1, 4, 6), False)},
    (4096, 4096): {1: ((32, 128, 1, 4, 6), True), 5: ((32, 128, 1, 4, 6), False), 16: ((32, 128, 1, 4, 6), False)},
    (4096, 28672): {1: ((256, 64, 1, 8, 4), True), 5: ((256, 64, 1, 4, 4), False), 16: ((128, 64, 1, 4, 4), False)},
    (14336, 4096): {1: ((32, 128, 1, 4, 6), True), 5: ((32, 128, 1, 4, 6), False), 16: ((32, 128, 1, 4, 6), False)},
    (2048, 3072): {1: ((64, 128, 8, 8, 4), True), 5: ((128, 32, 16, 4, 4), False), 16: ((128, 128, 4, 4, 4), True)},
    (2048, 2048): {1: ((256, 32, 16, 8, 6), True), 5: ((128, 64, 16, 4, 4), False), 16: ((64, 128, 4, 4, 4), False)},
    (2048, 16384): {1: ((128, 64, 1, 8, 6), True), 5: ((128, 128, 1, 4, 4), False), 16: ((128, 64, 1, 4, 4), False)},
    (8192, 2048): {1: ((128, 64, 8, 4, 6), True), 5: ((128, 32, 16, 4, 4), False), 16: ((128, 128, 8, 4, 4), False)},
    (4096, 128256): {1: ((256, 32, 1, 4, 4), False), 5: ((128, 64, 1, 4, 4), False), 16: ((256, 32, 1, 4, 4), False)},
    (2048, 128256): {1: ((128, 32, 1, 4, 6), True), 5: ((256, 32, 1, 4, 4), False), 16: ((256, 32, 1, 4, 4), False)},
    (4096, 14336): {1: ((128, 64, 1, 4, 6), True), 5: ((128, 64, 1, 4, 6), False), 16: ((128, 64, 1, 4, 6), False),
                    32: ((64, 256, 1, 4, 4), False)},
    # An EAGLE-3 head of Llama-3.1-8B (fc 3H -> H, the midlayer's qkv over 2H, its 32000-word LM head) at M = 1:
    # these tilings stream at about copy bandwidth, ahead of the untuned rule and of XLA's dot.
    (12288, 4096): {1: ((64, 256, 1, 4, 4), True)},
    (8192, 6144): {1: ((64, 128, 1, 4, 6), True)},
    (4096, 32000): {1: ((128, 64, 1, 4, 6), True)},
    # Gemma 4 E4B's per-layer-input gate (2560 -> 256) and projection (256 -> 2560) at M = 1, the sweep's
    # best tilings: ahead of XLA's dot (two kernels for the gate's), and so is E4B's decode loop. The gate's
    # partial sums are added by an XLA fusion between the two, not in the projection's prologue: the work on
    # x between its load and the dot costs more than the launch it saves.
    (2560, 256): {1: ((32, 128, 4, 4, 4), True)},
    (256, 2560): {1: ((32, 128, 1, 4, 4), True)},
}


def _m_bucket(m: int) -> int:
    return 1 if m <= 2 else 5 if m <= 8 else 16 if m <= 16 else 32


# One row over a short K (the projections of models with a hidden size under 1024: SmolLM2-135M's 576,
# Qwen2.5-0.5B's 896): one split of 32-column tiles. Each such matmul is a few microseconds, so the
# split-K sum's own launch costs more than the parallelism it buys (a small model's decode step runs
# faster on these tiles than on the rule's split-K tiles or XLA's dots; figures: benchmarks/README.md,
# skinny matmul).
SHORT_K = 1024
_SHORT_K_ONE_ROW = SkinnyConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=4)


def default_config(m: int, k: int, n: int, itemsize: int = 2) -> SkinnyConfig:
    """Tiling for x [m, k] @ w [k, n]: the swept table where it has the shape; one row over a K
    under 1024 in 16-bit: one split of 32 x 128 tiles; else the rule that won the sweep at M = 1 on
    every swept shape: 128 x 128 tiles, split-K up to >= 1.5 waves of programs (keeping >= 2 K
    steps per program), 4 warps, 4 stages."""
    tuned = _TUNED.get((k, n), {}).get(_m_bucket(m)) if itemsize == 2 else None
    if tuned is not None:
        return SkinnyConfig(*tuned[0])
    if m <= 2 and k < SHORT_K and itemsize == 2:
        return _SHORT_K_ONE_ROW
    return _rule_config(k, n, itemsize)


def _rule_config(k: int, n: int, itemsize: int) -> SkinnyConfig:
    block_n = min(128, _pow2_at_least(n, 16))
    block_k = min(128 if itemsize <= 2 else 64, _pow2_at_least(k, 16))
    tiles = pl.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < 1.5 * _NUM_SMS and pl.cdiv(k, 2 * split_k) >= 2 * block_k:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4)


# Invariant tilings that beat the one-row tiling in 64-row tiles (GPU time at M = 16 and M = 1,
# Llama-3.2-1B's qkv and o; figures: ``benchmarks/README.md``, invariant mode).
# (block_n, block_k, split_k, num_warps, num_stages) as in ``_TUNED``.
_INVARIANT_TUNED = {
    (2048, 3072): (128, 64, 4, 4, 4),
    (2048, 2048): (64, 128, 4, 4, 4),
}


def invariant_config(k: int, n: int, itemsize: int = 2, *, w_transposed: bool = False) -> SkinnyConfig:
    """A tiling that depends on the weight's shape only, never on the rows: M tiles of
    :data:`INVARIANT_BLOCK_M` rows, split-K partials added in split order. Each row's result is then
    the same sum in the same order whether it is computed alone, among verify rows, in a batch or in
    a prefill (``impl="invariant"``).

    64-row tiles rather than 16: the decode step runs faster and close to ``auto``, and a batch of 16
    verifying 4 drafts (80 rows: two tiles, not five) ties with ``auto``'s cuBLAS GEMMs, where 16-row
    tiles are far slower (figures: ``benchmarks/README.md``, invariant mode). Within the tiles: the
    swept invariant tilings, else the one-row tiling (:func:`default_config` at M = 1) for w [K, N];
    a w [N, K] (a tied LM head read as stored) reads rows of K, so it takes the untuned rule's
    128 x 128 tiles, not the narrow K steps tuned for the [K, N] layout (on a tied head the rule's
    tiles keep up with XLA's dot, the narrow ones do not)."""
    if w_transposed:
        config = _rule_config(k, n, itemsize)
    elif itemsize == 2 and (k, n) in _INVARIANT_TUNED:
        config = SkinnyConfig(*_INVARIANT_TUNED[(k, n)])
    else:
        config = default_config(1, k, n, itemsize)
    return dataclasses.replace(config, block_m=INVARIANT_BLOCK_M, ordered_splits=True)


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(v, 1)))))


# Column tiles of a gated product narrower than 64 only while it has fewer than this many programs:
# gate/up at M = 1 of SmolLM2-135M (1536 columns a half) runs faster in 16-column tiles (96 programs)
# than in 64-column ones (24), Qwen2.5-0.5B's (4864) faster in 64-column tiles (76) than in 16-column
# ones (304).
_GATED_PROGRAMS = 64


def gated_config(config: SkinnyConfig, n: int) -> SkinnyConfig:
    """A gated product's tiling for w [K, n] = [gate | up] from the plain one's: half as wide a tile of
    each of gate and up (the same weight bytes per program), but up to 64 columns wide where that
    still leaves ``_GATED_PROGRAMS`` programs, narrower until the tiles divide n / 2 (at least 16),
    and no split-K (the activation needs whole sums)."""
    block_n = max(16, config.block_n // 2)
    while block_n < 64 and (n // 2) // (2 * block_n) >= _GATED_PROGRAMS:
        block_n *= 2
    while block_n > 16 and (n // 2) % block_n:
        block_n //= 2
    return dataclasses.replace(config, block_n=block_n, split_k=1)
