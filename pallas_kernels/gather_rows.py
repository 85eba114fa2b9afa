"""Last-position slicing: gather the live row(s) of each sequence, optionally RMS-normed.

Shapes:
  x            [batch, T, hidden]
  rows         [batch] or [batch, n]   per-sequence row indices into T
  norm_weight  [hidden], optional
  out          [batch, hidden] or [batch, n, hidden]  (x's dtype)

With ``norm_weight`` the Llama RMSNorm is applied in the same pass:
``norm_weight * (x_f32 * rsqrt(mean(x_f32**2) + eps)).astype(x.dtype)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import check_impl


def rms_norm(x, weight, eps):
    """Llama RMSNorm: normalise in fp32, cast to x's dtype, then scale by ``weight``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def gather_rows_reference(x, rows, *, norm_weight=None, eps=1e-6):
    squeeze = rows.ndim == 1
    idx = rows[:, None] if squeeze else rows
    out = jnp.take_along_axis(x, idx[:, :, None].astype(jnp.int32), axis=1)
    if norm_weight is not None:
        out = rms_norm(out, norm_weight, eps).astype(x.dtype)
    return out[:, 0] if squeeze else out


def gather_rows(x, rows, *, norm_weight=None, eps=1e-6, impl="auto"):
    """Dispatcher: see the module docstring for shapes."""
    impl = check_impl(impl)
    if impl == "pallas":
        raise NotImplementedError("the Pallas gather-rows kernel is not implemented yet")
    return gather_rows_reference(x, rows, norm_weight=norm_weight, eps=eps)
