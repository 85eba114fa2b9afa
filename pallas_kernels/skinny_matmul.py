"""Few rows times a big weight matrix (decode / verify projections).

Shapes: x [M, K] (small M), w [K, N] -> [M, N] in x's dtype, fp32 accumulation.
Leading batch dims of x are flattened into M. ``w_transposed=True`` takes w as [N, K] instead
(a tied LM head contracting against the embedding table as stored, never a transposed copy).

The cost of ``x @ w`` for M = 1..64 is reading ``w`` once, so the Pallas kernel is a
weight-streaming GEMV/GEMM (Triton backend):

* grid ``(M tiles, cdiv(N, block_n), split_k)``: each program owns one ``block_n`` column tile
  of ``w`` and one of ``split_k`` contiguous K ranges (split-K when the N tiles alone do not
  fill the GPU's SMs); it loops over its K range in ``block_k`` steps with a
  ``fori_loop`` that Triton software-pipelines ``num_stages`` deep. M tiles (only with
  ``block_m`` set) are the fastest grid axis, so the tiles that read the same weight tile run
  back to back and all but the first read it from L2;
* the rows of ``x`` are padded to ``block_m = max(16, next_pow2(M))`` *inside* the kernel
  (a masked load), the minimum size of a 16-bit tensor-core dot;
* K and N that are not multiples of the block are handled with masked loads and stores
  (never an out-of-bounds ref slice; masks are only emitted where the shape needs them,
  so aligned shapes stream unmasked);
* with ``split_k > 1`` the kernel writes fp32 partial sums ``[split_k, M, N]`` that one
  small XLA fusion adds up and casts.

``skinny_matmul(..., impl="auto")`` uses the kernel only on a GPU and only for the shapes
where ``benchmarks/skinny_matmul*.json`` showed it faster than XLA's dot (16-bit operands;
the swept model shapes per M bucket up to 16 rows, other shapes at M = 1; see
``_auto_uses_pallas``); everywhere else (CPU, prefill) it is the reference.
``impl="pallas"`` takes any M <= 64 (tilings: ``default_config``, swept per M bucket for the
Llama-3.2-1B and Llama-3.1-8B projection shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._dispatch import check_impl, interpret_mode, on_gpu

MAX_M = 64  # the kernel's row limit; larger M (prefill) goes to XLA
INVARIANT_BLOCK_M = 64  # rows per M tile of ``impl="invariant"``: a Hopper warpgroup dot (WGMMA)
_MAX_ACCUMULATOR = 64 * 256  # fp32 accumulator elements of a program's row tiles (128 registers a thread at 4 warps)
_NUM_SMS = 132  # H100 SXM; the split-K heuristic aims at a few waves of programs
_SMEM_LIMIT = 220 * 1024  # pipelined tile bytes per program (227 KiB max); fewer stages beyond


def skinny_matmul_reference(x, w, *, w_transposed=False):
    # fp32 operands: full fp32 (no TF32). 16-bit operands: default precision, which is
    # already bf16 x bf16 -> fp32; HIGHEST there made XLA's M = 1 dot 3x slower on H100.
    f32 = jnp.dtype(jnp.float32) in (jnp.dtype(x.dtype), jnp.dtype(w.dtype))
    precision = jax.lax.Precision.HIGHEST if f32 else None
    return jnp.einsum("...k,nk->...n" if w_transposed else "...k,kn->...n", x, w, precision=precision,
                      preferred_element_type=jnp.float32).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Tiling of the Pallas kernel (all sizes static). ``block_m``: rows per M tile, a grid axis
    over any number of rows (None: all rows in one tile of 16..64, padded to a power of two).
    ``ordered_splits``: add the split-K partials one after another in split order (each output
    element the same chain of adds whatever the shape) instead of XLA's reduction, whose order
    may follow the shape."""

    block_n: int = 64
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int | None = None
    ordered_splits: bool = False


# Tilings from the sweeps of the Llama-3.2-1B / 3.1-8B projection shapes as the model fuses them
# (qkv, o, gate_up, down, LM head), by M bucket (M <= 2 -> 1, 3..8 -> 5, 9..16 -> 16, 17..64 -> 32):
# ((block_n, block_k, split_k, num_warps, num_stages), whether ``impl="auto"`` takes the kernel
# there). The flag is set where the best tiling beat XLA's dot beyond the noise in the sweep *and*
# again in a separate measurement. The 8B shapes were re-swept by the kernels' GPU time (steady
# where wall time is not). Files and figures: ``benchmarks/README.md``, skinny matmul.
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
}


def _m_bucket(m: int) -> int:
    return 1 if m <= 2 else 5 if m <= 8 else 16 if m <= 16 else 32


def default_config(m: int, k: int, n: int, itemsize: int = 2) -> SkinnyConfig:
    """Tiling for x [m, k] @ w [k, n]: the swept table where it has the shape, else the
    rule that won the sweep at M = 1 on every swept shape: 128 x 128 tiles, split-K up to
    >= 1.5 waves of programs (keeping >= 2 K steps per program), 4 warps, 4 stages."""
    tuned = _TUNED.get((k, n), {}).get(_m_bucket(m)) if itemsize == 2 else None
    return SkinnyConfig(*tuned[0]) if tuned is not None else _rule_config(k, n, itemsize)


def _rule_config(k: int, n: int, itemsize: int) -> SkinnyConfig:
    block_n = min(128, _pow2_at_least(n, 16))
    block_k = min(128 if itemsize <= 2 else 64, _pow2_at_least(k, 16))
    tiles = pl.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < 1.5 * _NUM_SMS and pl.cdiv(k, 2 * split_k) >= 2 * block_k:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4)


# Invariant tilings that beat the one-row tiling in 64-row tiles (H100, GPU time at M = 16 and
# M = 1, ``benchmarks/invariant_matmul_sweep_h100.json``): Llama-3.2-1B's qkv 0.0101 vs 0.0134 ms,
# o 0.0080 vs 0.0084. (block_n, block_k, split_k, num_warps, num_stages) as in ``_TUNED``.
_INVARIANT_TUNED = {
    (2048, 3072): (128, 64, 4, 4, 4),
    (2048, 2048): (64, 128, 4, 4, 4),
}


def invariant_config(k: int, n: int, itemsize: int = 2, *, w_transposed: bool = False) -> SkinnyConfig:
    """A tiling that depends on the weight's shape only, never on the rows: M tiles of
    :data:`INVARIANT_BLOCK_M` rows, split-K partials added in split order. Each row's result is then
    the same sum in the same order whether it is computed alone, among verify rows, in a batch or in
    a prefill (``impl="invariant"``).

    64-row tiles rather than 16: H100, Llama-3.1-8B shapes, the decode step's kernels 6.16 against
    6.47 ms (``auto`` 6.03) and a batch of 16 verifying 4 drafts (80 rows: two tiles, not five)
    11.8 ms, tied with ``auto``'s cuBLAS GEMMs (11.9), where 16-row tiles took 1.8x ``auto``
    (``benchmarks/decode_h100_invariant_*.json``). Within the tiles: the swept invariant tilings, else
    the one-row tiling (:func:`default_config` at M = 1) for w [K, N]; a w [N, K] (a tied LM head read
    as stored) reads rows of K, so it takes the untuned rule's 128 x 128 tiles, not the narrow K steps
    tuned for the [K, N] layout (1B's tied head: 0.18 vs 0.26 ms, XLA's dot 0.18)."""
    if w_transposed:
        config = _rule_config(k, n, itemsize)
    elif itemsize == 2 and (k, n) in _INVARIANT_TUNED:
        config = SkinnyConfig(*_INVARIANT_TUNED[(k, n)])
    else:
        config = default_config(1, k, n, itemsize)
    return dataclasses.replace(config, block_m=INVARIANT_BLOCK_M, ordered_splits=True)


def _pow2_at_least(v: int, lo: int) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(v, 1)))))


def _kernel(x_ref, w_ref, o_ref, *, m, k, n, block_m, m_tiles, block_k, block_n, k_per_split,
            mask_m, mask_k, mask_n, compute_dtype, precision, w_transposed):
    # x_ref: [m_tiles * block_m, k_per_split]   (rows >= m and cols >= k are out of the array)
    # w_ref: [k_per_split, block_n], or [block_n, k_per_split] when w_transposed
    # o_ref: [m_tiles * block_m, block_n]      (squeezed split dim when split_k > 1)
    # Each of the m_tiles row tiles has its own accumulator and dot, the same as one tile alone: a
    # program with several reads each weight tile once for all of them.
    pid_n = pl.program_id(1)
    pid_s = pl.program_id(2)
    num_k_steps = k_per_split // block_k

    first_row = pl.program_id(0) * m_tiles * block_m
    rows_ok = [(first_row + t * block_m + jnp.arange(block_m) < m) if mask_m else None for t in range(m_tiles)]
    col_ok = (pid_n * block_n + jnp.arange(block_n) < n) if mask_n else None

    def body(step, accs):
        kk = pl.multiple_of(step * block_k, block_k)
        k_ok = None
        if mask_k:
            k_ok = pid_s * k_per_split + kk + jnp.arange(block_k) < k
        if w_transposed:
            wb = _load(w_ref.at[:, pl.ds(kk, block_k)], _and2d(col_ok, k_ok))
            contract = (((1,), (1,)), ((), ()))
        else:
            wb = _load(w_ref.at[pl.ds(kk, block_k), :], _and2d(k_ok, col_ok))
            contract = (((1,), (0,)), ((), ()))
        tiles = []
        for t, (acc, row_ok) in enumerate(zip(accs, rows_ok)):
            xb = _load(x_ref.at[pl.ds(t * block_m, block_m), pl.ds(kk, block_k)], _and2d(row_ok, k_ok))
            tiles.append(acc + jax.lax.dot_general(xb.astype(compute_dtype), wb.astype(compute_dtype), contract,
                                                   precision=precision, preferred_element_type=jnp.float32))
        return tuple(tiles)

    accs = jax.lax.fori_loop(0, num_k_steps, body,
                             tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in range(m_tiles)))
    for t, (acc, row_ok) in enumerate(zip(accs, rows_ok)):
        plgpu.store(o_ref.at[pl.ds(t * block_m, block_m), :], acc.astype(o_ref.dtype), mask=_and2d(row_ok, col_ok))


def _and2d(rows, cols):
    if rows is None and cols is None:
        return None
    if rows is None:
        return cols[None, :]
    if cols is None:
        return rows[:, None]
    return rows[:, None] & cols[None, :]


def _load(ref, mask):
    if mask is None:
        return plgpu.load(ref)
    mask = jnp.broadcast_to(mask, ref.shape)
    return plgpu.load(ref, mask=mask, other=0)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "w_transposed"))
def _skinny_matmul_pallas_2d(x, w, *, config: SkinnyConfig, interpret: bool, w_transposed: bool = False):
    m, k = x.shape
    n, k2 = w.shape if w_transposed else w.shape[::-1]
    assert k == k2, (x.shape, w.shape)
    cfg = config
    if m > MAX_M and cfg.block_m is None:
        raise ValueError(f"the skinny-matmul kernel takes at most {MAX_M} rows in one tile, got {m}")
    block_m = cfg.block_m or _pow2_at_least(m, 16)
    block_k, block_n, split_k = cfg.block_k, cfg.block_n, cfg.split_k
    for name, v in (("block_k", block_k), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    itemsize = jnp.dtype(jnp.promote_types(x.dtype, w.dtype)).itemsize
    # Row tiles per program (``impl="invariant"``): every tile of up to _MAX_ACCUMULATOR rows x
    # block_n in one program, so the weight is read once for all of them.
    m_tiles = 1 if cfg.block_m is None else max(1, min(pl.cdiv(m, block_m), _MAX_ACCUMULATOR // (block_m * block_n)))
    rows_per_program = m_tiles * block_m
    num_stages = cfg.num_stages  # Triton allocates num_stages buffers of both tiles
    while num_stages > 1 and (num_stages * (block_k * block_n + rows_per_program * block_k)
                              * itemsize > _SMEM_LIMIT):
        num_stages -= 1
    steps = pl.cdiv(pl.cdiv(k, split_k), block_k)
    k_per_split = steps * block_k
    split_k = pl.cdiv(k, k_per_split)  # drop splits that would be empty
    grid = (pl.cdiv(m, rows_per_program), pl.cdiv(n, block_n), split_k)
    compute_dtype = jnp.promote_types(x.dtype, w.dtype)
    precision = (jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(
        _kernel, m=m, k=k, n=n, block_m=block_m, m_tiles=m_tiles, block_k=block_k, block_n=block_n,
        k_per_split=k_per_split, mask_m=m % rows_per_program != 0,
        mask_k=split_k * k_per_split != k, mask_n=n % block_n != 0,
        compute_dtype=compute_dtype, precision=precision, w_transposed=w_transposed)
    in_specs = [
        pl.BlockSpec((rows_per_program, k_per_split), lambda r, i, s: (r, s)),
        pl.BlockSpec((block_n, k_per_split), lambda r, i, s: (i, s)) if w_transposed
        else pl.BlockSpec((k_per_split, block_n), lambda r, i, s: (s, i)),
    ]
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((rows_per_program, block_n), lambda r, i, s: (r, i))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, rows_per_program, block_n), lambda r, i, s: (s, r, i))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name="skinny_matmul",
    )(x, w)
    if split_k > 1:
        out = (functools.reduce(operator.add, list(out)) if cfg.ordered_splits else out.sum(axis=0)).astype(x.dtype)
    return out


def skinny_matmul_pallas(x, w, *, config: SkinnyConfig | None = None, interpret=None, w_transposed=False):
    """The Pallas kernel for x [..., K] (at most MAX_M rows after flattening, unless the config
    has M tiles), w [K, N] (or [N, K] with ``w_transposed``)."""
    if interpret is None:
        interpret = interpret_mode()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    k, n = w.shape[::-1] if w_transposed else w.shape
    if config is None:
        config = default_config(x2.shape[0], k, n, jnp.dtype(jnp.promote_types(x.dtype, w.dtype)).itemsize)
    out = _skinny_matmul_pallas_2d(x2, w, config=config, interpret=bool(interpret), w_transposed=w_transposed)
    return out.reshape(*lead, n)


def _auto_uses_pallas(m: int, k: int, n: int, x_dtype, w_dtype) -> bool:
    """The ``impl="auto"`` rule on a GPU (``benchmarks/skinny_matmul*.json``, H100 and H200).

    16-bit operands only. Swept shapes (``_TUNED``): the kernel where its best tiling beat XLA's
    dot in that M bucket. Other shapes: one row only (M = 1: decode at batch 1, each draft step),
    where the kernel beat XLA on every mid-size projection measured (XLA's M = 1 dot is weak), but
    not the LM head (N > 32768), where they tie.
    """
    half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if jnp.dtype(x_dtype) != jnp.dtype(w_dtype) or jnp.dtype(x_dtype) not in half or m > MAX_M:
        return False
    tuned = _TUNED.get((k, n), {}).get(_m_bucket(m))
    if tuned is not None:
        return tuned[1]
    return m == 1 and k >= 1024 and 1024 <= n <= 32768


def skinny_matmul(x, w, *, impl="auto", w_transposed=False):
    """Dispatcher: ``x @ w`` for x [..., K], w [K, N] -> [..., N] (w [N, K] with ``w_transposed``).
    ``impl="invariant"``: the kernel with :func:`invariant_config`, for any number of rows."""
    impl = check_impl(impl, "skinny_matmul")
    m = math.prod(x.shape[:-1])
    k, n = w.shape[::-1] if w_transposed else w.shape
    if impl == "invariant":
        itemsize = jnp.dtype(jnp.promote_types(x.dtype, w.dtype)).itemsize
        config = invariant_config(k, n, itemsize, w_transposed=w_transposed)
        return skinny_matmul_pallas(x, w, config=config, w_transposed=w_transposed)
    if impl == "pallas":
        if m > MAX_M:
            raise ValueError(
                f"the skinny-matmul kernel takes at most {MAX_M} rows, got {m}; use impl='auto'")
        return skinny_matmul_pallas(x, w, w_transposed=w_transposed)
    if impl == "auto" and not w_transposed and on_gpu() and _auto_uses_pallas(m, k, n, x.dtype, w.dtype):
        return skinny_matmul_pallas(x, w, interpret=False)
    return skinny_matmul_reference(x, w, w_transposed=w_transposed)
