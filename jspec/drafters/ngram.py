"""Prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's last
n tokens (the longest n from ``max_ngram`` down to ``min_ngram`` that occurs). Model-free and
deterministic (``q`` is one-hot); its state is empty.

``match="latest"`` (default) takes the most recent occurrence, the one most likely to continue
the current text; ``match="earliest"`` the first one, as HF transformers' prompt lookup
(``PromptLookupCandidateGenerator``) does: with ``max_ngram=2, min_ngram=1`` it drafts what HF
drafts (where HF's continuation stops at the end of the text, jspec pads with the root token)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.models import AnyModel
from jspec.models.base import NO_CAPTURE, Capture
from jspec.sampling import SamplingParams


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

    def propose(self, dstate, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        del params, key  # deterministic
        history, end = ctx.history, ctx.lengths  # the sequence is history[b, : end[b] + 1]
        capacity = history.shape[1]
        starts = jnp.arange(capacity, dtype=jnp.int32)[None, :]  # candidate match starts
        best_start = jnp.full(end.shape, -1, jnp.int32)  # where the continuation begins
        for n in range(self.min_ngram, self.max_ngram + 1):  # longer n-grams overwrite shorter
            suffix_start = end + 1 - n  # [batch]
            matches = (starts + n <= end[:, None]) & (suffix_start[:, None] >= 0)
            for j in range(n):
                suffix_tok = jnp.take_along_axis(history, jnp.maximum(suffix_start + j, 0)[:, None], axis=1)
                matches &= jnp.roll(history, -j, axis=1) == suffix_tok
            if self.match == "latest":
                chosen = jnp.max(jnp.where(matches, starts, -1), axis=1)
            else:
                chosen = jnp.min(jnp.where(matches, starts, capacity), axis=1)
                chosen = jnp.where(chosen < capacity, chosen, -1)
            best_start = jnp.where(chosen >= 0, chosen + n, best_start)
        # Continuation tokens must be known (index <= end); unknown slots repeat the root.
        offsets = best_start[:, None] + jnp.arange(num_draft_tokens, dtype=jnp.int32)[None, :]
        known = (best_start[:, None] >= 0) & (offsets <= end[:, None])
        tokens = jnp.take_along_axis(history, jnp.clip(offsets, 0, capacity - 1), axis=1)
        return jnp.where(known, tokens, ctx.root[:, None]), None, dstate

    def commit(self, dstate, ctx: CommitContext):
        return dstate
