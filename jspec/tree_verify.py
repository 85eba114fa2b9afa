"""Tree verification: the root-to-node path the target accepts, and the token that follows.

A draft tree per sequence has ``n + 1`` nodes: node 0 is the root (the last emitted token),
nodes ``1..n`` are drafts with ``parents[:, i]`` in ``[0, i)`` (``parents[:, 0] = -1``) and
``tokens [batch, n+1]``. The target ran every node in one forward with tree attention, so row
``i`` of its output is the distribution of the token that follows node ``i``.

Both rules return ``path [batch, depth+1]`` (node ids: ``path[:, 0] = 0``, the accepted nodes in
``path[:, 1..num_accepted]``, zeros after), ``num_accepted [batch]`` and ``next_token [batch]``
(the correction after a rejection, the bonus at a leaf). A verify forward emits the tokens of
``path[:, 1..num_accepted]`` then ``next_token``.

* ``greedy``: from the root, move to the first child whose token is the argmax of the current
  node's row, until none is.
* ``rejection_sample``: lossless tree speculative sampling with deterministic children (SpecInfer,
  Miao et al., arXiv:2305.09781; SafeAILab/EAGLE ``eagle/model/utils.py`` ``evaluate_posterior``):
  at a node with residual ``r`` (first ``p`` of its row), try its children in index order,
  accepting child ``c`` with probability ``r(c)``; a rejection sets ``r(c) = 0`` and renormalises.
  After the last rejection emit ``next_token ~ r``. The emitted tokens then have exactly the
  target's distribution.

``depth`` (static) bounds the path length; the tree's maximum depth keeps every acceptance, a
smaller one cuts paths there (still exact: the cut-off children are simply never tried).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_shapes(rows: jax.Array, tokens: jax.Array, parents: jax.Array, depth: int) -> None:
    if rows.ndim != 3:
        raise ValueError(f"target rows must be [batch, n+1, vocab], got shape {rows.shape}")
    if tokens.shape != rows.shape[:2]:
        raise ValueError(f"tokens shape {tokens.shape} does not match the target rows [batch, n+1] = {rows.shape[:2]}")
    if parents.shape != tokens.shape:
        raise ValueError(f"parents shape {parents.shape} does not match tokens shape {tokens.shape}")
    num_drafts = tokens.shape[1] - 1
    if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth <= num_drafts:
        raise ValueError(f"depth must be an int in [0, {num_drafts}] (the number of draft nodes), got {depth!r}")


def _parent_rows(parents: jax.Array) -> jax.Array:
    """``[batch, n+1]`` row of each node's parent; the root (no parent) points at itself."""
    return jnp.maximum(parents, 0)


def _descend(accepted_if_tried: jax.Array, parents: jax.Array, depth: int):
    """Walk from the root, moving to the first child (lowest index) with ``accepted_if_tried``.

    ``accepted_if_tried [batch, n+1]`` says whether node ``j`` is accepted when its parent is the
    current node and its earlier siblings were rejected. Each node is tried at most once (only
    while its parent is current), so one precomputed decision per node is the whole walk.

    Returns ``path [batch, depth+1]``, ``num_accepted [batch]``, the path's last node ``[batch]``
    and ``stopped [batch]`` (its children were tried and all rejected; ``False`` when the walk
    reached ``depth``, whose children are never tried).
    """
    batch = parents.shape[0]

    def level(step, carry):
        node, _, path, num_accepted = carry
        candidates = (parents == node[:, None]) & accepted_if_tried
        found = jnp.any(candidates, axis=1)
        child = jnp.argmax(candidates, axis=1).astype(jnp.int32)  # first True
        node = jnp.where(found, child, node)
        path = path.at[:, step + 1].set(jnp.where(found, child, 0))
        # A node without an accepted child stays current, so every later level finds none too.
        return node, ~found, path, num_accepted + found.astype(jnp.int32)

    zeros = jnp.zeros((batch,), jnp.int32)
    init = (zeros, jnp.zeros((batch,), bool), jnp.zeros((batch, depth + 1), jnp.int32), zeros)
    node, stopped, path, num_accepted = jax.lax.fori_loop(0, depth, level, init)
    return path, num_accepted, node, stopped


def greedy(
    target_logits: jax.Array, tokens: jax.Array, parents: jax.Array, *, depth: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy tree verification.

    Args:
      target_logits: ``[batch, n+1, vocab]``, row ``i`` predicts the token after node ``i``.
      tokens: ``[batch, n+1]`` int, node 0 the root.
      parents: ``[batch, n+1]`` int, ``parents[:, 0] = -1``, ``parents[:, i]`` in ``[0, i)``.
      depth: static bound on the path length (the tree's maximum depth).

    Returns ``path [batch, depth+1]``, ``num_accepted [batch]``, ``next_token [batch]`` (int32).
    """
    _check_shapes(target_logits, tokens, parents, depth)
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [batch, n+1]
    matches_parent_argmax = tokens == jnp.take_along_axis(target_tokens, _parent_rows(parents), axis=1)
    path, num_accepted, last, _ = _descend(matches_parent_argmax, parents, depth)
    next_token = jnp.take_along_axis(target_tokens, last[:, None], axis=1)[:, 0]
    return path, num_accepted, next_token


def rejection_sample(
    key: jax.Array, target_probs: jax.Array, tokens: jax.Array, parents: jax.Array, *, depth: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lossless tree speculative sampling for deterministic children (``q`` one-hot).

    Args:
      target_probs: ``p`` ``[batch, n+1, vocab]`` fp32, the target's final sampling distribution
        at each node's row (temperature / top-k / top-p applied).
      tokens, parents, depth: as in :func:`greedy`.

    Returns ``path [batch, depth+1]``, ``num_accepted [batch]``, ``next_token [batch]`` (int32).
    """
    _check_shapes(target_probs, tokens, parents, depth)
    batch, num_nodes, _ = target_probs.shape
    accept_key, residual_key = jax.random.split(key)
    p = target_probs.astype(jnp.float32)
    rows = jnp.arange(batch)[:, None]
    parent_rows = _parent_rows(parents)

    # Child j of node v is tried with residual r_j = p_v with the distinct tokens of its earlier
    # siblings removed and renormalised, so r_j(c_j) = p_v(c_j) / (sum p_v - mass of those tokens),
    # and 0 when c_j repeats an earlier sibling's token (already rejected, so r = 0 there).
    # Accepting j when u_j < r_j(c_j), with one independent uniform per node, and taking the
    # first accepted sibling is exactly trying them in order with a fresh coin each.
    p_token = p[rows, parent_rows, tokens]  # [batch, n+1] p_parent(token of the node)
    p_total = jnp.sum(p, axis=-1)[rows, parent_rows]  # [batch, n+1]
    node_ids = jnp.arange(num_nodes)
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (node_ids[None, :] < node_ids[:, None])
    repeats_earlier = jnp.any(earlier_sibling & (tokens[:, :, None] == tokens[:, None, :]), axis=2)
    first_of_token = earlier_sibling & ~repeats_earlier[:, None, :]  # [batch, j, i] distinct earlier siblings i
    removed_mass = jnp.einsum("bji,bi->bj", first_of_token.astype(p.dtype), p_token)
    remaining_mass = p_total - removed_mass
    u = jax.random.uniform(accept_key, (batch, num_nodes), dtype=p.dtype)
    # u * remaining < p avoids the division; p > 0 keeps a rounding-negative remaining mass from
    # accepting a token the target cannot emit.
    accepted_if_tried = ~repeats_earlier & (p_token > 0) & (u * remaining_mass < p_token)
    path, num_accepted, last, stopped = _descend(accepted_if_tried, parents, depth)

    # After all of last's children were rejected their tokens carry no residual mass (one rejected
    # child removes a token even if another node shares it); at the depth bound none was tried and
    # the bonus comes from p_last itself.
    p_last = jnp.take_along_axis(p, last[:, None, None], axis=1)[:, 0]  # [batch, vocab]
    rejected = (parents == last[:, None]) & stopped[:, None]
    residual = p_last.at[rows, tokens].multiply(jnp.where(rejected, 0.0, 1.0))
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # An empty residual means the rejected children held all of p_last's mass. Exactly, the last
    # distinct one then had r(c) = 1 and could not be rejected, so this happens only through
    # rounding in u * remaining < p, with probability of the order of fp32 eps, and any fallback
    # is exact up to that rounding; p_last, the target's own distribution there, keeps every
    # emitted token one the target can produce.
    residual = jnp.where(total > 0, residual, p_last)
    next_token = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return path, num_accepted, next_token
