"""The residual add and the next RMSNorm in one pass, straight from a projection's split-K partials.

Shapes:
  x        [..., hidden]           the residual stream (its dtype is the result's)
  parts    [splits, ..., hidden]   the partial sums of the projection to add (``skinny_matmul``'s
                                   split-K partials in fp32, or ``[1, ..., hidden]`` of a finished
                                   product in any dtype)
  weight   [hidden] or None        the RMSNorm's weight (None: no norm after the add)
  out      (x + y in x's dtype, norm(x + y)), where y = sum(parts over splits) rounded to x's
           dtype (what the projection returns)
  norm     None: the Llama RMSNorm (``gather_rows.rms_norm``: the result in the promoted dtype of
           x and weight); ``FP32_SCALE``: Gemma 4's (scaled in fp32, cast to x's dtype last)
  y_weight [hidden], optional      Gemma 4's post-norm of the product: y is first normed with it
                                   (``norm``'s rounding), then added
  scale    [1], optional           a factor on the sum before the norm, in x's dtype (Gemma 4's
                                   ``layer_scalar`` at a layer's end): (x + y) * scale

Between a decoder layer's output projection and its MLP, XLA runs the split sum + residual add +
sum of squares as one reduction fusion and the scaling as another launch; at decode the fusion
reads every split of the row in one block. The Pallas kernel (Triton backend) runs one program per
row: it loads every split of a column chunk in one gather (all in flight together), adds them in
one fixed order, then the residual, then norms the row as :func:`pallas_kernels.norm.gather_rows.rms_norm`
does, in one launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.dispatch import check_impl, interpret_mode, on_gpu
from pallas_kernels.norm.gather_rows import FP32_SCALE, llama_scaled, rms_norm, rms_norm_fp32_scale
from pallas_kernels.attention.split_kv import _next_pow2

# fp32 elements of the partials one gather loads: a whole row of Llama-3.2-1B's 16 x 2048 output
# partials, 64 a thread at 16 warps. At decode one program reads its row alone, so the bytes it has
# in flight set its speed (smaller gathers run that row markedly slower; figures: benchmarks/README.md,
# add + RMSNorm).
_TILE = 32768


def _check(x, parts, weight, y_weight, norm, scale):
    if (parts.ndim != x.ndim + 1 or parts.shape[1:] != x.shape
            or any(w is not None and w.shape != x.shape[-1:] for w in (weight, y_weight))
            or (scale is not None and scale.shape != (1,))):
        raise ValueError(f"add_rms_norm needs parts [splits, *x.shape], weight [hidden] (y_weight too) and scale "
                         f"[1], got x {x.shape}, parts {parts.shape}, weight {None if weight is None else weight.shape}"
                         f", y_weight {None if y_weight is None else y_weight.shape}, "
                         f"scale {None if scale is None else scale.shape}")
    if norm not in (None, FP32_SCALE):
        raise ValueError(f"norm must be None (Llama) or {FP32_SCALE!r} (Gemma 4), got {norm!r}")


def sum_parts(parts, dtype):
    """The product the partials ``[splits, ...]`` stand for, rounded to ``dtype`` (XLA)."""
    return parts.astype(jnp.float32).sum(axis=0).astype(dtype)  # one part: its own bits back


def add_parts(x, parts):
    """``x + y``, y the sum of ``parts [splits, *x.shape]`` rounded to x's dtype (XLA)."""
    return x + sum_parts(parts, x.dtype)


def add_rms_norm_reference(x, parts, weight, eps, *, y_weight=None, norm=None, scale=None):
    """The composition the kernel fuses (see the module docstring)."""
    _check(x, parts, weight, y_weight, norm, scale)
    norm_fn = rms_norm if norm is None else rms_norm_fp32_scale
    y = sum_parts(parts, x.dtype)
    x = x + (y if y_weight is None else norm_fn(y, y_weight, eps).astype(x.dtype))
    if scale is not None:
        x = x * scale.astype(x.dtype)
    return x, None if weight is None else norm_fn(x, weight, eps)


def _scaled(row, inv, w, norm):
    """A chunk of a normed row, rounded as ``norm``'s reference rounds."""
    if norm == FP32_SCALE:
        return (row.astype(jnp.float32) * inv * w.astype(jnp.float32)).astype(row.dtype)
    return llama_scaled(row, inv, w)


def _inv_rms(chunks, hidden, eps):
    return lax.rsqrt(sum(jnp.sum(c.astype(jnp.float32) ** 2) for c in chunks) / hidden + eps)


def _kernel(x_ref, parts_ref, *refs, rows, hidden, chunk, splits, eps, norm, has_weight, post_norm, has_scale):
    refs = list(refs)
    w_ref = refs.pop(0) if has_weight else None
    y_w_ref = refs.pop(0) if post_norm else None
    scale = refs.pop(0)[0].astype(jnp.float32) if has_scale else None
    sum_ref, *normed_ref = refs
    # parts_ref: every row's partials, flat. A row's splits x chunk columns come in one gather, so
    # all its loads are in flight at once; splits x chunk stays <= _TILE fp32 (registers).
    row = pl.program_id(0)
    s = jnp.arange(_next_pow2(splits), dtype=jnp.int32)
    n_chunks = -(-hidden // chunk)
    offsets = [c * chunk + jnp.arange(chunk, dtype=jnp.int32) for c in range(n_chunks)]
    masks = [off < hidden for off in offsets]
    dtype = sum_ref.dtype  # x's
    ys = []
    for off, msk in zip(offsets, masks):
        idx = (s[:, None] * rows + row) * hidden + off[None, :]
        parts = plgpu.load(parts_ref.at[idx], mask=(s < splits)[:, None] & msk[None, :], other=0)
        ys.append(jnp.sum(parts.astype(jnp.float32), axis=0).astype(dtype))  # one fixed order per split count
    if post_norm:
        inv_y = _inv_rms(ys, hidden, eps)
        ys = [_scaled(y, inv_y, plgpu.load(y_w_ref.at[off], mask=msk, other=0), norm).astype(dtype)
              for y, off, msk in zip(ys, offsets, masks)]
    summed = []
    for y, off, msk in zip(ys, offsets, masks):
        residual = plgpu.load(x_ref.at[off], mask=msk, other=0)
        out = (residual.astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)
        if has_scale:  # two 16-bit factors: their fp32 product is exact, so one rounding as in XLA
            out = (out.astype(jnp.float32) * scale).astype(dtype)
        plgpu.store(sum_ref.at[off], out, mask=msk)
        summed.append(out)
    if not has_weight:
        return
    inv = _inv_rms(summed, hidden, eps)
    for out, off, msk in zip(summed, offsets, masks):
        w = plgpu.load(w_ref.at[off], mask=msk, other=0)
        plgpu.store(normed_ref[0].at[off], _scaled(out, inv, w, norm).astype(normed_ref[0].dtype), mask=msk)


def _num_warps(gather: int, post_norm: bool) -> int:
    """Warps for a gather of ``gather`` fp32 elements: 4 up to 1024 (SmolLM2's one-part row), 8 up
    to 8192, else 16 (16 beat 8 and 32 on the 16- and 32k-element rows of 1B and 8B); twice that
    with Gemma 4's post-norm, whose second reduction over the row gains from the threads (figures:
    ``benchmarks/README.md``, add + RMSNorm)."""
    warps = 4 if gather <= 1024 else 8 if gather <= 8192 else 16
    return 2 * warps if post_norm else warps


def add_rms_norm_pallas(x, parts, weight, eps, *, y_weight=None, norm=None, scale=None, tile=_TILE,
                        num_warps=None, interpret=None):
    """The kernel: one program per row of ``x``; ``tile``: fp32 elements of the partials one gather
    loads (a power of two)."""
    _check(x, parts, weight, y_weight, norm, scale)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    splits = parts.shape[0]
    chunk = max(16, min(_next_pow2(hidden), tile // _next_pow2(splits)))
    weights = [w for w in (weight, y_weight) if w is not None]
    kernel = functools.partial(_kernel, rows=rows, hidden=hidden, chunk=chunk, splits=splits, eps=float(eps),
                               norm=norm, has_weight=weight is not None, post_norm=y_weight is not None,
                               has_scale=scale is not None)
    row_spec = pl.BlockSpec((None, hidden), lambda r: (r, 0))

    def vector_spec(size):  # the whole vector in every program
        return pl.BlockSpec((size,), lambda r: (0,))

    flat = parts.size
    out_shape = [jax.ShapeDtypeStruct((rows, hidden), x.dtype)]
    if weight is not None:
        normed_dtype = x.dtype if norm == FP32_SCALE else jnp.promote_types(x.dtype, weight.dtype)
        out_shape.append(jax.ShapeDtypeStruct((rows, hidden), normed_dtype))
    outs = pdl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[row_spec, pl.BlockSpec((flat,), lambda r: (0,)), *[vector_spec(hidden)] * len(weights),
                  *[vector_spec(1)] * (scale is not None)],
        out_specs=[row_spec] * len(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or _num_warps(chunk * _next_pow2(splits),
                                                                                      y_weight is not None),
                                             num_stages=1),
        interpret=interpret_mode() if interpret is None else interpret,
        name="jspec_add_rms_norm",
    )(x2, parts.reshape(flat), *weights, *([] if scale is None else [scale]))
    out_sum, *out_normed = (out.reshape(x.shape) for out in outs)
    return out_sum, out_normed[0] if out_normed else None


def use_pallas(rows: int, splits: int, hidden: int) -> bool:
    """The ``impl="auto"`` rule on a GPU: decode and verify rows (up to 64) whose partials fit one
    gather: splits x hidden <= 32768 at one row, <= 16384 at more. In GPU time of one call the kernel
    beats XLA's composition at every decoder shape measured (Llama and Gemma 4 forms, the add alone
    too); 1B's 16 x 2048 output partials tie at one row and lose at five, hence the tighter bound
    there (figures: ``benchmarks/README.md``, add + RMSNorm)."""
    return rows <= 64 and splits * hidden <= (32768 if rows == 1 else 16384)


def add_rms_norm(x, parts, weight, eps, *, y_weight=None, norm=None, scale=None, impl="auto"):
    """Dispatcher: ``(x + y, norm(x + y))`` (see the module docstring); ``weight=None``: ``(x + y,
    None)``, the add alone (Gemma 4's post-normed MLP output before its per-layer input branch).
    ``impl="invariant"`` takes the kernel (its sum runs in one fixed order per row)."""
    impl = check_impl(impl, "add_rms_norm")
    rows = x.size // x.shape[-1]
    if impl in ("pallas", "invariant") or (impl == "auto" and on_gpu() and use_pallas(rows, parts.shape[0],
                                                                                          x.shape[-1])):
        return add_rms_norm_pallas(x, parts, weight, eps, y_weight=y_weight, norm=norm, scale=scale)
    return add_rms_norm_reference(x, parts, weight, eps, y_weight=y_weight, norm=norm, scale=scale)
