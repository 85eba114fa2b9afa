"""A drafter with controlled acceptance, for benchmarks (built on the drafter protocol).

Random weights accept almost nothing, so speed-ups cannot be measured with them. ``Oracle``
proposes the target's own greedy continuation (precomputed), each token replaced by a wrong
one with probability ``1 - alpha``, while running a real drafter alongside so that the
round pays that drafter's compute. Under greedy verification the expected acceptance length
is ``(1 - alpha**(k+1)) / (1 - alpha)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Oracle:
    inner: Any  # the drafter whose compute is paid
    reference: jax.Array  # [batch, capacity] prompt + the target's greedy continuation
    alpha: jax.Array  # [] probability that each proposed token is the right one
    vocab_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def capture(self):
        return self.inner.capture

    def check_compatible(self, target) -> None:
        self.inner.check_compatible(target)

    def bind(self, target) -> Oracle:
        return dataclasses.replace(self, inner=self.inner.bind(target))

    def max_positions(self):
        return self.inner.max_positions()

    def prefill(self, ctx: PrefillContext, *, max_len: int):
        return self.inner.prefill(ctx, max_len=max_len)

    def propose(self, dstate, ctx: RoundContext, *, num_draft_tokens: int, params, key):
        inner_key, corrupt_key = jax.random.split(key)
        inner_tokens, _, dstate = self.inner.propose(
            dstate, ctx, num_draft_tokens=num_draft_tokens, params=params, key=inner_key
        )
        idx = ctx.lengths[:, None] + 1 + jnp.arange(num_draft_tokens, dtype=jnp.int32)[None, :]
        right = jnp.take_along_axis(self.reference, jnp.minimum(idx, self.reference.shape[1] - 1), axis=1)
        corrupt = jax.random.uniform(corrupt_key, right.shape) >= self.alpha
        # Wrong tokens derive from the inner drafter's output, so its compute is never dead code.
        wrong = (right + 1 + inner_tokens % (self.vocab_size - 1)) % self.vocab_size
        return jnp.where(corrupt, wrong, right), None, dstate

    def commit(self, dstate, ctx: CommitContext):
        return self.inner.commit(dstate, ctx)
