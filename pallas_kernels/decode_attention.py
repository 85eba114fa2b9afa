"""Few-query attention against a long, read-only KV cache.

Shapes:
  q            [batch, num_q, num_q_heads, head_dim]
  k, v         [batch, num_kv_heads, max_len, head_dim]   (never written here)
  kv_lengths   [batch]           valid cache rows, incl. rows just written for q
  q_positions  [batch, num_q]    absolute positions of the query rows
  tail_mask    [batch, num_q, num_q] bool, optional: replaces the causal rule among
               the last ``num_q`` valid rows (tree attention)
  out          [batch, num_q, num_q_heads, head_dim]  (q's dtype)

Cache row ``j`` is visible to query ``i`` iff ``j < kv_lengths[b]`` and
``j <= q_positions[b, i]`` and (no window or ``q_positions[b, i] - j < window``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import check_impl

# Finite so that a fully masked row gives a uniform (not NaN) softmax.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def visibility_mask(kv_lengths, q_positions, max_len, *, tail_mask=None, window=None):
    """Which cache rows each query sees: bool [batch, num_q, max_len]."""
    rows = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    pos = q_positions[:, :, None]
    visible = (rows < kv_lengths[:, None, None]) & (rows <= pos)
    if window is not None:
        visible &= pos - rows < window
    if tail_mask is not None:
        num_q = q_positions.shape[1]
        tail_start = kv_lengths[:, None, None] - num_q
        in_tail = (rows >= tail_start) & (rows < kv_lengths[:, None, None])
        # Tail row j corresponds to query column j - tail_start.
        col = jnp.clip(rows - tail_start, 0, num_q - 1)
        tail_visible = jnp.take_along_axis(tail_mask, jnp.broadcast_to(col, tail_mask.shape[:2] + (max_len,)), axis=2)
        visible = jnp.where(in_tail, tail_visible & (rows < kv_lengths[:, None, None]), visible)
    return visible


def decode_attention_reference(q, k, v, kv_lengths, *, q_positions, tail_mask=None, window=None, scale=None):
    """Plain-jnp attention, fp32 softmax; the ground truth for the kernel."""
    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.reshape(batch, num_q, num_kv_heads, group, head_dim)
    scores = jnp.einsum(
        "bqhgd,bhsd->bhgqs", qg, k, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    scores = scores * scale
    visible = visibility_mask(kv_lengths, q_positions, max_len, tail_mask=tail_mask, window=window)
    scores = jnp.where(visible[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    # Masked rows may hold NaN/Inf garbage: zero their contribution explicitly.
    v_clean = jnp.where(jnp.arange(max_len)[None, None, :, None] < kv_lengths[:, None, None, None], v, 0)
    out = jnp.einsum(
        "bhgqs,bhsd->bqhgd",
        probs.astype(v.dtype),
        v_clean,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(batch, num_q, num_q_heads, head_dim).astype(q.dtype)


def decode_attention(q, k, v, kv_lengths, *, q_positions, tail_mask=None, window=None, scale=None, impl="auto"):
    """Dispatcher: see the module docstring for shapes and the visibility rule."""
    impl = check_impl(impl)
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"num_q_heads {q.shape[2]} is not a multiple of num_kv_heads {k.shape[1]}")
    if impl == "pallas":
        raise NotImplementedError("the Pallas decode-attention kernel is not implemented yet")
    return decode_attention_reference(
        q, k, v, kv_lengths, q_positions=q_positions, tail_mask=tail_mask, window=window, scale=scale
    )
