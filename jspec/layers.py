"""Building blocks shared by every model family: norms, rotary embeddings, projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import skinny_matmul
from pallas_kernels.gather_rows import rms_norm

__all__ = ["rms_norm", "rope_cos_sin", "apply_rope", "linear", "silu_mlp"]


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[batch, T, head_dim]`` for ``positions [batch, T]``; angles in fp32, then cast."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, T, head_dim // 2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half ("NeoX") RoPE. ``x [batch, T, heads, head_dim]``, cos/sin ``[batch, T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, impl: str = "auto") -> jax.Array:
    """``x [..., in] @ w [in, out]`` (+ bias) in x's dtype, accumulated in fp32."""
    y = skinny_matmul(x, w, impl=impl)
    return y if bias is None else y + bias.astype(y.dtype)


def silu_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, *, impl: str = "auto") -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[hidden, 2 * inter]`` matrix."""
    gate, up = jnp.split(linear(x, gate_up, impl=impl), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, down, impl=impl)
