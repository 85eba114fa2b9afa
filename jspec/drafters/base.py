"""The drafter protocol and the contexts a speculation round hands to a drafter.

A drafter is a pytree (its parameters are leaves, its settings static) with:

* ``capture``: the target hidden states it reads (``forward``'s ``capture=`` keys).
* ``prefill(ctx: PrefillContext, *, max_len) -> dstate``: after the target prefill and the
  first sampled token (``ctx.next_token``).
* ``propose(dstate, ctx: RoundContext, *, num_draft_tokens, params, key)
  -> (draft_tokens [batch, k] int32, draft_probs [batch, k, vocab] | None, dstate)``:
  ``draft_probs`` is the exact distribution each draft token was drawn from, or ``None``
  when drafting is deterministic (one-hot ``q``). The draft steps form one ``lax.scan``.
* ``commit(dstate, ctx: CommitContext) -> dstate``: after verification, catch up on the
  accepted tokens.
* ``check_compatible(target)``: raise ``ValueError`` when it cannot draft for ``target``.
* ``bind(target) -> drafter`` (optional): the drafter specialised to ``target`` (drafters that
  share the target's embedding / LM head, or whose captured layers depend on its depth).
  ``speculative_generate`` calls it after ``check_compatible``; callers that run
  ``speculative_round`` themselves call it once.

All three functions are pure and run inside the jitted round.
"""

from __future__ import annotations

import dataclasses

import jax

from jspec.kv import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillContext:
    tokens: jax.Array  # [batch, width] right-padded prompts
    prompt_lengths: jax.Array  # [batch]
    features: tuple[jax.Array, ...]  # captured target features, [batch, width, hidden] each
    # [batch] the first sampled token (at position prompt_lengths[b]); None where unknown
    next_token: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundContext:
    """What a drafter may read when proposing. Position ``lengths[b]`` holds ``root[b]``."""

    history: jax.Array  # [batch, capacity] every token so far (prompt + emitted)
    lengths: jax.Array  # [batch] tokens in the target cache (the root is not yet)
    root: jax.Array  # [batch] last emitted token, first row of the next verify
    features: tuple[jax.Array, ...]  # target features of the last cached row, [batch, hidden] each
    target_kv: KVCache  # read-only


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CommitContext:
    base_lengths: jax.Array  # [batch] target cache length before the verify (position of the root)
    verify_tokens: jax.Array  # [batch, k+1]  root, d_1..d_k
    num_accepted: jax.Array  # [batch] in 0..k
    next_token: jax.Array  # [batch] correction / bonus token (the new root)
    features: tuple[jax.Array, ...]  # target features of the verify rows, [batch, k+1, hidden] each
