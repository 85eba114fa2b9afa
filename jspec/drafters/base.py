"""The drafter protocol, and the contexts a speculation round hands to a drafter.

A drafter is a registered dataclass pytree (``jax.tree_util.register_dataclass``): its
parameters are leaves, its settings static fields. The round (``jspec.speculative``) uses
exactly the members of :class:`Drafter`; ``speculative_generate`` calls ``check_compatible``
and ``bind`` once on the host, then runs ``prefill`` and, per round, ``propose`` and
``commit`` inside one jitted program.

Cache discipline: a drafter with its own KV cache shortens it only through ``KVCache.truncate``
(after a tree round also ``KVCache.move_rows``) and does so in ``commit`` (the one place where
rejected drafts are rolled back), never in ``propose``. Drafters that draft trees (``topk > 1``)
also implement ``propose_tree(dstate, ctx, *, shape, params, key) -> (jspec.tree.DraftTree,
dstate)``; their ``commit`` then gets the accepted path.
Drafters with weights load through a classmethod ``load(path, *, dtype=None, ...)``
returning the drafter (``DraftModel.load``, ``Eagle3.load``, ``MTP.load``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import jax

from jspec.kv import KVCache
from jspec.models import AnyModel
from jspec.models.base import Capture
from jspec.sampling import SamplingParams

# A drafter's own state between rounds (its KV cache, a recurrent hidden, ...): any pytree.
DraftState = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillContext:
    tokens: jax.Array  # [batch, width] right-padded prompts
    prompt_lengths: jax.Array  # [batch]
    features: tuple[jax.Array, ...]  # the drafter's ``capture`` over the prompt, [batch, width, hidden] each
    next_token: jax.Array  # [batch] the first sampled token (at position prompt_lengths[b])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundContext:
    """What a drafter may read when proposing. Position ``lengths[b]`` holds ``root[b]``."""

    history: jax.Array  # [batch, capacity] every token so far (prompt + emitted)
    lengths: jax.Array  # [batch] tokens in the target cache (the root is not yet)
    root: jax.Array  # [batch] last emitted token, first row of the next verify
    features: tuple[jax.Array, ...]  # the ``capture`` of the last cached row, [batch, hidden] each
    # Read-only: the target's cache, for drafters that attend to it (the Gemma 4 assistant).
    target_kv: KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CommitContext:
    base_lengths: jax.Array  # [batch] target cache length before the verify (position of the root)
    verify_tokens: jax.Array  # [batch, k+1]  root, d_1..d_k
    num_accepted: jax.Array  # [batch] in 0..k
    next_token: jax.Array  # [batch] correction / bonus token (the new root)
    features: tuple[jax.Array, ...]  # the ``capture`` of the verify rows, [batch, k+1, hidden] each
    # A tree round: the tree node ids of root, d_1..d_k (the accepted path, then zeros), [batch, k+1];
    # verify_tokens and features are then already taken along it. None after a chain round.
    path: jax.Array | None = None


@runtime_checkable
class Drafter(Protocol):
    """Everything a speculation round asks of a drafter. All of it is pure; ``prefill``,
    ``propose`` and ``commit`` run inside the jitted round. A drafter whose round drafts at most a
    fixed number of tokens (a block drafter) says so in an optional ``max_draft_tokens`` int
    attribute, checked against ``num_draft_tokens`` before any compute."""

    @property
    def capture(self) -> Capture:
        """The target hidden states the round captures for this drafter: ``PrefillContext``,
        ``RoundContext`` and ``CommitContext`` carry them as ``features``, in this order."""

    def check_compatible(self, target: AnyModel) -> None:
        """Raise ``ValueError`` naming what does not match (vocabulary, widths, family)."""

    def bind(self, target: AnyModel) -> Drafter:
        """The drafter specialised to ``target`` (shared embedding / LM head, captured layers
        that depend on its depth); itself where nothing is shared. Checks compatibility too."""

    def max_positions(self) -> int | None:
        """The largest position it can draft at (its own position limit), None for none."""

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> DraftState:
        """Initial state after the target prefill; own caches get ``max_len`` rows."""

    def propose(
        self, dstate: DraftState, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key: jax.Array
    ) -> tuple[jax.Array, jax.Array | None, DraftState]:
        """``(draft_tokens [batch, k] int32, draft_probs [batch, k, vocab] | None, dstate)``.

        ``draft_probs`` is the exact distribution each draft was drawn from, or None when
        drafting is deterministic (``q`` one-hot). The draft steps form one ``lax.scan``; the
        returned state may hold rows of drafts that ``commit`` rolls back.
        """

    def commit(self, dstate: DraftState, ctx: CommitContext) -> DraftState:
        """After verification: drop what the rejected drafts left, catch up on the accepted
        tokens. Afterwards the state is ready for the next ``propose``."""
