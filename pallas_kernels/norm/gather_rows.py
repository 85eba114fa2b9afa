"""Last-position slicing: gather the live row(s) of each sequence, optionally RMS-normed.

Shapes:
  x            [batch, T, hidden]
  rows         [batch] or [batch, n]   per-sequence row indices into T; negative indices count
               from the end (Python style); indices outside ``[-T, T)`` are clamped
  norm_weight  [hidden], optional
  out          [batch, hidden] or [batch, n, hidden]  (x's dtype)

With ``norm_weight`` the Llama RMSNorm is applied in the same pass:
``norm_weight * (x_f32 * rsqrt(mean(x_f32**2) + eps)).astype(x.dtype)``, cast to x's dtype.

The Pallas kernel (Triton backend) runs one program per gathered row: it reads the row through
a pointer window over ``x[b]`` (flattened, so any ``hidden`` works: iota offsets + mask in
power-of-two chunks), reduces the sum of squares in fp32 and writes the normed row -- one launch
instead of XLA's gather + reduce + scale. ``impl="auto"`` uses the reference everywhere (the
kernel measured no consistent win, see :func:`use_pallas`); ``impl="pallas"`` forces the kernel;
``impl="invariant"`` takes it whenever it norms (its per-row sum of squares has a fixed order).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.dispatch import check_impl, interpret_mode, on_gpu
from pallas_kernels.attention.split_kv import _next_pow2

_MAX_CHUNK = 4096
FP32_SCALE = "fp32_scale"  # gather_rows_pallas(norm=...): Gemma 4's RMSNorm


def rms_norm(x, weight, eps):
    """Llama RMSNorm: normalise in fp32, cast to x's dtype, then scale by ``weight``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rms_norm_fp32_scale(x, weight, eps):
    """Gemma 4 RMSNorm (:data:`FP32_SCALE`): normalise and scale by ``weight`` in fp32, cast last;
    ``weight=None``: no scale (Gemma 4's ``v_norm``)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)


def _normalize_rows(rows, seq_len):
    rows = rows.astype(jnp.int32)
    rows = jnp.where(rows < 0, rows + seq_len, rows)
    return jnp.clip(rows, 0, seq_len - 1)


def gather_rows_reference(x, rows, *, norm_weight=None, eps=1e-6):
    squeeze = rows.ndim == 1
    idx = _normalize_rows(rows[:, None] if squeeze else rows, x.shape[1])
    out = jnp.take_along_axis(x, idx[:, :, None], axis=1)
    if norm_weight is not None:
        out = rms_norm(out, norm_weight, eps).astype(x.dtype)
    return out[:, 0] if squeeze else out


def _gather_kernel(rows_ref, x_ref, *refs, hidden: int, chunk: int, eps: float, norm: str | None, has_weight: bool):
    if has_weight:
        w_ref, o_ref = refs
    else:
        (o_ref,) = refs
    has_norm = norm is not None
    base = rows_ref[()] * hidden
    n_chunks = -(-hidden // chunk)
    offsets = [c * chunk + jnp.arange(chunk, dtype=jnp.int32) for c in range(n_chunks)]
    masks = [off < hidden for off in offsets]
    xs = [plgpu.load(x_ref.at[base + off], mask=msk, other=0) for off, msk in zip(offsets, masks)]
    if not has_norm:
        for off, msk, xc in zip(offsets, masks, xs):
            plgpu.store(o_ref.at[off], xc, mask=msk)
        return
    sumsq = sum(jnp.sum(xc.astype(jnp.float32) ** 2) for xc in xs)
    inv = jax.lax.rsqrt(sumsq / hidden + eps)
    for off, msk, xc in zip(offsets, masks, xs):
        if norm == FP32_SCALE:  # Gemma 4: scale in fp32 (no weight: by 1), cast last
            normed = xc.astype(jnp.float32) * inv
            if has_weight:
                normed = normed * plgpu.load(w_ref.at[off], mask=msk, other=0).astype(jnp.float32)
            plgpu.store(o_ref.at[off], normed.astype(o_ref.dtype), mask=msk)
            continue
        w = plgpu.load(w_ref.at[off], mask=msk, other=0)
        plgpu.store(o_ref.at[off], llama_scaled(xc, inv, w).astype(o_ref.dtype), mask=msk)


def llama_scaled(x, inv_rms, weight):
    """:func:`rms_norm` of a chunk of a row given its ``1 / rms``, rounded as the reference rounds:
    the normed row to x's dtype, the scaled one to the promoted dtype of weight and x."""
    normed = (x.astype(jnp.float32) * inv_rms).astype(x.dtype)
    return (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(jnp.promote_types(weight.dtype, x.dtype))


def gather_rows_pallas(x, rows, *, norm_weight=None, eps=1e-6, norm=None, num_warps=None, interpret=None):
    """The kernel. ``norm``: None (the Llama RMSNorm when ``norm_weight`` is given, else no norm) or
    :data:`FP32_SCALE` (Gemma 4's RMSNorm, scaled in fp32 and cast last; ``norm_weight`` None: no scale)."""
    batch, seq_len, hidden = x.shape
    squeeze = rows.ndim == 1
    idx = _normalize_rows(rows[:, None] if squeeze else rows, seq_len)  # [B, n]
    n = idx.shape[1]
    chunk = min(_next_pow2(hidden), _MAX_CHUNK)
    if num_warps is None:
        num_warps = 4 if chunk <= 1024 else 8
    has_weight = norm_weight is not None
    norm = norm or ("llama" if has_weight else None)
    kernel = functools.partial(_gather_kernel, hidden=hidden, chunk=chunk, eps=float(eps), norm=norm,
                               has_weight=has_weight)
    in_specs = [
        pl.BlockSpec((None, None), lambda b, i: (b, i)),
        pl.BlockSpec((None, seq_len * hidden), lambda b, i: (b, 0)),  # pointer window over x[b]
    ]
    args = [idx, x.reshape(batch, seq_len * hidden)]
    if has_weight:
        in_specs.append(pl.BlockSpec((hidden,), lambda b, i: (0,)))
        args.append(norm_weight)
    out = pdl.pallas_call(
        kernel,
        grid=(batch, n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, hidden), lambda b, i: (b, i, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, n, hidden), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret_mode() if interpret is None else interpret,
        name="jspec_gather_rows",
    )(*args)
    return out[:, 0] if squeeze else out


def use_pallas(batch, n, seq_len, hidden, has_norm) -> bool:
    """The ``impl="auto"`` rule on a GPU: never.

    Both the kernel and XLA's gather + norm are launch-bound, and the kernel's speed-up shows no
    pattern beyond the noise (figures: ``benchmarks/README.md``, gather_rows); inside a model's jit
    XLA can also fuse the gather + norm with its neighbours, which a Pallas call cannot.
    """
    del batch, n, seq_len, hidden, has_norm
    return False


def gather_rows(x, rows, *, norm_weight=None, eps=1e-6, impl="auto"):
    """Dispatcher: see the module docstring for shapes."""
    impl = check_impl(impl, "gather_rows")
    if impl == "auto":
        n = 1 if rows.ndim == 1 else rows.shape[1]
        use = on_gpu() and use_pallas(x.shape[0], n, x.shape[1], x.shape[2], norm_weight is not None)
        impl = "pallas" if use else "xla"
    if impl == "pallas" or (impl == "invariant" and norm_weight is not None):
        return gather_rows_pallas(x, rows, norm_weight=norm_weight, eps=eps)
    return gather_rows_reference(x, rows, norm_weight=norm_weight, eps=eps)
