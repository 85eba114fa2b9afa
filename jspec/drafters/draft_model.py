"""An independent small LM with its own KV cache drafts for the target (same vocabulary)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.kv import KVCache
from jspec.models import AnyModel as Model, forward
from jspec.sampling import SamplingParams, probabilities, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Draft with a smaller ``Model``; ``impl`` picks the kernels of its forward."""

    model: Model
    impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

    capture = ()

    def check_compatible(self, target: Model) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab_size {self.model.config.vocab_size} != target vocab_size {target.config.vocab_size}"
            )

    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> KVCache:
        kv = self.model.init_cache(ctx.tokens.shape[0], max_len)
        _, _, kv = forward(self.model, ctx.tokens, kv, logits_rows=(), impl=self.impl)
        return kv.truncate(ctx.prompt_lengths)

    def propose(self, kv: KVCache, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        # The draft cache holds every committed token except possibly the last one (after a
        # round that accepted all drafts, d_k was never fed). The seed step therefore
        # re-feeds the last committed token together with the root; rewriting an existing
        # row stores identical values.
        last_committed = jnp.take_along_axis(ctx.history, (ctx.lengths - 1)[:, None], axis=1)
        kv = dataclasses.replace(kv, lengths=ctx.lengths - 1)
        seed = jnp.concatenate([last_committed, ctx.root[:, None]], axis=1)  # [batch, 2]
        logits, _, kv = forward(self.model, seed, kv, logits_rows=jnp.ones_like(ctx.lengths), impl=self.impl)
        keys = jax.random.split(key, num_draft_tokens)
        first = sample(keys[0], logits, params)

        def step(carry, step_key):
            kv, token = carry
            logits, _, kv = forward(
                self.model, token[:, None], kv, logits_rows=jnp.zeros_like(token), impl=self.impl
            )
            return (kv, sample(step_key, logits, params)), (token, logits)

        # Steps 1..k-1 each feed the previous draft; d_k itself is never fed.
        (kv, last), (fed, fed_logits) = jax.lax.scan(step, (kv, first), keys[1:])
        draft_tokens = jnp.concatenate([fed.T, last[:, None]], axis=1)
        if params.greedy:
            return draft_tokens, None, kv
        all_logits = jnp.concatenate([logits[:, None], fed_logits.transpose(1, 0, 2)], axis=1)
        return draft_tokens, probabilities(all_logits, params), kv

    def commit(self, kv: KVCache, ctx: CommitContext) -> KVCache:
        # Rows of rejected drafts are dropped by the seed step's length reset; nothing to do.
        return kv
