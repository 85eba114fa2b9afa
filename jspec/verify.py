"""Chain verification: how many draft tokens the target accepts, and the token that follows.

Both rules return ``num_accepted [batch]`` in ``0..k`` and ``next_token [batch]``: the
correction token at the first rejected position, or the bonus token after ``k`` accepts.
Each verify forward therefore emits ``num_accepted + 1`` tokens.

* ``greedy``: accept the longest prefix of drafts equal to the target's argmax.
* ``rejection_sample``: lossless speculative sampling (Leviathan et al. 2023, Chen et al.
  2023): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
  rejection sample from ``max(0, p_i - q_i)`` renormalised; after ``k`` accepts sample the
  bonus from ``p_{k+1}``. The output then has exactly the target distribution ``p``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _leading_true(flags: jax.Array) -> jax.Array:
    """Length of the all-True prefix of ``flags [batch, k]`` -> ``[batch]`` int32."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def greedy(target_logits: jax.Array, draft_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy acceptance: the longest prefix of drafts the target's argmax agrees with.

    Args:
      target_logits: ``[batch, k+1, vocab]``, row ``i`` the target's logits after draft ``i`` (row 0:
        after the root).
      draft_tokens: ``[batch, k]`` int32.
    Returns:
      ``(num_accepted [batch] in 0..k, next_token [batch])``: the target's token after the last
      accepted draft (the correction, or the bonus when all k are accepted).
    """
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [batch, k+1]
    num_accepted = _leading_true(draft_tokens == target_tokens[:, :-1])
    next_token = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token


def rejection_sample(
    key: jax.Array,
    target_probs: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Lossless acceptance for sampled drafts.

    Args:
      target_probs: ``p`` ``[batch, k+1, vocab]`` fp32, the target's final sampling
        distribution at each verify row (temperature / top-k / top-p applied).
      draft_tokens: ``[batch, k]``.
      draft_probs: ``q`` ``[batch, k, vocab]``, the exact distribution each draft was drawn
        from; ``None`` for deterministic drafters (``q`` one-hot at the draft token).
    Returns:
      ``(num_accepted [batch] in 0..k, next_token [batch])``: a correction drawn from
      ``norm(max(p - q, 0))`` at the first rejection, or a bonus drawn from ``p`` after all k.
    """
    batch, k = draft_tokens.shape
    accept_key, residual_key = jax.random.split(key)
    p_k = target_probs[:, :k]  # [batch, k, vocab]
    p_draft = jnp.take_along_axis(p_k, draft_tokens[..., None], axis=-1)[..., 0]  # [batch, k]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        q = jax.nn.one_hot(draft_tokens, p_k.shape[-1], dtype=p_k.dtype)
    else:
        q = draft_probs.astype(p_k.dtype)
        q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    # u < p/q  <=>  u * q < p, avoiding a division; accepts with probability min(1, p/q).
    u = jax.random.uniform(accept_key, (batch, k), dtype=p_k.dtype)
    num_accepted = _leading_true(u * q_draft < p_draft)

    # Distribution of the token emitted after the accepted prefix: the residual at the
    # first rejection, the bonus distribution p_{k+1} after k accepts.
    q_padded = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # [batch, k+1, vocab]
    residual = jnp.maximum(target_probs - q_padded, 0.0)
    residual = jnp.take_along_axis(residual, num_accepted[:, None, None], axis=1)[:, 0]
    p_at = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q leaves no residual mass; a rejection then has probability 0, so any choice is exact.
    residual = jnp.where(total > 0, residual, p_at)
    next_token = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return num_accepted, next_token
