"""Rotary position embeddings: inverse frequencies (numpy, static config data) and cos / sin tables.
No kernels here, so that configs can import it; the rotation is ``jspec.layers.apply_rope``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


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
