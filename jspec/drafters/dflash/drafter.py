"""DFlash (arXiv 2602.06036; z-lab/dflash): a whole block of drafts in one forward of a small
draft conditioned on the target's hidden states.

A round (``jspec.speculative``), for a target cache of ``L`` rows whose last emitted token
``root`` sits at position ``L``:

* propose: the block ``[root, mask x (B-1)]`` at positions ``L .. L+B-1`` runs through the draft
  once (:func:`jspec.drafters.dflash.head.block_hidden`); the target's LM head turns slots
  ``1..k`` into the drafts' distributions (``k = num_draft_tokens <= B - 1``). Greedy drafts are
  their argmax; sampled drafts are drawn from them and returned as ``draft_probs``, so
  verification keeps the target's distribution exactly at any temperature.
* commit: the verify captured the target's layer outputs of ``root, d_1..d_k``; the accepted ones
  (``root, d_1..d_a``) become context rows ``L .. L+a``. All ``k + 1`` rows are written and the
  length set to ``L + a + 1``: rows past it are dead and the next write overwrites them.
* prefill: the prompt's rows become context rows ``0 .. n-1``; the first sampled token is the first
  block's slot 0.

Draft state: the context :class:`~jspec.kv.KVCache` (its ``lengths`` equal the target's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.drafters.dflash.checkpoint import load_head
from jspec.drafters.dflash.head import DFlashHead, block_hidden, context_vectors, init_context_kv, write_context
from jspec.execution import DEFAULT, Execution
from jspec.kv import KVCache
from jspec.models import AnyModel, TokenIO, gemma4, llama, token_io
from jspec.models.base import Capture
from jspec.sampling import SamplingParams, probabilities, sample
from jspec.tree import TreeShape, expand


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlash:
    """DFlash drafter (API): ``DFlash.load(path)`` or ``DFlash(head)``; ``bind(target)`` (done by
    ``speculative_generate``) attaches the target's embedding and LM head and its kernels."""

    head: DFlashHead
    target: TokenIO | None = None  # the target's embedding and LM head, set by bind
    # The target's depth, set by bind (default: the checkpoint's num_target_layers).
    target_depth: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    # The target's kernels, set by bind (one impl= for target and drafter); never a placement.
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))

    @classmethod
    def load(cls, path, *, dtype=None) -> DFlash:
        """The drafter from a DFlash checkpoint directory (``jspec.drafters.dflash.checkpoint``)."""
        return cls(load_head(path, dtype=dtype))

    @property
    def config(self):
        return self.head.config

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts one block makes: ``block_size - 1``."""
        return self.config.max_draft_tokens

    # --- protocol ---------------------------------------------------------------------

    @property
    def capture(self) -> Capture:
        """The outputs of ``target_layer_ids`` (HF ``hidden_states[i + 1]``): the residual stream
        entering layer ``i + 1``, or for the last layer the final-normed hidden, as HF's last
        ``hidden_states`` entry is."""
        last = self._last_layer()
        return Capture(residuals=tuple(i + 1 for i in self.config.target_layer_ids if i != last),
                       final_normed=last in self.config.target_layer_ids)

    def _last_layer(self) -> int:
        return (self.target_depth or self.config.num_target_layers) - 1

    def context(self, features: tuple[jax.Array, ...]) -> jax.Array:
        """The context vectors ``[batch, T, H]`` of ``capture``'s features (put back in
        ``target_layer_ids``' order)."""
        ids, last = self.config.target_layer_ids, self._last_layer()
        residual_ids = [i for i in ids if i != last]
        ordered = tuple(features[-1] if i == last else features[residual_ids.index(i)] for i in ids)
        return context_vectors(self.head, ordered, self.execution)

    def max_positions(self) -> None:
        return None  # positions are the target's; RoPE has no hard limit

    def check_compatible(self, target: AnyModel) -> None:
        if not isinstance(target, (llama.Model, gemma4.Model)):
            raise ValueError(f"DFlash needs a Llama / Qwen2 / Qwen3 or Gemma 4 target, got {type(target).__name__}")
        config, tc = self.config, target.config
        if config.layer.vocab_size != tc.vocab_size:
            raise ValueError(f"DFlash vocab_size {config.layer.vocab_size} != target vocab_size {tc.vocab_size}")
        if config.hidden_size != tc.hidden_size:
            raise ValueError(f"DFlash hidden_size {config.hidden_size} != target hidden_size {tc.hidden_size}: "
                             "the draft embeds its block with the target's embedding")
        bad = [i for i in config.target_layer_ids if not 0 <= i < tc.num_layers]
        if bad:
            raise ValueError(f"DFlash target_layer_ids {list(config.target_layer_ids)} are out of range for a target "
                             f"with {tc.num_layers} layers (valid: 0..{tc.num_layers - 1})")

    def bind(self, target: AnyModel) -> DFlash:
        self.check_compatible(target)
        return dataclasses.replace(self, target=token_io(target), target_depth=target.config.num_layers,
                                   execution=Execution(target.execution.kernels))

    def token_io(self) -> TokenIO:
        """The target's embedding and LM head (``bind`` attaches them)."""
        if self.target is None:
            raise ValueError("DFlash: call drafter.bind(target) first (it drafts with the target's embedding and "
                             "LM head)")
        return self.target

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> KVCache:
        # A block writes B rows past the committed ones (a verify only k + 1): room for them.
        kv = init_context_kv(self.head, ctx.tokens.shape[0], max_len + self.config.block_size)
        kv = write_context(self.head, kv, self.context(ctx.features), self.execution)
        return kv.truncate(ctx.prompt_lengths)

    def propose(self, dstate: KVCache, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        k, config = num_draft_tokens, self.config
        if k > config.max_draft_tokens:
            raise ValueError(f"num_draft_tokens={k} exceeds what a DFlash block of {config.block_size} drafts "
                             f"(block_size - 1 = {config.max_draft_tokens})")
        logits, kv = self._block(dstate, ctx.root)
        logits = logits[:, :k]
        return sample(key, logits, params), None if params.greedy else probabilities(logits, params), kv

    def propose_tree(self, dstate: KVCache, ctx: RoundContext, *, shape: TreeShape, params: SamplingParams, key):
        """A draft tree (``jspec.tree.expand``) from one block forward: slot ``l``'s distribution gives
        the children of every level ``l - 1`` node, scored by cumulative log-probability. A block's slots
        never see the drafts before them, so every node of a level has the same candidate children; the
        tree keeps several tokens for an uncertain slot where a chain keeps one."""
        del params, key  # tree drafts are the deterministic top-k children, whatever the sampling
        if shape.depth > self.config.max_draft_tokens:
            raise ValueError(f"depth={shape.depth} exceeds what a DFlash block of {self.config.block_size} drafts "
                             f"(block_size - 1 = {self.config.max_draft_tokens})")
        logits, kv = self._block(dstate, ctx.root)
        logprobs = jax.nn.log_softmax(logits[:, : shape.depth].astype(jnp.float32), axis=-1)  # [batch, depth, V]

        def step(carry, tokens, parent_slot, level):  # level l's frontier: the children are slot l + 1's
            del parent_slot
            slot = jax.lax.dynamic_index_in_dim(logprobs, level, axis=1, keepdims=False)
            return jnp.broadcast_to(slot[:, None], (*tokens.shape, slot.shape[-1])), carry

        tree, _, _ = expand(logprobs[:, 0], ctx.root, step, (), topk=shape.topk, depth=shape.depth,
                            num_nodes=shape.num_nodes)
        return tree, kv

    def block_logits(self, dstate: KVCache, root: jax.Array) -> jax.Array:
        """The draft's fp32 logits ``[batch, B-1, vocab]`` of block slots ``1..B-1``, for the block
        ``[root, mask x (B-1)]`` at positions ``dstate.lengths + 0..B-1``; ``root [batch]``."""
        return self._block(dstate, root)[0]

    def _block(self, dstate: KVCache, root: jax.Array) -> tuple[jax.Array, KVCache]:
        io, config = self.token_io(), self.config
        block = jnp.concatenate([root[:, None].astype(jnp.int32),
                                 jnp.full((root.shape[0], config.block_size - 1), config.mask_token_id, jnp.int32)],
                                axis=1)
        hidden, kv = block_hidden(self.head, dstate, io.embed_tokens(block).astype(self.head.dtype), self.execution)
        return io.logits(hidden[:, 1:], self.execution), kv

    def commit(self, dstate: KVCache, ctx: CommitContext) -> KVCache:
        kv = dstate.truncate(ctx.base_lengths)
        kv = write_context(self.head, kv, self.context(ctx.features), self.execution)
        return kv.truncate(ctx.base_lengths + ctx.num_accepted + 1)
