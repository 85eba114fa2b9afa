"""An independent small LM with its own KV cache drafts for the target (same vocabulary).

Chain drafting: k forwards a round. Cache invariant between rounds: the draft cache holds every
committed token except the last one (``target length - 1`` rows). ``propose`` feeds that last
committed token together with the root as its first step (two rows, one fixed shape for every
round: after a round that accepted all drafts, ``d_k`` was never fed, so its row does not exist
yet; otherwise the row is rewritten with identical values). ``commit`` restores the invariant by
truncation.

Parallel drafting (PARD, arXiv 2504.18583; AMD-AIG-AIMA/PARD): a draft model trained so that
``k - 1`` copies of its mask token (``pard_token``) after the root predict the tokens 2..k ahead
drafts all k in **one** forward. Its cache holds the committed tokens up to the root of the last
round (the mask rows never stay); ``propose`` feeds the committed tokens from ``k`` before the
root (those the last round accepted among them, the rest rewritten identically), the root, then
the mask tokens, 2k rows at one fixed shape; ``commit`` keeps the rows up to the root.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec import io
from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.execution import with_kernels
from jspec.io.safetensors import read_json
from jspec.kv import KVCache
from jspec.models import AnyModel, forward
from jspec.models.base import NO_CAPTURE, Capture
from jspec.sampling import SamplingParams, probabilities, sample
from jspec.tree import TreeShape, expand, feed_level


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModel:
    """Draft with a smaller ``Model`` (API); ``bind`` gives it the target's kernels."""

    model: AnyModel
    # PARD: the mask token whose copies after the root draft the later tokens (None: chain drafting).
    parallel_token: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def load(cls, path, *, dtype=None, parallel: bool = False) -> DraftModel:
        """A draft model from an HF checkpoint directory (as ``jspec.load_hf``); ``parallel``: a PARD
        draft, drafting a round in one forward with its ``config.json``'s ``pard_token``."""
        token = None
        if parallel:
            token = read_json(Path(path) / "config.json").get("pard_token")
            if token is None:
                raise ValueError(f"{path}: parallel=True needs a PARD checkpoint, whose config.json names its mask "
                                 "token as 'pard_token'")
        return cls(io.load_hf(path, dtype=dtype), parallel_token=token)

    @property
    def capture(self) -> Capture:
        return NO_CAPTURE

    def check_compatible(self, target: AnyModel) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocab_size {self.model.config.vocab_size} != target vocab_size {target.config.vocab_size}"
            )
        if self.parallel_token is not None and not 0 <= self.parallel_token < self.model.config.vocab_size:
            raise ValueError(f"pard_token {self.parallel_token} is outside the vocabulary "
                             f"[0, {self.model.config.vocab_size})")

    def bind(self, target: AnyModel) -> DraftModel:
        self.check_compatible(target)
        return dataclasses.replace(self, model=with_kernels(self.model, target.execution.kernels))

    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> KVCache:
        kv = self.model.init_cache(ctx.tokens.shape[0], max_len)
        _, _, kv = forward(self.model, ctx.tokens, kv, compute_logits=False)
        return kv.truncate(ctx.prompt_lengths - 1)

    def propose(self, kv: KVCache, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        if self.parallel_token is not None:
            return self._propose_parallel(kv, ctx, num_draft_tokens=num_draft_tokens, params=params, key=key)
        last_committed = jnp.take_along_axis(ctx.history, (ctx.lengths - 1)[:, None], axis=1)
        seed = jnp.concatenate([last_committed, ctx.root[:, None]], axis=1)  # [batch, 2] at lengths-1, lengths
        logits, _, kv = forward(self.model, seed, kv, logits_rows=jnp.ones_like(seed[:, :1]))
        logits = logits[:, 0]
        keys = jax.random.split(key, num_draft_tokens)
        first = sample(keys[0], logits, params)

        def step(carry, step_key):
            kv, token = carry
            step_logits, _, kv = forward(self.model, token[:, None], kv, logits_rows=jnp.zeros_like(token)[:, None])
            return (kv, sample(step_key, step_logits[:, 0], params)), (token, step_logits[:, 0])

        # Steps 1..k-1 each feed the previous draft; d_k itself is never fed.
        (kv, last), (fed, fed_logits) = jax.lax.scan(step, (kv, first), keys[1:])
        draft_tokens = jnp.concatenate([fed.T, last[:, None]], axis=1)
        if params.greedy:
            return draft_tokens, None, kv
        all_logits = jnp.concatenate([logits[:, None], fed_logits.transpose(1, 0, 2)], axis=1)
        return draft_tokens, probabilities(all_logits, params), kv

    def _propose_parallel(self, kv: KVCache, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams,
                          key):
        """PARD: rows ``start .. start + 2k - 1``, ``start = max(root position - k, 0)``: the committed
        tokens up to the root, then mask tokens; the drafts are the logits of the root's row and the
        ``k - 1`` after it."""
        k = num_draft_tokens
        if 2 * k > kv.max_len:
            raise ValueError(f"a parallel draft of k={k} feeds {2 * k} rows, more than its cache's {kv.max_len}")
        start = jnp.maximum(ctx.lengths - k, 0)  # [batch]
        positions = start[:, None] + jnp.arange(2 * k, dtype=jnp.int32)[None, :]
        committed = jnp.take_along_axis(ctx.history, jnp.minimum(positions, ctx.history.shape[1] - 1), axis=1)
        tokens = jnp.where(positions < ctx.lengths[:, None], committed, self.parallel_token)
        tokens = jnp.where(positions == ctx.lengths[:, None], ctx.root[:, None], tokens)
        root_row = (ctx.lengths - start)[:, None]
        logits, _, kv = forward(self.model, tokens, kv.truncate(start), logits_rows=root_row + jnp.arange(k)[None, :])
        draft_tokens = sample(key, logits, params)
        return draft_tokens, None if params.greedy else probabilities(logits, params), kv

    def propose_tree(self, kv: KVCache, ctx: RoundContext, *, shape: TreeShape, params: SamplingParams, key):
        """A draft tree (``jspec.tree.expand``) and the state ``commit`` needs to keep its accepted path.

        The nodes fed to the draft (the frontier of each level, ``topk`` per level) sit after the
        root at ``lengths + 1 + fed_row``. Each level runs the draft on all of the fed rows so far
        with tree attention (the ancestor mask among them): one fixed shape for every level, the
        earlier rows recomputed identically, no attention kernel beyond the tree mask.
        """
        del params, key  # tree drafts are the deterministic top-k children, whatever the sampling
        if self.parallel_token is not None:
            raise ValueError("a parallel (PARD) draft model drafts chains only (topk=1)")
        last_committed = jnp.take_along_axis(ctx.history, (ctx.lengths - 1)[:, None], axis=1)
        seed = jnp.concatenate([last_committed, ctx.root[:, None]], axis=1)  # [batch, 2] at lengths-1, lengths
        logits, _, kv = forward(self.model, seed, kv, logits_rows=jnp.ones_like(seed[:, :1]))
        batch, num_fed, topk = seed.shape[0], shape.fed_rows, shape.topk
        after_root = kv.lengths  # lengths + 1

        def step(carry, tokens, parent_slot, level):
            kv, fed_tokens, fed_mask = carry
            fed_mask, first = feed_level(fed_mask, parent_slot, level, topk)
            fed_tokens = jax.lax.dynamic_update_slice_in_dim(fed_tokens, tokens, first, axis=1)
            rows = first + jnp.arange(topk, dtype=jnp.int32)  # this level's fed rows
            # Rows not fed yet see only themselves: their outputs are never read.
            level_logits, _, kv = forward(self.model, fed_tokens, kv.truncate(after_root), tree_mask=fed_mask,
                                          logits_rows=jnp.broadcast_to(rows, (batch, topk)))
            return jax.nn.log_softmax(level_logits, axis=-1), (kv, fed_tokens, fed_mask)

        carry = (kv, jnp.zeros((batch, num_fed), jnp.int32), jnp.broadcast_to(jnp.eye(num_fed, dtype=bool),
                                                                              (batch, num_fed, num_fed)))
        tree, (kv, _, _), fed_row = expand(jax.nn.log_softmax(logits[:, 0], axis=-1), ctx.root, step, carry,
                                           topk=topk, depth=shape.depth, num_nodes=shape.num_nodes)
        return tree, TreeDraftState(kv, fed_row)

    def commit(self, dstate: KVCache | TreeDraftState, ctx: CommitContext) -> KVCache:
        """After a chain round ``dstate`` is the draft cache; after a tree round (``ctx.path``) the
        ``TreeDraftState`` of ``propose_tree``, whose accepted nodes' rows move behind the root in
        path order."""
        kv = dstate
        if ctx.path is not None:
            kv = dstate.kv
            path_rows = 1 + jnp.take_along_axis(dstate.fed_row, ctx.path, axis=1)  # [batch, depth+1], from the root
            kv = kv.move_rows(ctx.base_lengths, path_rows.at[:, 0].set(0))
        if self.parallel_token is not None:  # rows after the root held mask tokens
            return kv.truncate(ctx.base_lengths + 1)
        # The new target length is base + num_accepted + 1; keep one row fewer (the invariant).
        return kv.truncate(ctx.base_lengths + ctx.num_accepted)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeDraftState:
    """The draft cache after tree drafting and, per tree node, its fed row (``-1``: never fed)."""

    kv: KVCache
    fed_row: jax.Array  # [batch, n+1] int32
