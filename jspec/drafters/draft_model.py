"""An independent small LM with its own KV cache drafts for the target (same vocabulary).

Cache invariant between rounds: the draft cache holds every committed token except the last
one (``target length - 1`` rows). ``propose`` feeds that last committed token together with
the root as its first step (two rows, one fixed shape for every round: after a round that
accepted all drafts, ``d_k`` was never fed, so its row does not exist yet; otherwise the row is
rewritten with identical values). ``commit`` restores the invariant by truncation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import io
from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.kv import KVCache
from jspec.models import AnyModel, forward
from jspec.models.base import NO_CAPTURE, Capture
from jspec.sampling import SamplingParams, probabilities, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Draft with a smaller ``Model`` (API); ``impl`` picks the kernels of its forward."""

    model: AnyModel
    impl: str = dataclasses.field(default="auto", metadata=dict(static=True))

    @classmethod
    def load(cls, path, *, dtype=None, impl: str = "auto") -> DraftModel:
        """A draft model from an HF checkpoint directory (as ``jspec.load_hf``)."""
        return cls(io.load_hf(path, dtype=dtype), impl=impl)

    @property
    def capture(self) -> Capture:
        return NO_CAPTURE

    def check_compatible(self, target: AnyModel) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab_size {self.model.config.vocab_size} != target vocab_size {target.config.vocab_size}"
            )

    def bind(self, target: AnyModel) -> DraftModel:
        self.check_compatible(target)
        return self

    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> KVCache:
        kv = self.model.init_cache(ctx.tokens.shape[0], max_len)
        _, _, kv = forward(self.model, ctx.tokens, kv, compute_logits=False, impl=self.impl)
        return kv.truncate(ctx.prompt_lengths - 1)

    def propose(self, kv: KVCache, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        last_committed = jnp.take_along_axis(ctx.history, (ctx.lengths - 1)[:, None], axis=1)
        seed = jnp.concatenate([last_committed, ctx.root[:, None]], axis=1)  # [batch, 2] at lengths-1, lengths
        logits, _, kv = forward(
            self.model, seed, kv, logits_rows=jnp.ones_like(seed[:, :1]), impl=self.impl
        )
        logits = logits[:, 0]
        keys = jax.random.split(key, num_draft_tokens)
        first = sample(keys[0], logits, params)

        def step(carry, step_key):
            kv, token = carry
            step_logits, _, kv = forward(
                self.model, token[:, None], kv, logits_rows=jnp.zeros_like(token)[:, None], impl=self.impl
            )
            return (kv, sample(step_key, step_logits[:, 0], params)), (token, step_logits[:, 0])

        # Steps 1..k-1 each feed the previous draft; d_k itself is never fed.
        (kv, last), (fed, fed_logits) = jax.lax.scan(step, (kv, first), keys[1:])
        draft_tokens = jnp.concatenate([fed.T, last[:, None]], axis=1)
        if params.greedy:
            return draft_tokens, None, kv
        all_logits = jnp.concatenate([logits[:, None], fed_logits.transpose(1, 0, 2)], axis=1)
        return draft_tokens, probabilities(all_logits, params), kv

    def commit(self, kv: KVCache, ctx: CommitContext) -> KVCache:
        # The new target length is base + num_accepted + 1; keep one row fewer (the invariant).
        return kv.truncate(ctx.base_lengths + ctx.num_accepted)
