"""Building blocks shared by every model family: norms, rotary embeddings, projections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import skinny_matmul
from pallas_kernels.gather_rows import rms_norm

__all__ = ["rms_norm", "rms_norm_fp32_scale", "default_inv_freq", "rope_cos_sin", "apply_rope", "linear", "gated_mlp", "silu_mlp"]


def rms_norm_fp32_scale(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4 RMSNorm: normalise and scale by ``weight`` in fp32, cast last (``rms_norm`` casts
    before scaling). ``weight=None`` is the weightless variant (Gemma 4 ``v_norm``)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)


def default_inv_freq(theta: float, head_dim: int, rotated_pairs: int | None = None) -> np.ndarray:
    """RoPE inverse frequencies ``[head_dim // 2]`` in fp32, as HF computes them:
    ``1 / theta ** (2i / head_dim)`` for the first ``rotated_pairs`` pairs (all by default), 0 for
    the rest (unrotated dimensions; the exponent keeps the full ``head_dim``)."""
    pairs = head_dim // 2 if rotated_pairs is None else rotated_pairs
    inv_freq = 1.0 / theta ** (np.arange(0, 2 * pairs, 2).astype(np.float32) / head_dim)
    return np.concatenate([inv_freq, np.zeros(head_dim // 2 - pairs, np.float32)]).astype(np.float32)


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


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation, *, impl: str = "auto") -> jax.Array:
    """``down(activation(gate(x)) * up(x))`` with gate and up fused into one ``[hidden, 2 * inter]`` matrix."""
    gate, up = jnp.split(linear(x, gate_up, impl=impl), 2, axis=-1)
    return linear(activation(gate) * up, down, impl=impl)


def silu_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, *, impl: str = "auto") -> jax.Array:
    """The Llama / Qwen MLP: ``gated_mlp`` with SiLU."""
    return gated_mlp(x, gate_up, down, jax.nn.silu, impl=impl)
