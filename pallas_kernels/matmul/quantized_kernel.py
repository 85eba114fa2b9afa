"""The skinny-matmul kernel on quantized weights: the packed bytes stream from HBM and are widened in
registers (:class:`QuantizedLoader`, the weight loader of :mod:`pallas_kernels.matmul.skinny_kernel`).

Per K step each program loads, for its column tile, the step's packed rows (int8 / fp8: ``[bk, bn]``
bytes; int4: ``[bk / 2, bn]`` bytes, two codes a byte) and one row of scales (and mins) per group the
step covers. The step is dequantized in *substeps* that each lie inside one group (``gcd(block_k,
group)`` entries, every entry of a step when the scale is per channel), so a substep multiplies its
codes by one broadcast row of scales, never a per-row gather or a reshape:

* codes to fp32 exactly without the int-to-float conversion unit (a quarter of the FMA rate on
  Hopper, slower than int4 streams): an int4 code ``c`` or'ed into the mantissa of 2^23 is the float
  ``2^23 + c``; an int8 code ``q`` added to the bits of 1.5 * 2^23 is ``1.5 * 2^23 + q``; one
  subtraction then gives ``c`` (``c - 8`` symmetric) or ``q``. fp8 e4m3 converts in hardware;
* ``w = q * scale (+ min)`` in fp32, rounded once to the scales' dtype: exactly
  :func:`pallas_kernels.matmul.quantized_matmul.dequantize`, so the kernel differs from the reference
  only by the order of the fp32 sums;
* int4: the low nibbles are the even K rows and the high nibbles the odd ones, so a substep is two
  slabs, each dotted with the even / odd columns of x (x is read as pairs ``[M, K / 2, 2]``, a free
  reshape) instead of interleaving the nibbles in registers.

On a GPU with bf16 scales and activations (``packed``) a substep is widened instead two entries at a
time in packed bf16x2 registers by inline PTX (:mod:`pallas_kernels.matmul.widen`: 2-4 instructions
an entry against about 8, the same weights bit for bit but for one-unit ties of int4 with mins);
the fp32 widening above serves fp32 models and the interpreter. With a ``gemv`` tiling (one row,
8-bit) the dequantized tiles feed fp32 multiply-adds instead of a dot. Tilings:
``quantized_config`` (from sweeps on an H200; ``python -m jspec.bench quant-matmul --sweep`` sweeps
them).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import interpret_mode
from pallas_kernels.matmul.skinny_kernel import Slab, load, and2d, skinny_call
from pallas_kernels.matmul.skinny_tilings import SHORT_K, SkinnyConfig, _pow2_at_least, _NUM_SMS, gated_config
from pallas_kernels.matmul.widen import widen

MAX_M = 80  # rows the quantized kernel takes in one tile (a batch of 16 verifying 4 drafts)
INT8, FP8, INT4_PAIRS = jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)
FORMATS = (INT8, FP8, INT4_PAIRS)
INT4_OFFSET = 8  # a symmetric 4-bit code c holds q = c - 8
_F32_2P23 = 0x4B000000  # bits of 2.0**23: or'ed with c < 2**23 -> 2**23 + c
_F32_1P5_2P23 = 0x4B400000  # bits of 1.5 * 2**23: plus q in -2**22..2**22 -> 1.5 * 2**23 + q
_MIN_SUBSTEP = {"int4": 32, "int8": 16, "fp8": 16}  # a 16-bit dot needs K >= 16 (int4: per nibble half)


@dataclasses.dataclass(frozen=True)
class QuantizedLoader:
    """Reads a quantized weight (static): ``format`` "int8" / "fp8" / "int4", ``group`` the K entries
    a scale covers (None: one scale per output channel), ``mins`` whether groups have a min,
    ``dtype`` the dequantized weight's dtype (the scales')."""

    format: str
    group: int | None
    mins: bool
    dtype: jnp.dtype
    packed: bool = False  # widened two entries at a time by inline PTX (``widen``): bf16 on a GPU

    pairs = property(lambda self: self.format == "int4")
    num_refs = property(lambda self: 3 if self.mins else 2)
    bytes_per_entry = property(lambda self: 0.5 if self.format == "int4" else 1.0)
    widened = True

    def substep(self, block_k: int) -> int:
        """K entries dequantized with one row of scales: the largest power of two dividing both the
        step and the group (the whole step per channel)."""
        return block_k if self.group is None else math.gcd(block_k, self.group)

    def check(self, block_k: int) -> None:
        sub = self.substep(block_k)
        if sub < _MIN_SUBSTEP[self.format]:
            raise ValueError(f"{self.format} groups of {self.group} with block_k {block_k} dequantize {sub} K rows "
                             f"at a time; the kernel needs >= {_MIN_SUBSTEP[self.format]} (a 16-bit dot's K)")

    def specs(self, arrays, k_per_split, block_n, col_tiles, w_transposed):
        values, scales = arrays[:2]
        pack = 2 if self.pairs else 1
        if w_transposed:  # values [N, K'], scales [N, groups]: whole rows of scales per column tile
            value_spec = pl.BlockSpec((block_n, k_per_split // pack), lambda r, i, s: (i + col_tiles, s))
            scale_spec = pl.BlockSpec((block_n, scales.shape[1]), lambda r, i, s: (i + col_tiles, 0))
        else:  # values [K', N], scales [groups, N]
            value_spec = pl.BlockSpec((k_per_split // pack, block_n), lambda r, i, s: (s, i + col_tiles))
            scale_spec = pl.BlockSpec((scales.shape[0], block_n), lambda r, i, s: (0, i + col_tiles))
        return [value_spec, scale_spec] + [scale_spec] * self.mins

    def slab_size(self, block_k):
        return self.substep(block_k) // (2 if self.pairs else 1)

    def slabs(self, refs, step, block_k):
        values_ref, scales_ref = refs[:2]
        mins_ref = refs[2] if self.mins else None
        sub = self.substep(block_k)
        out = []
        for j in range(block_k // sub):
            start = pl.multiple_of(step.kk + j * sub, sub)  # the substep's first K index within the split
            # Its group (global, as scales are not split); substeps are whole groups' parts, so one
            # existing first entry means the group exists.
            group_row = 0 if self.group is None else jax.lax.div(step.k_base + start, self.group)
            group_ok = step.k_ok(start, 1)

            def group_param(ref):  # [1, bn] ([bn, 1] transposed): this group's scales or mins
                if step.w_transposed:
                    return load(ref.at[:, pl.ds(group_row, 1)], and2d(step.col_ok, group_ok))
                return load(ref.at[pl.ds(group_row, 1), :], and2d(group_ok, step.col_ok))

            scale = group_param(scales_ref)
            low = None if mins_ref is None else group_param(mins_ref)
            first, size, codes = self._codes(values_ref, step, start, sub)
            if self.packed:
                tiles = widen(self.format, codes, scale, low)
            elif self.pairs:  # the low nibbles are the even K rows, the high ones the odd rows
                codes = codes.astype(jnp.uint32)
                tiles = [self._dequantize(nibble, scale, low, step.compute_dtype)
                         for nibble in (codes & 0xF, codes >> 4)]
            else:
                tiles = [self._dequantize(codes, scale, low, step.compute_dtype)]
            out += [Slab(first, size, parity, tile) for parity, tile in zip((0, 1) if self.pairs else (None,), tiles)]
        return out

    def _codes(self, values_ref, step, start, sub):
        """``(first, size, codes)``: the stored rows of the substep at K index ``start`` (int4: byte rows,
        one a pair of K rows) and their codes, masked where K is ragged."""
        if self.pairs:
            size = sub // 2
            first = pl.multiple_of(start // 2, size)
            mask = step.tile_mask(step.k_ok(2 * first, size, 2))
        else:
            first, size = start, sub
            mask = step.tile_mask(step.k_ok(start, sub))
        rows = pl.ds(first, size)
        return first, size, load(values_ref.at[:, rows] if step.w_transposed else values_ref.at[rows, :], mask)

    def _dequantize(self, codes, scale, low, compute_dtype):
        """``dequantize``'s value of ``codes`` (int4: one nibble each, uint32) in ``compute_dtype``."""
        if self.format == "int4":
            biased = jax.lax.bitcast_convert_type(codes | _F32_2P23, jnp.float32)
            q = biased - float(2**23 + (0 if self.mins else INT4_OFFSET))
        elif self.format == "int8":
            biased = jax.lax.bitcast_convert_type(codes.astype(jnp.int32) + _F32_1P5_2P23, jnp.float32)
            q = biased - float(3 * 2**22)
        else:  # fp8 e4m3, passed as its bytes (a masked fp8 load does not lower in jax 0.11)
            q = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
        w = q * scale.astype(jnp.float32)
        if low is not None:
            w = w + low.astype(jnp.float32)
        return w.astype(self.dtype).astype(compute_dtype)


def quantized_loader(values, scales, mins=None, *, w_transposed=False) -> tuple[QuantizedLoader, int, int]:
    """The loader of a quantized weight's parts and its ``(K, N)``; ``ValueError`` where the parts
    do not make one weight (layout: ``pallas_kernels.matmul.quantized_matmul``)."""
    fmt = jnp.dtype(values.dtype)
    if fmt not in FORMATS:
        raise ValueError(f"quantized values must be one of {[str(f) for f in FORMATS]}, got {fmt}")
    if values.ndim != 2 or scales.ndim != 2:
        raise ValueError(f"values and scales are matrices, got {values.shape} and {scales.shape}")
    k_axis = 1 if w_transposed else 0
    name = {INT8: "int8", FP8: "fp8", INT4_PAIRS: "int4"}[fmt]
    k = values.shape[k_axis] * (2 if name == "int4" else 1)
    n = values.shape[1 - k_axis]
    groups = scales.shape[k_axis]
    if scales.shape[1 - k_axis] != n or groups < 1 or k % groups:
        raise ValueError(f"scales {scales.shape} do not fit values {values.shape} (w_transposed={w_transposed}): "
                         f"expected {'[N, K / group]' if w_transposed else '[K / group, N]'} with N = {n}, K = {k}")
    if mins is not None and mins.shape != scales.shape:
        raise ValueError(f"mins {mins.shape} must be shaped as scales {scales.shape}")
    group = k // groups
    if name == "int4" and groups > 1 and group % 2:
        raise ValueError(f"int4 groups of {group} split a byte's two codes")
    loader = QuantizedLoader(name, None if groups == 1 else group, mins is not None, jnp.dtype(scales.dtype))
    return loader, k, n


_GEMV_K = 4096  # int4 at one row over a long K: rows from which it streams without the dot


def quantized_config(m: int, k: int, n: int, loader: QuantizedLoader, gated: bool = False,
                     w_transposed: bool = False) -> SkinnyConfig:
    """The tiling for x [m, k] @ a quantized w [k, n] (stored ``[n, k]`` with ``w_transposed``, as
    ``jspec`` stores every quantized weight); ``gated``: the tiling of the fused ``[gate | up]``
    product (``gated_config``). From sweeps on an H200 (``python -m jspec.bench quant-matmul
    --sweep``; figures: benchmarks/README.md, quantized matmul). Stored K last, at Llama-3.1-8B's
    shapes and 1..16 rows, one tiling is within ~5% of each shape's best in every format: the dot,
    64 columns, K steps of 128 bytes a column, 4 warps, 3 stages, split-K to two programs a SM
    (8-bit 1.9-4.1 TB/s, int4 1.0-1.9); int4 over more rows streams faster in 32-column tiles on 2
    warps. Stored K first, Llama-3.1-8B's o, gate|up and down at M = 1: 8-bit at one row without a
    dot (``gemv``, 64-row K steps, 128 columns: 1.5-2.0 TB/s against 1.0-1.4 for the dot, which wins
    again from a few rows); int4 with the dot, 128-row K steps (64 bytes a column) and 256 columns
    (0.8-1.1 TB/s, 2.5x the 256-row steps); split-K until about two programs a SM. A small model's
    projection at M = 1 (K or N under ``SHORT_K``: SmolLM2-135M's, Qwen2.5-0.5B's) is a few
    microseconds, bound by how many programs stream it, not by their bytes. int4 over a short K: no
    dot, 16-column tiles, one split, 512-row steps while N is at most 2048 (Qwen's qkv and o 5.5-5.8
    us against 11 for 32 columns in 256-row steps), 128-row steps over a wide N (its gate | up 10.0
    us against 12.9; the tied LM heads 83 / 24 us against 98 / 26); int4 over a long K: 32 columns,
    128-row steps, split-K, without the dot from 4096 rows (Qwen's down 6.6 us against 9.4) and with
    it below (SmolLM2's down: 8.4 us); 8-bit with the dot, 64-row steps, 32 columns over a short K
    and 64 over a long one (2-3x the wide tiles)."""
    short = min(k, n) < SHORT_K
    if w_transposed and not short:
        block_k = min(128 * (2 if loader.pairs else 1), _pow2_at_least(k, _MIN_SUBSTEP[loader.format]))
        block_n, split_k = min(64, _pow2_at_least(n, 16)), 1
        while pl.cdiv(n, block_n) * split_k < 2 * _NUM_SMS and pl.cdiv(k, 2 * split_k) >= 2 * block_k:
            split_k *= 2
        config = SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3)
        if loader.pairs and (m > 8 or (m > 1 and split_k == 1)):
            # int4 over rows: half as many columns a program on 2 warps (the same splits), 2 stages under
            # split-K. Faster in the sweep: gate|up at 5 and 16 rows; the head, down and qkv at 16 (o
            # not swept). qkv at 5 rows streams faster in the wide tiles, so few rows keep them under split-K.
            config = dataclasses.replace(config, block_n=min(block_n, 32), num_warps=2,
                                         num_stages=3 if split_k == 1 else 2)
        return config
    if m == 1 and short:
        short_k, int4 = k < SHORT_K, loader.format == "int4"
        gemv = int4 and (short_k or k >= _GEMV_K)
        if int4 and short_k:
            block_k, block_n = (512 if n <= 2048 else 128), 16
        else:
            block_k, block_n = (128 if int4 else 64), (32 if int4 or short_k else 64)
    else:
        short_k, gemv = False, loader.format != "int4" and m == 1
        if gemv:
            block_k, block_n = 64, 128
        else:  # 128-row tiles (from 33 rows): narrower
            block_k, block_n = 128, (256 if loader.format == "int4" else 128) if m <= 32 else 64
    block_k = min(block_k, _pow2_at_least(k, _MIN_SUBSTEP[loader.format]))
    block_n = min(block_n, _pow2_at_least(n, 16))
    tiles, split_k = pl.cdiv(n, block_n), 1
    while not short_k and tiles * split_k < 2 * _NUM_SMS and pl.cdiv(k, 2 * split_k) >= 2 * block_k:
        split_k *= 2
    config = SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4, gemv=gemv)
    if not gated:
        return config
    # No split-K under a gate: narrower column tiles (down to 32) until the grid has two programs a SM
    # (unmeasured: to be swept with the gate fused).
    config = gated_config(config, n)
    block_n = config.block_n
    while block_n > 32 and (n // 2) // block_n < 2 * _NUM_SMS and (n // 2) % (block_n // 2) == 0:
        block_n //= 2
    return dataclasses.replace(config, block_n=block_n)


def kernel_takes(m: int, loader: QuantizedLoader, k: int, n: int, *, gated: bool = False,
                 w_transposed: bool = False) -> bool:
    """Whether the kernel takes these rows and this weight with its default tiling (else the dispatcher
    runs the reference): at most :data:`MAX_M` rows, groups of whole 16-bit dots, and for a gated
    product a weight stored ``[K, N]`` whose halves are whole column tiles."""
    config = quantized_config(m, k, n, loader, gated, w_transposed)
    if m > MAX_M or loader.substep(config.block_k) < _MIN_SUBSTEP[loader.format]:
        return False
    return not gated or (not w_transposed and n % 2 == 0 and (n // 2) % config.block_n == 0)


def quantized_matmul_pallas(x, values, scales, mins=None, *, config: SkinnyConfig | None = None, interpret=None,
                            w_transposed=False, gated: str | None = None, packed: bool | None = None):
    """The kernel: ``x [..., K] @ dequantize(values, scales, mins) -> [..., N]`` in x's dtype (at most
    :data:`MAX_M` rows after flattening); ``gated``: w is ``[gate | up]``, the result
    ``act(x @ gate) * (x @ up)`` [..., N / 2] from the kernel's epilogue."""
    return _pallas(x, values, scales, mins, config, interpret, w_transposed, gated, parts=False, packed=packed)


def quantized_matmul_pallas_parts(x, values, scales, mins=None, *, config: SkinnyConfig | None = None,
                                  interpret=None, w_transposed=False):
    """The kernel's split-K partial sums ``[splits, ..., N]`` in fp32 (``[1, ..., N]`` in x's dtype
    without split-K); their sum rounded to x's dtype is the product."""
    return _pallas(x, values, scales, mins, config, interpret, w_transposed, None, parts=True)


def _pallas(x, values, scales, mins, config, interpret, w_transposed, gated, *, parts, packed=None):
    loader, k, n = quantized_loader(values, scales, mins, w_transposed=w_transposed)
    interpret = interpret_mode() if interpret is None else bool(interpret)
    if packed is None:
        packed = not interpret and loader.dtype == jnp.bfloat16 and x.dtype == jnp.bfloat16
    loader = dataclasses.replace(loader, packed=packed)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if config is None:
        config = quantized_config(x2.shape[0], k, n, loader, gated is not None, w_transposed)
    loader.check(config.block_k)
    if loader.format == "fp8":
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)  # free: the same bytes
    arrays = (values, scales) + ((mins,) if loader.mins else ())
    out = skinny_call(x2, arrays, loader=loader, k=k, n=n, w_dtype=loader.dtype, config=config,
                      interpret=interpret, w_transposed=w_transposed,
                      gated=gated, split_parts=parts, max_m=MAX_M, name="quantized_matmul")
    return out.reshape(*out.shape[:-2], *lead, out.shape[-1])
