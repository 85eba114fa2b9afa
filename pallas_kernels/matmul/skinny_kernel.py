"""The one weight-streaming Pallas (Triton) kernel behind the skinny matmuls, bf16 and quantized.

``x [M, K] @ w [K, N]`` for few rows (w ``[N, K]`` with ``w_transposed``): grid ``(M tiles,
cdiv(N, block_n), split_k)``, each program one ``block_n`` column tile of w and one of ``split_k``
contiguous K ranges, looping over its range in ``block_k`` steps (``fori_loop``, software-pipelined
``num_stages`` deep by Triton), fp32 accumulators, masked loads and stores where the shape is
ragged, split-K partials ``[split_k, M, N]`` in fp32, an optional gated epilogue (see
``pallas_kernels.matmul.skinny_matmul`` for the design and its measurements).

What differs between a bf16 weight and a quantized one is only how a K step's weight tile gets
into registers, so that is a static *weight loader* (:class:`Plain` here, ``QuantizedLoader`` in
``quantized_kernel``): it names the arrays the weight is stored in and their block specs, and turns
one K step into *slabs*, each a weight tile in the compute dtype and the slice of x it multiplies.
A quantized loader widens the packed bytes in registers (int4: the low and high nibbles are the
even and odd K rows, two slabs that multiply the even and odd columns of x).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.matmul.skinny_tilings import GEMV_MAX_M, SkinnyConfig, _pow2_at_least

MAX_M = 64  # the bf16 kernel's row limit; larger M (prefill) goes to XLA
_MAX_ACCUMULATOR = 64 * 256  # fp32 accumulator elements of a program's row tiles (128 registers a thread at 4 warps)
_SMEM_LIMIT = 220 * 1024  # pipelined tile bytes per program (227 KiB max); fewer stages beyond

# Activations of the gate: the kernel's epilogue (in fp32) and the reference. SiLU for Llama / Qwen, the tanh
# GELU (HF ``gelu_pytorch_tanh``) for Gemma 4.
GATES = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class Slab(NamedTuple):
    """One dot of a K step: ``x[:, start : start + size]`` (with ``parity``: the ``parity`` entry of
    the pairs ``x [M, K / 2, 2]`` at pair indices ``start..``) times ``tile`` ([size, block_n], or
    [block_n, size] when w_transposed), in the compute dtype."""

    start: Any
    size: int
    parity: int | None
    tile: jax.Array


@dataclasses.dataclass(frozen=True)
class Step:
    """Where a program is in K (traced offsets) and what its loads must mask."""

    kk: Any  # the step's first K index within the split (a multiple of block_k)
    k_base: Any  # the split's first K index
    k: int  # K
    mask_k: bool  # K is ragged against the splits' blocks
    col_ok: Any  # [block_n] bool, or None where N is whole tiles
    w_transposed: bool
    compute_dtype: Any

    def k_ok(self, start, size: int, stride: int = 1):
        """[size] bool: which of the K indices ``start + stride * i`` (within the split) exist; None
        where K needs no mask."""
        if not self.mask_k:
            return None
        return self.k_base + start + stride * jnp.arange(size) < self.k

    def tile_mask(self, k_ok):
        """The mask of a weight tile whose K rows are ``k_ok``, in its stored orientation."""
        return and2d(self.col_ok, k_ok) if self.w_transposed else and2d(k_ok, self.col_ok)


class WeightLoader(Protocol):
    """How the kernel reads one weight (static, hashable)."""

    num_refs: int  # arrays the weight is stored in
    pairs: bool  # x is read as pairs [M, K / 2, 2] (the weight's K rows come as even / odd slabs)
    bytes_per_entry: float  # HBM bytes a weight entry streams (sizes the software pipeline)
    widened: bool  # the tile is computed in registers: a dot stages it in shared memory once more

    def specs(self, arrays, k_per_split: int, block_n: int, col_tiles: int, w_transposed: bool) -> list:
        """BlockSpecs of ``arrays`` for grid ``(r, i, s)``; ``col_tiles`` offsets the column tile
        (the up half of a gated weight)."""

    def slabs(self, refs, step: Step, block_k: int) -> list[Slab]:
        """The slabs of one K step at ``step.kk``."""

    def slab_size(self, block_k: int) -> int:
        """The K extent of every slab of a step."""


@dataclasses.dataclass(frozen=True)
class Plain:
    """An array weight (bf16 / fp16 / fp32): one slab a step, the tile as loaded."""

    itemsize: int
    num_refs = 1
    pairs = False
    widened = False

    @property
    def bytes_per_entry(self) -> float:
        return self.itemsize

    def specs(self, arrays, k_per_split, block_n, col_tiles, w_transposed):
        if w_transposed:
            return [pl.BlockSpec((block_n, k_per_split), lambda r, i, s: (i + col_tiles, s))]
        return [pl.BlockSpec((k_per_split, block_n), lambda r, i, s: (s, i + col_tiles))]

    def slab_size(self, block_k):
        return block_k

    def slabs(self, refs, step, block_k):
        (w_ref,) = refs
        rows = pl.ds(step.kk, block_k)
        mask = step.tile_mask(step.k_ok(step.kk, block_k))
        tile = load(w_ref.at[:, rows] if step.w_transposed else w_ref.at[rows, :], mask)
        return [Slab(step.kk, block_k, None, tile.astype(step.compute_dtype))]


def _kernel(*refs, loader: WeightLoader, num_w, m, k, n, block_m, m_tiles, block_k, block_n, k_per_split, mask_m,
            mask_k, mask_n, compute_dtype, precision, w_transposed, gated, gemv):
    # refs: x, the weight's arrays (twice, gate then up, when ``gated``), out.
    # x_ref: [m_tiles * block_m, k_per_split] ([.., k_per_split / 2, 2] as pairs)
    # weight: the loader's blocks of one column tile and one split
    # o_ref: [m_tiles * block_m, block_n]      (squeezed split dim when split_k > 1)
    # Each of the m_tiles row tiles has its own accumulator and dot, the same as one tile alone: a
    # program with several reads each weight tile once for all of them.
    x_ref, o_ref = refs[0], refs[-1]
    w_refs = [refs[1 + c * loader.num_refs:1 + (c + 1) * loader.num_refs] for c in range(num_w)]
    pid_n = pl.program_id(1)
    pid_s = pl.program_id(2)
    num_k_steps = k_per_split // block_k

    first_row = pl.program_id(0) * m_tiles * block_m
    rows_ok = [(first_row + t * block_m + jnp.arange(block_m) < m) if mask_m else None for t in range(m_tiles)]
    col_ok = (pid_n * block_n + jnp.arange(block_n) < n) if mask_n else None
    contract = (((1,), (1,)), ((), ())) if w_transposed else (((1,), (0,)), ((), ()))

    def x_block(t, slab, step):
        rows = pl.ds(t * block_m, block_m)
        if slab.parity is None:
            ref, k_ok = x_ref.at[rows, pl.ds(slab.start, slab.size)], step.k_ok(slab.start, slab.size)
        else:  # pair p holds K indices 2p, 2p + 1 (K is even: both exist or neither)
            ref = x_ref.at[rows, pl.ds(slab.start, slab.size), jnp.int32(slab.parity)]
            k_ok = step.k_ok(2 * slab.start, slab.size, 2)
        return load(ref, and2d(rows_ok[t], k_ok))

    if gemv:
        return _gemv(x_ref, w_refs, o_ref, loader=loader, m=m, k=k, n=n, block_k=block_k, block_n=block_n,
                     k_per_split=k_per_split, mask_k=mask_k, col_ok=col_ok, compute_dtype=compute_dtype,
                     w_transposed=w_transposed, gated=gated)

    def body(i, accs):
        kk = pl.multiple_of(i * block_k, block_k)
        step = Step(kk, pid_s * k_per_split, k, mask_k, col_ok, w_transposed, compute_dtype)
        slabs = [loader.slabs(w, step, block_k) for w in w_refs]  # num_w aligned lists
        accs = [list(a) for a in accs]
        for j, slab in enumerate(slabs[0]):
            for t in range(m_tiles):
                xb = x_block(t, slab, step).astype(compute_dtype)
                accs[t] = [acc + jax.lax.dot_general(xb, w_slabs[j].tile, contract, precision=precision,
                                                     preferred_element_type=jnp.float32)
                           for acc, w_slabs in zip(accs[t], slabs)]
        return tuple(tuple(a) for a in accs)

    zeros = tuple(tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in range(num_w)) for _ in range(m_tiles))
    accs = jax.lax.fori_loop(0, num_k_steps, body, zeros)
    for t, acc in enumerate(accs):
        if gated:  # act(gate) * up from the outputs rounded as the unfused matmul would round them
            gate, up = (a.astype(o_ref.dtype).astype(jnp.float32) for a in acc)
            out = GATES[gated](gate) * up
        else:
            out = acc[0]
        plgpu.store(o_ref.at[pl.ds(t * block_m, block_m), :], out.astype(o_ref.dtype), mask=and2d(rows_ok[t], col_ok))


def _gemv(x_ref, w_refs, o_ref, *, loader, m, k, n, block_k, block_n, k_per_split, mask_k, col_ok, compute_dtype,
          w_transposed, gated):
    # The program's m rows (x_ref: [m, k_per_split], or pairs) one by one; for each row and weight an
    # fp32 accumulator shaped like a slab's tile gathers x * w elementwise (no dot: for a row or two,
    # staging the dequantized tile for the tensor cores costs more than the multiply-adds), reduced
    # over K after the loop.
    pid_s = pl.program_id(2)
    size = loader.slab_size(block_k)
    k_axis = 1 if w_transposed else 0
    shape = (block_n, size) if w_transposed else (size, block_n)

    def body(i, accs):
        kk = pl.multiple_of(i * block_k, block_k)
        step = Step(kk, pid_s * k_per_split, k, mask_k, col_ok, w_transposed, compute_dtype)
        slabs = [loader.slabs(w, step, block_k) for w in w_refs]
        accs = [list(a) for a in accs]
        for j, slab in enumerate(slabs[0]):
            for r in range(m):
                row = jnp.int32(r)  # an index of the row, not a Python int (jax 0.12 indexers)
                if slab.parity is None:
                    ref, k_ok = x_ref.at[row, pl.ds(slab.start, slab.size)], step.k_ok(slab.start, slab.size)
                else:
                    ref = x_ref.at[row, pl.ds(slab.start, slab.size), jnp.int32(slab.parity)]
                    k_ok = step.k_ok(2 * slab.start, slab.size, 2)
                xr = load(ref, k_ok).astype(compute_dtype).astype(jnp.float32)
                xr = xr[None, :] if w_transposed else xr[:, None]
                accs[r] = [acc + xr * w_slabs[j].tile.astype(jnp.float32) for acc, w_slabs in zip(accs[r], slabs)]
        return tuple(tuple(a) for a in accs)

    zeros = tuple(tuple(jnp.zeros(shape, jnp.float32) for _ in w_refs) for _ in range(m))
    accs = jax.lax.fori_loop(0, k_per_split // block_k, body, zeros)
    for r, acc in enumerate(accs):
        sums = [a.sum(axis=k_axis) for a in acc]  # [block_n] each
        if gated:
            gate, up = (a.astype(o_ref.dtype).astype(jnp.float32) for a in sums)
            out = GATES[gated](gate) * up
        else:
            out = sums[0]
        plgpu.store(o_ref.at[jnp.int32(r), :], out.astype(o_ref.dtype), mask=col_ok)


def and2d(rows, cols):
    if rows is None and cols is None:
        return None
    if rows is None:
        return cols[None, :]
    if cols is None:
        return rows[:, None]
    return rows[:, None] & cols[None, :]


def load(ref, mask):
    if mask is None:
        return plgpu.load(ref)
    mask = jnp.broadcast_to(mask, ref.shape)
    return plgpu.load(ref, mask=mask, other=0)


@functools.partial(jax.jit, static_argnames=("loader", "k", "n", "w_dtype", "config", "interpret", "w_transposed",
                                             "gated", "split_parts", "max_m", "name"))
def skinny_call(x, arrays, *, loader: WeightLoader, k: int, n: int, w_dtype, config: SkinnyConfig, interpret: bool,
                w_transposed: bool = False, gated: str | None = None, split_parts: bool = False, max_m: int = MAX_M,
                name: str = "skinny_matmul"):
    """``x [M, K] @ w -> [M, N]`` (``[M, N / 2]`` gated; split-K partials ``[splits, M, N]`` with
    ``split_parts``) for the weight stored in ``arrays`` as ``loader`` reads it; ``w_dtype`` the dtype
    its entries have (that of a plain weight, the scales' of a quantized one)."""
    m, k_x = x.shape
    if k_x != k:
        raise ValueError(f"x has K = {k_x}, the weight K = {k}")
    cfg = config
    if m > max_m and cfg.block_m is None:
        raise ValueError(f"the skinny-matmul kernel takes at most {max_m} rows in one tile, got {m}")
    if gated is not None:  # the gate's and up's column tiles side by side, one output tile: no split-K partials
        if w_transposed or n % 2 or (n // 2) % cfg.block_n or cfg.split_k != 1:
            raise ValueError(f"a gated product needs w [K, N] with N / 2 a multiple of block_n and no split-K, got "
                             f"N = {n}, {cfg}, w_transposed={w_transposed}")
        n //= 2
    if cfg.gemv and (m > GEMV_MAX_M or cfg.block_m is not None):
        raise ValueError(f"a gemv tiling takes at most {GEMV_MAX_M} rows in one tile, got {m} ({cfg})")
    block_m = m if cfg.gemv else cfg.block_m or _pow2_at_least(m, 16)
    block_k, block_n, split_k = cfg.block_k, cfg.block_n, cfg.split_k
    for name, v in (("block_k", block_k), ("block_n", block_n)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    compute_dtype = jnp.promote_types(x.dtype, w_dtype)
    num_w = 2 if gated else 1
    # Row tiles per program (``impl="invariant"``): every tile of up to _MAX_ACCUMULATOR rows x
    # block_n in one program, so the weight is read once for all of them.
    m_tiles = 1 if cfg.block_m is None else max(1, min(pl.cdiv(m, block_m),
                                                       _MAX_ACCUMULATOR // (block_m * block_n * num_w)))
    rows_per_program = m_tiles * block_m
    # Triton allocates num_stages buffers of both tiles, and a dot of a tile widened in registers
    # stages it once more in the compute dtype (measured: an int8 256 x 256 tiling asked for 272 KiB).
    staged = 0 if cfg.gemv or not loader.widened else num_w * block_k * block_n * compute_dtype.itemsize
    num_stages = cfg.num_stages
    while num_stages > 1 and (num_stages * (num_w * block_k * block_n * loader.bytes_per_entry
                                            + rows_per_program * block_k * x.dtype.itemsize) + staged > _SMEM_LIMIT):
        num_stages -= 1
    steps = pl.cdiv(pl.cdiv(k, split_k), block_k)
    k_per_split = steps * block_k
    split_k = pl.cdiv(k, k_per_split)  # drop splits that would be empty
    grid = (pl.cdiv(m, rows_per_program), pl.cdiv(n, block_n), split_k)
    precision = (jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    kernel = functools.partial(
        _kernel, loader=loader, num_w=num_w, m=m, k=k, n=n, block_m=block_m, m_tiles=m_tiles, block_k=block_k,
        block_n=block_n, k_per_split=k_per_split, mask_m=m % rows_per_program != 0, mask_k=split_k * k_per_split != k,
        mask_n=n % block_n != 0, compute_dtype=compute_dtype, precision=precision, w_transposed=w_transposed,
        gated=gated, gemv=cfg.gemv)
    if loader.pairs:  # [M, K / 2, 2]: a free reshape; the kernel reads the even and odd columns apart
        x_in = x.reshape(m, k // 2, 2)
        x_spec = pl.BlockSpec((rows_per_program, k_per_split // 2, 2), lambda r, i, s: (r, s, 0))
    else:
        x_in = x
        x_spec = pl.BlockSpec((rows_per_program, k_per_split), lambda r, i, s: (r, s))
    w_specs = [spec for c in range(num_w)
               for spec in loader.specs(arrays, k_per_split, block_n, c * (n // block_n), w_transposed)]
    if split_k == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((rows_per_program, block_n), lambda r, i, s: (r, i))
    else:
        out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, rows_per_program, block_n), lambda r, i, s: (s, r, i))
    out = pdl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[x_spec, *w_specs],
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(x_in, *list(arrays) * num_w)
    if split_parts:
        return out if split_k > 1 else out[None]
    if split_k > 1:
        out = (functools.reduce(operator.add, list(out)) if cfg.ordered_splits else out.sum(axis=0)).astype(x.dtype)
    return out
