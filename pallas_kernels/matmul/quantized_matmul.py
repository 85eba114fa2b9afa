"""Few rows times a quantized weight matrix: the exact jnp reference and the ``impl=`` dispatcher
between it and the Pallas kernel (:mod:`pallas_kernels.matmul.quantized_kernel`).

A quantized ``[K, N]`` weight arrives as its parts (``jspec.quant.QuantizedWeight`` holds them;
this package imports nothing from jspec), with K on the first axis, or on the last with
``w_transposed`` (``[N, K]``: an embedding table a tied LM head contracts as stored):

* ``values``: the quantized entries; their dtype says the format.
  ``int8`` ``[K, N]``: ``q`` in -127..127 (codes >= 0 with mins).
  ``float8_e4m3fn`` ``[K, N]``: fp8 e4m3 (no infinities, max 448).
  ``uint8`` ``[K / 2, N]``: two 4-bit codes per byte along K, the even ``k`` in the low nibble and
  ``k + 1`` in the high one; a code ``c`` in 0..15 means ``q = c - 8`` without mins, ``q = c`` with.
* ``scales``: ``[K / group, N]`` (per output channel: ``[1, N]``), in the dtype the weight
  dequantizes to; the group size is ``K / scales.shape[k_axis]``.
* ``mins``: None (symmetric: ``w = scale * q``) or like ``scales`` (``w = scale * q + min``).

Each group's entries are widened to fp32, scaled (and offset) in fp32 and rounded once to the
scales' dtype: :func:`dequantize` is the definition of the weight's value, and every kernel behind
:func:`quantized_matmul` must equal :func:`quantized_matmul_reference` (dequantize, then
``skinny_matmul_reference``'s dot) within the tolerance of a reordered fp32 sum.

``impl``: ``"pallas"`` the kernel (interpreted off a GPU) wherever it takes the shape (up to
``quantized_kernel.MAX_M`` rows; groups of at least one 16-bit dot), the reference elsewhere;
``"auto"`` the kernel on a GPU for up to ``MAX_M`` rows but a small model's projection stored K last
(``_auto_uses_kernel``, from ``python -m jspec.bench quant-matmul``), the reference elsewhere; ``"xla"`` the reference;
``"invariant"`` the dequantized weight through the skinny matmul's row-invariant kernel (bitwise
independent of the rows beside each one).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import check_impl, on_gpu
from pallas_kernels.matmul.quantized_kernel import (  # noqa: F401 (the formats: re-exported)
    FORMATS, FP8, INT4_OFFSET, INT4_PAIRS, INT8, MAX_M, kernel_takes, quantized_loader, quantized_matmul_pallas,
    quantized_matmul_pallas_parts,
)
from pallas_kernels.matmul.skinny_matmul import GATES, skinny_matmul, skinny_matmul_reference
from pallas_kernels.matmul.skinny_tilings import SHORT_K


def unpack_int4(pairs: jax.Array, axis: int) -> jax.Array:
    """The 4-bit codes (0..15, uint8) of ``pairs`` (two a byte along ``axis``: the even index in the low
    nibble): ``axis`` twice as long."""
    axis = axis % pairs.ndim
    codes = jnp.stack([pairs & 0xF, pairs >> 4], axis=axis + 1)
    return codes.reshape(*pairs.shape[:axis], 2 * pairs.shape[axis], *pairs.shape[axis + 1:])


def dequantize(values: jax.Array, scales: jax.Array, mins: jax.Array | None = None, *,
               w_transposed: bool = False, dtype=None) -> jax.Array:
    """The weight the parts stand for, in ``dtype`` (default ``scales.dtype``, the weight's own).

    Args:
      values: ``[K', N]`` (``K' = K``, or ``K / 2`` for 4-bit pairs); with ``w_transposed`` K is the
        last axis: ``[N, K']`` or gathered table rows ``[..., K']``.
      scales: ``[K / group, N]`` (``[..., K / group]`` with ``w_transposed``).
      mins: None or shaped as ``scales``.
      dtype: the result's dtype; the fp32 value is rounded to it once.
    Returns:
      ``[K, N]`` (``[..., K]`` with ``w_transposed``).
    """
    fmt = jnp.dtype(values.dtype)
    if fmt not in FORMATS:
        raise ValueError(f"quantized values must be one of {[str(f) for f in FORMATS]}, got {fmt}")
    k_axis = -1 if w_transposed else 0
    if fmt == INT4_PAIRS:
        codes = unpack_int4(values, k_axis).astype(jnp.float32)
        q = codes if mins is not None else codes - INT4_OFFSET
    else:
        q = values.astype(jnp.float32)
    groups = scales.shape[k_axis]
    if q.shape[k_axis] % groups:
        raise ValueError(f"{q.shape[k_axis]} quantized entries along K do not split into {groups} groups")
    group = q.shape[k_axis] // groups

    def per_entry(a):  # one scale (or min) a group -> one an entry
        return jnp.repeat(a.astype(jnp.float32), group, axis=k_axis, total_repeat_length=q.shape[k_axis])

    w = q * per_entry(scales)
    if mins is not None:
        w = w + per_entry(mins)
    return w.astype(scales.dtype if dtype is None else dtype)


def quantized_matmul_reference(x, values, scales, mins=None, *, w_transposed=False, gated=None):
    """``x [..., K] @ dequantize(values, scales, mins) [K, N] -> [..., N]`` in x's dtype, by
    ``skinny_matmul_reference`` (``gated``: w is ``[gate | up]``, the result ``act(x @ gate) * (x @ up)``)."""
    w = dequantize(values, scales, mins, w_transposed=w_transposed)
    return skinny_matmul_reference(x, w, w_transposed=w_transposed, gated=gated)


def quantized_matmul(x, values, scales, mins=None, *, impl="auto", w_transposed=False, gated=None):
    """Dispatcher: ``x [..., K] @ w -> [..., N]`` for the quantized weight ``w`` (module docstring);
    ``gated`` as for ``skinny_matmul`` (``pallas``: fused into the kernel where the halves are whole
    column tiles; composed beside the kernel's product otherwise, and under ``auto``:
    :data:`AUTO_FUSES_GATE`). Parts that do not make one weight, or an x of another
    K: ``ValueError``."""
    return _dispatch(x, values, scales, mins, impl, w_transposed, gated, parts=False)


def quantized_matmul_parts(x, values, scales, mins=None, *, impl="auto", w_transposed=False):
    """Dispatcher for the product as partial sums ``[splits, ..., N]`` (``skinny_matmul_parts``'
    contract: their sum over the first axis, rounded to x's dtype, is the product): the kernel's
    split-K partials where it runs, else ``[1, ..., N]``, the product itself."""
    return _dispatch(x, values, scales, mins, impl, w_transposed, None, parts=True)


# A small model's projection stored K last (K or N under SHORT_K, at most this many entries) runs
# faster as XLA's dequantize + dot (one fusion) than in the kernel: on an H200 at SmolLM2-135M's and
# Qwen2.5-0.5B's shapes, int4-g32 / int8-g32 at one row, 3.0-7.7 us against 4.3-9.9 (benchmarks/README.md,
# quantized matmul); from Qwen's gate|up (8.7 M entries) and the tied LM heads on, the kernel wins.
_XLA_MAX_ENTRIES = 1 << 23


def _auto_uses_kernel(m: int, k: int, n: int, w_transposed: bool) -> bool:
    """The ``impl="auto"`` rule on a GPU: the kernel for every weight it takes but a small model's
    projection stored K last."""
    return m <= MAX_M and not (w_transposed and min(k, n) < SHORT_K and k * n <= _XLA_MAX_ENTRIES)


# Whether ``auto`` fuses a gate into the kernel. It does not: fused, the gate|up of an int8
# Llama-3.1-8B decode step on the H200 ran at 1.1 TB/s (32-column tiles, no split-K, as a gate needs
# whole sums) and the step took 5.745 ms; unfused, 2.0 TB/s and 4.276 ms
# (benchmarks/quant_decode_h200.json).
AUTO_FUSES_GATE = False


def _dispatch(x, values, scales, mins, impl, w_transposed, gated, *, parts):
    if gated is not None and gated not in GATES:
        raise ValueError(f"gated must be one of {sorted(GATES)}, got {gated!r}")
    loader, k, n = quantized_loader(values, scales, mins, w_transposed=w_transposed)
    if x.shape[-1] != k:
        raise ValueError(f"x [..., {x.shape[-1]}] does not contract with a quantized weight of K = {k}")
    mode = check_impl(impl, "quantized_matmul")
    if mode == "invariant":
        w = dequantize(values, scales, mins, w_transposed=w_transposed)
        out = skinny_matmul(x, w, impl="invariant", w_transposed=w_transposed, gated=gated)
        return out[None] if parts else out
    m = math.prod(x.shape[:-1])
    kernel = mode == "pallas" or (mode == "auto" and on_gpu() and _auto_uses_kernel(m, k, n, w_transposed))
    if kernel and kernel_takes(m, loader, k, n, w_transposed=w_transposed):
        kernel_args = dict(interpret=None if mode == "pallas" else False, w_transposed=w_transposed)
        if parts:
            return quantized_matmul_pallas_parts(x, values, scales, mins, **kernel_args)
        fuse = mode == "pallas" or AUTO_FUSES_GATE
        if gated is None or (fuse and kernel_takes(m, loader, k, n, gated=True, w_transposed=w_transposed)):
            return quantized_matmul_pallas(x, values, scales, mins, gated=gated, **kernel_args)
        gate, up = jnp.split(quantized_matmul_pallas(x, values, scales, mins, **kernel_args), 2, axis=-1)
        return GATES[gated](gate) * up
    out = quantized_matmul_reference(x, values, scales, mins, w_transposed=w_transposed, gated=gated)
    return out[None] if parts else out
