"""Draft trees as fixed-shape arrays, and EAGLE-2 dynamic tree expansion.

A tree has ``n + 1`` nodes per sequence: node 0 is the root (the last emitted token, the first
verify row), nodes ``1..n`` are drafts in an order where every parent comes before its children.
The verify position of node ``i`` is the prefix length plus ``depths[:, i]``; ``mask`` is the
tree attention among the ``n + 1`` verify rows.

``expand`` grows a tree the EAGLE-2 way (SafeAILab/EAGLE ``eagle/model/cnets.py`` ``topK_genrate``):
the ``topk`` best children of the root, then per level the ``topk`` best children of each of the
``topk`` frontier nodes, the ``topk`` best of those by cumulative draft log-probability forming the
next frontier; finally the ``num_nodes`` best of all recorded candidates are kept (the rerank), in
candidate order. ``TreeShape`` holds those three numbers for a speculation round (``tree_shape``
picks chain or tree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jspec.step import mask_depths

# step_fn(carry, tokens [batch, topk], parent_slot [batch, topk], level) -> (logprobs [batch, topk, vocab], carry)
StepFn = Callable[[Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """``n + 1`` nodes per sequence, node 0 the root."""

    tokens: jax.Array  # [batch, n+1] int32, tokens[:, 0] = root
    parents: jax.Array  # [batch, n+1] int32, parents[:, 0] = -1, parents[:, i] in [0, i)
    depths: jax.Array  # [batch, n+1] int32, root 0, a child one more than its parent
    mask: jax.Array  # [batch, n+1, n+1] bool, mask[b, i, j]: node j is node i or one of its ancestors

    @property
    def num_nodes(self) -> int:
        """Draft nodes ``n`` (the root not counted)."""
        return self.tokens.shape[1] - 1

    @classmethod
    def from_parents(cls, tokens: jax.Array, parents: jax.Array) -> DraftTree:
        """The tree of ``tokens [batch, n+1]`` and ``parents [batch, n+1]`` (conventions above).

        Parents come before children, so one pass in index order closes the mask over ancestors:
        ``mask[i] = eye[i] | mask[parents[i]]``.
        """
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, n+1], got shape {tokens.shape}")
        if parents.shape != tokens.shape:
            raise ValueError(f"parents shape {parents.shape} does not match tokens shape {tokens.shape}")
        batch, width = tokens.shape
        parents = jnp.asarray(parents, jnp.int32)

        def close(i, mask):
            parent_row = jnp.take_along_axis(mask, parents[:, i, None, None], axis=1)[:, 0]  # [batch, n+1]
            return mask.at[:, i].set(mask[:, i] | parent_row)

        eye = jnp.broadcast_to(jnp.eye(width, dtype=bool), (batch, width, width))
        mask = jax.lax.fori_loop(1, width, close, eye)
        return cls(tokens=jnp.asarray(tokens, jnp.int32), parents=parents, depths=mask_depths(mask), mask=mask)


def feed_level(fed_mask: jax.Array, parent_slot: jax.Array, level, topk: int) -> tuple[jax.Array, jax.Array]:
    """The ancestor mask among a drafter's fed rows once level ``level`` (traced, >= 1) of an
    expansion is fed: its ``topk`` frontier nodes take rows ``first .. first + topk - 1`` with
    ``first = (level - 1) * topk`` (``expand``'s ``fed_row``), each seeing itself and its parent's
    row's ancestors (``parent_slot [batch, topk]``: the parent's row in the previous level; level 1's
    parent is the root, which is not a fed row). ``fed_mask [batch, F, F]`` starts as the identity
    (rows not fed yet see only themselves). Returns ``(fed_mask, first)``."""
    num_fed = fed_mask.shape[-1]
    first = (level - 1) * topk
    rows = first + jnp.arange(topk, dtype=jnp.int32)
    parent_rows = jnp.maximum(level - 2, 0) * topk + parent_slot  # [batch, topk]
    ancestors = jnp.take_along_axis(fed_mask, parent_rows[:, :, None], axis=1) & (level > 1)
    own = jax.nn.one_hot(rows, num_fed, dtype=bool)[None]  # [1, topk, F]
    return jax.lax.dynamic_update_slice_in_dim(fed_mask, ancestors | own, first, axis=1), first


def max_nodes(topk: int, depth: int) -> int:
    """Candidates an expansion records (the most nodes it can keep): ``topk + (depth-1) * topk**2``."""
    return topk + (depth - 1) * topk * topk


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A tree's static shape: ``depth`` levels, ``topk`` children per frontier node and ``topk``
    frontier nodes per level, ``num_nodes`` drafts kept. Checked on construction."""

    topk: int
    depth: int
    num_nodes: int

    def __post_init__(self):
        for name in ("topk", "depth", "num_nodes"):
            _check_count(name, getattr(self, name))
        if self.num_nodes > max_nodes(self.topk, self.depth):
            raise ValueError(
                f"num_nodes={self.num_nodes} exceeds the {max_nodes(self.topk, self.depth)} candidates that "
                f"topk={self.topk}, depth={self.depth} record (topk + (depth-1) * topk**2)"
            )

    @property
    def max_path(self) -> int:
        """The most drafts one root-to-leaf path can hold: ``min(depth, num_nodes)``."""
        return min(self.depth, self.num_nodes)

    @property
    def fed_rows(self) -> int:
        """Frontier nodes fed to the drafter: ``topk`` per level ``1..depth-1``."""
        return (self.depth - 1) * self.topk


def tree_shape(topk: int, depth: int | None, num_draft_tokens: int) -> TreeShape | None:
    """The tree of ``num_draft_tokens`` drafts that ``topk`` and ``depth`` ask for; None for a chain
    (``topk == 1``, whose depth is ``num_draft_tokens``). A tree needs an explicit ``depth``."""
    _check_count("topk", topk)
    if topk == 1:
        if depth not in (None, num_draft_tokens):
            raise ValueError(f"topk=1 drafts a chain of num_draft_tokens={num_draft_tokens}, got depth={depth!r}")
        return None
    if depth is None:
        raise ValueError(f"topk={topk} drafts a tree: give its depth")
    return TreeShape(topk, depth, num_draft_tokens)


def _check_expand(root_logprobs, root_token, topk, depth, num_nodes) -> None:
    TreeShape(topk, depth, num_nodes)
    if root_logprobs.ndim != 2:
        raise ValueError(f"root_logprobs must be [batch, vocab], got shape {root_logprobs.shape}")
    if root_token.shape != root_logprobs.shape[:1]:
        raise ValueError(f"root_token shape {root_token.shape} does not match batch {root_logprobs.shape[0]}")
    if topk > root_logprobs.shape[1]:
        raise ValueError(f"topk={topk} exceeds the vocabulary size {root_logprobs.shape[1]}")


def expand(
    root_logprobs: jax.Array,
    root_token: jax.Array,
    step_fn: StepFn,
    carry: Any,
    *,
    topk: int,
    depth: int,
    num_nodes: int,
) -> tuple[DraftTree, Any, jax.Array]:
    """EAGLE-2 expansion and rerank: ``(tree, carry, fed_row)``.

    Args:
      root_logprobs: ``[batch, vocab]`` fp32, the draft's log-probabilities of the root's children.
      root_token: ``[batch]`` int32, becomes ``tree.tokens[:, 0]``.
      step_fn: ``step_fn(carry, tokens, parent_slot, level) -> (logprobs, carry)``, called once per
        level ``1..depth-1`` (one ``lax.scan``; never with ``depth == 1``) on that level's frontier
        ``tokens [batch, topk]``; ``parent_slot [batch, topk]`` is the row of the previous call's
        frontier holding each node's parent (zeros at level 1: the parent is the root), for
        gathering per-row drafter state. Returns ``logprobs [batch, topk, vocab]`` fp32 of each
        frontier node's children.
      carry: the drafter's state, threaded through ``step_fn``.
      topk, depth, num_nodes: static, as ``TreeShape`` checks them. ``topk == 1`` drafts a greedy
        chain of ``depth`` nodes.

    Returns the tree of ``num_nodes`` drafts, the final carry, and ``fed_row [batch, n+1]`` int32:
    where node ``i`` was fed to ``step_fn`` (row ``j`` of level ``l`` is ``(l-1) * topk + j``), -1 for
    the root and for nodes never fed (the last level, nodes that missed a frontier).

    Scores are cumulative log-probabilities, non-increasing along every path, and ``lax.top_k``
    prefers the lower index among equals; a parent has a lower candidate index than its children,
    so the kept set contains every kept node's parent even where scores tie.
    """
    _check_expand(root_logprobs, root_token, topk, depth, num_nodes)
    batch = root_logprobs.shape[0]
    scores, tokens = jax.lax.top_k(root_logprobs.astype(jnp.float32), topk)  # level-1 candidates
    tokens = tokens.astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (batch, topk))
    # Candidate records: token, cumulative score, candidate id of the parent (-1: the root), fed row.
    # The level-1 frontier is all level-1 candidates, in candidate order, fed unless depth == 1.
    level1_fed = rows if depth > 1 else jnp.full_like(rows, -1)
    candidates = (tokens, scores, jnp.full((batch, topk), -1, jnp.int32), level1_fed)

    def level_step(state, level):
        carry, tokens, scores, index, slot = state
        logprobs, carry = step_fn(carry, tokens, slot, level)
        if logprobs.shape[:2] != (batch, topk):
            raise ValueError(f"step_fn must return logprobs [batch, topk, vocab], got shape {logprobs.shape}")
        child_logprobs, child_tokens = jax.lax.top_k(logprobs.astype(jnp.float32), topk)  # [batch, topk, topk]
        # Candidate f * topk + j is child j of frontier row f.
        level_scores = (scores[:, :, None] + child_logprobs).reshape(batch, topk * topk)
        level_tokens = child_tokens.reshape(batch, topk * topk).astype(jnp.int32)
        level_parents = jnp.repeat(index, topk, axis=1)
        scores, best = jax.lax.top_k(level_scores, topk)
        tokens = jnp.take_along_axis(level_tokens, best, axis=1)
        index = max_nodes(topk, level) + best  # this level's candidates follow all earlier ones
        slot = (best // topk).astype(jnp.int32)
        # The new frontier (level + 1) is fed next, unless level + 1 is the last level.
        fed = jnp.where(level + 1 < depth, level * topk + rows, -1)
        level_fed = jnp.full((batch, topk * topk), -1, jnp.int32).at[jnp.arange(batch)[:, None], best].set(fed)
        return (carry, tokens, scores, index, slot), (level_tokens, level_scores, level_parents, level_fed)

    if depth > 1:
        levels = jnp.arange(1, depth, dtype=jnp.int32)
        (carry, *_), recorded = jax.lax.scan(level_step, (carry, tokens, scores, rows, jnp.zeros_like(rows)), levels)
        # [depth-1, batch, topk*topk] -> [batch, (depth-1) * topk*topk], level-major like the candidate ids
        candidates = tuple(
            jnp.concatenate([first, jnp.moveaxis(rest, 0, 1).reshape(batch, -1)], axis=1)
            for first, rest in zip(candidates, recorded)
        )
    cand_tokens, cand_scores, cand_parents, cand_fed = candidates

    _, kept = jax.lax.top_k(cand_scores, num_nodes)
    kept = jnp.sort(kept, axis=1)  # candidate order puts parents before children
    # Node id of candidate c at node_of[c + 1]; node_of[0] = 0 is the root (parent id -1).
    node_of = jnp.zeros((batch, cand_scores.shape[1] + 1), jnp.int32)
    node_of = node_of.at[jnp.arange(batch)[:, None], kept + 1].set(jnp.arange(1, num_nodes + 1, dtype=jnp.int32))
    parents = jnp.take_along_axis(node_of, jnp.take_along_axis(cand_parents, kept, axis=1) + 1, axis=1)
    root_column = jnp.full((batch, 1), -1, jnp.int32)
    tree = DraftTree.from_parents(
        jnp.concatenate([root_token.astype(jnp.int32)[:, None], jnp.take_along_axis(cand_tokens, kept, axis=1)], 1),
        jnp.concatenate([root_column, parents], axis=1),
    )
    fed_row = jnp.concatenate([root_column, jnp.take_along_axis(cand_fed, kept, axis=1)], axis=1)
    return tree, carry, fed_row
