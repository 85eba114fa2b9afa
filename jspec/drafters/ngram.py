"""Prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's last
n tokens (the longest n from ``max_ngram`` down to ``min_ngram`` that occurs). Model-free and
deterministic (``q`` is one-hot); its state is empty.

``match="latest"`` (default) takes the most recent occurrence, the one most likely to continue
the current text; ``match="earliest"`` the first one, as HF transformers' prompt lookup
(``PromptLookupCandidateGenerator``) does: with ``max_ngram=2, min_ngram=1`` it drafts what HF
drafts (where HF's continuation stops at the end of the text, jspec pads with the root token).

Matches are ranked per *continuation start* ``c`` (the first token after the matched n-gram):
longest n first, then the most recent ``c`` ("latest") or the earliest ("earliest"). A chain
(``propose``) drafts the continuation of the best match; past the end of the text it repeats
the root.

A tree (``propose_tree``, ``topk > 1``) is the trie of up to ``topk`` *branches*: the
continuations, ``depth`` tokens each (the root repeated past the end of the text, as the chain
does), of the best matches in rank order, skipping a match whose continuation equals an already
chosen branch (so branches differ; a repeated text does not fill the tree with copies of one
path). Branch 0 is the best match (with no match at all, the chain's root repeats); further
branches exist only for further distinct matches. A branch's token at depth ``d`` shares the node
of an earlier branch when their tokens agree through ``d``, so siblings never repeat a token.
Nodes are numbered branch-major: all of branch 0, then the nodes branch 1 adds (those past its
common prefix with earlier branches, in depth order), and so on, so parents come before
children; the first ``num_nodes`` are kept. Branch-major rather than level order because the
best match carries most of the acceptance: its deep tokens are usually worth more than another
match's first one, so a tree never loses the chain's own path to a wider one (with
``num_nodes <= depth`` the tree *is* the chain of ``num_nodes``, and ``topk=1`` drafts exactly
the chain). When the trie has fewer than ``num_nodes`` nodes the rest are padding: children of
the root repeating node 1's token, which verification never accepts (greedy takes the first
matching child, rejection sampling never accepts a repeated sibling token).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.models import AnyModel
from jspec.models.base import NO_CAPTURE, Capture
from jspec.sampling import SamplingParams
from jspec.tree import DraftTree, TreeShape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NGram:
    """N-gram prompt-lookup drafter (API): ``NGram(max_ngram=3, min_ngram=1, match="latest")``."""

    max_ngram: int = dataclasses.field(default=3, metadata=dict(static=True))
    min_ngram: int = dataclasses.field(default=1, metadata=dict(static=True))
    match: str = dataclasses.field(default="latest", metadata=dict(static=True))

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.match not in ("latest", "earliest"):
            raise ValueError(f"match must be 'latest' or 'earliest', got {self.match!r}")

    @property
    def capture(self) -> Capture:
        return NO_CAPTURE

    def check_compatible(self, target: AnyModel) -> None:
        pass  # reads token ids only

    def bind(self, target: AnyModel) -> NGram:
        return self

    def max_positions(self) -> None:
        return None

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> tuple:
        return ()

    def _match_ranks(self, history: jax.Array, end: jax.Array) -> jax.Array:
        """``[batch, capacity]`` int32: per continuation start ``c``, its rank key (higher is better),
        -1 where nothing matches. The sequence is ``history[b, : end[b] + 1]``.

        ``c`` matches with ``n`` when ``history[c-n : c]`` equals the sequence's last ``n`` tokens and
        ``c <= end`` (the continuation's first token is known). The key orders by the longest such
        ``n`` in ``[min_ngram, max_ngram]``, then by recency (or its reverse for "earliest"); keys of
        different starts differ.
        """
        capacity = history.shape[1]
        starts = jnp.arange(capacity, dtype=jnp.int32)[None, :]
        # run[b, c]: the j tokens before c equal the last j tokens, for every j so far.
        run = starts <= end[:, None]
        ngram = jnp.zeros(history.shape, jnp.int32)  # the longest matched n at c, up to max_ngram
        for j in range(1, self.max_ngram + 1):
            suffix_token = jnp.take_along_axis(history, jnp.maximum(end + 1 - j, 0)[:, None], axis=1)
            run &= (starts >= j) & (end[:, None] + 1 >= j) & (jnp.roll(history, j, axis=1) == suffix_token)
            ngram += run.astype(jnp.int32)
        recency = starts if self.match == "latest" else capacity - 1 - starts
        return jnp.where(ngram >= self.min_ngram, ngram * capacity + recency, -1)

    def propose(self, dstate, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        del params, key  # deterministic
        ranks = self._match_ranks(ctx.history, ctx.lengths)
        best = jnp.where(jnp.max(ranks, axis=1) >= 0, jnp.argmax(ranks, axis=1), -1).astype(jnp.int32)
        tokens = _continuations(ctx.history, ctx.lengths, ctx.root, best[:, None], num_draft_tokens)
        return tokens[:, 0], None, dstate

    def propose_tree(self, dstate, ctx: RoundContext, *, shape: TreeShape, params: SamplingParams, key):
        """The trie of the ``shape.topk`` best distinct continuations (module docstring):
        ``(DraftTree of shape.num_nodes drafts, dstate)``."""
        del params, key  # deterministic
        history, end, root = ctx.history, ctx.lengths, ctx.root
        ranks = self._match_ranks(history, end)
        starts = jnp.broadcast_to(jnp.arange(history.shape[1], dtype=jnp.int32), ranks.shape)
        every = _continuations(history, end, root, starts, shape.depth)  # [batch, capacity, depth]
        branches, found = [], []
        for _ in range(shape.topk):
            best = jnp.argmax(ranks, axis=1)
            branch = jnp.take_along_axis(every, best[:, None, None], axis=1)[:, 0]  # [batch, depth]
            found.append(jnp.take_along_axis(ranks, best[:, None], axis=1)[:, 0] >= 0)
            branches.append(jnp.where(found[-1][:, None], branch, root[:, None]))
            ranks = jnp.where(jnp.all(every == branch[:, None, :], axis=2), -1, ranks)  # drop its copies
        branches, found = jnp.stack(branches, axis=1), jnp.stack(found, axis=1)
        return _trie(root, branches, found.at[:, 0].set(True), shape.num_nodes), dstate

    def commit(self, dstate, ctx: CommitContext):
        return dstate


def _continuations(history: jax.Array, end: jax.Array, root: jax.Array, starts: jax.Array, length: int) -> jax.Array:
    """``[batch, m, length]``: the ``length`` tokens from each of ``starts [batch, m]`` (-1: none);
    tokens not known yet (past ``end``) and those of no start are the root."""
    offsets = starts[:, :, None] + jnp.arange(length, dtype=jnp.int32)  # [batch, m, length]
    known = (starts[:, :, None] >= 0) & (offsets <= end[:, None, None])
    flat = jnp.clip(offsets, 0, history.shape[1] - 1).reshape(offsets.shape[0], -1)
    tokens = jnp.take_along_axis(history, flat, axis=1).reshape(offsets.shape)
    return jnp.where(known, tokens, root[:, None, None])


def _trie(root: jax.Array, branches: jax.Array, valid: jax.Array, num_nodes: int) -> DraftTree:
    """The trie of ``branches [batch, m, depth]`` (those with ``valid [batch, m]``; branch 0 valid),
    numbered branch-major and cut or padded to ``num_nodes`` drafts (module docstring)."""
    batch, m, depth = branches.shape
    # agree[b, c, c2, d]: branches c and c2 have the same tokens through depth d.
    agree = jnp.cumprod(branches[:, :, None, :] == branches[:, None, :, :], axis=3).astype(bool)
    earlier_or_self = jnp.tril(jnp.ones((m, m), bool))[None, :, :, None]
    # The node of (c, d) belongs to the first valid branch agreeing with c through d (c itself if none).
    owner = jnp.argmax(agree & earlier_or_self & valid[:, None, :, None], axis=2)  # [batch, m, depth]
    new = valid[:, :, None] & (owner == jnp.arange(m)[None, :, None])
    node_id = jnp.cumsum(new.reshape(batch, -1), axis=1).reshape(new.shape)  # 1-based for new nodes
    owner_id = jnp.take_along_axis(node_id, owner, axis=1)
    parent = jnp.concatenate([jnp.zeros((batch, m, 1), jnp.int32), owner_id[:, :, :-1]], axis=2)
    kept = new & (node_id <= num_nodes)
    slot = jnp.where(kept, node_id, num_nodes + 1).reshape(batch, -1)  # the rest land in a dropped column
    rows = jnp.arange(batch)[:, None]
    # Padding: children of the root repeating node 1's token (branch 0's first, always kept).
    padding = jnp.broadcast_to(branches[:, :1, 0], (batch, num_nodes + 2))
    tokens = padding.at[rows, slot].set(branches.reshape(batch, -1))
    parents = jnp.zeros((batch, num_nodes + 2), jnp.int32).at[rows, slot].set(parent.reshape(batch, -1))
    tokens = tokens[:, : num_nodes + 1].at[:, 0].set(root)
    parents = parents[:, : num_nodes + 1].at[:, 0].set(-1)
    return DraftTree.from_parents(tokens, parents)
