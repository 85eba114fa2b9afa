"""Shared machinery of the drafters that read the target's hidden states (EAGLE-3, MTP).

Both are one attention layer with its own KV cache, fed with the pair (token at ``j+1``,
hidden at ``j``) at draft row ``j`` (the pairing every engine uses; ggml-org/llama.cpp PR 22728
works an example), drafting by recycling their own hidden state. A subclass defines how a row's
token and hidden become the layer's residual and attention input (``layer_inputs``), what hidden
the next step recycles (``recycle``), the head (``head_logits``) and the map from draft to target
vocabulary.

Draft state (``HeadState``): the draft KV (``lengths`` = rows written with *target*
features, equal to the target's committed length) and ``hidden``: the layer output
(pre-final-norm) at the last committed row, from which the next round's first draft comes.

* prefill = catch-up over the prompt: rows ``0..n-1`` pair ``(t_1..t_{n-1}, first sampled
  token)`` with the target features ``g_0..g_{n-1}``.
* commit = catch-up over the verify rows: row ``r`` at position ``base + r`` pairs
  ``d_{r+1}`` (``r < a``) or the bonus token (``r = a``) with the target feature of verify
  row ``r``. All ``k+1`` rows write their K/V; right after the K/V write each sequence keeps
  only row ``a`` (query, residual, MLP, and later the final norm and head); rows past ``a`` are
  dropped by the draft length ``base + a + 1`` -- nothing is copied. Commit is also where the
  rows ``propose`` drafted are rolled back (the cache is truncated to ``base`` first).
* propose: step 0 drafts from ``hidden`` (no forward: the catch-up was the seed step), steps
  ``1..k-1`` feed ``(d_i, recycled hidden)`` at positions ``L .. L+k-2`` in one unrolled ``lax.scan``.
* propose_tree (``topk > 1``, ``jspec.tree.expand``): the root's children come from ``hidden``; a
  node at tree depth ``d`` is fed with its parent's recycled hidden at position ``L + d - 1`` (where
  the chain feeds ``d_d``), attending to the committed rows and its fed ancestors (tree mask). Its
  rows lie past ``L`` like the chain's drafts, so ``commit`` is the same after either round.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.kv import KVCache
from jspec.layers import add_norm
from jspec.models import llama
from jspec.models.llama import LlamaConfig, decoder_layer
from jspec.sampling import SamplingParams, probabilities, sample
from jspec.step import Step, row_positions
from jspec.tree import DraftTree, TreeShape, expand, feed_level


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadState:
    kv: KVCache  # one layer; lengths = rows written with target features
    hidden: jax.Array  # [batch, hidden] layer output (pre-norm) at the last committed row


def catch_up_tokens(verify_tokens, num_accepted, next_token):
    """Row ``r`` of the catch-up pairs the token at ``base + r + 1``: ``d_{r+1}`` for ``r < a``,
    the bonus for ``r = a``, junk after. ``[batch, k+1]``."""
    shifted = jnp.concatenate([verify_tokens[:, 1:], next_token[:, None]], axis=1)
    slot = jnp.arange(shifted.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(slot == num_accepted[:, None], next_token[:, None], shifted)


def require_llama_target(target, drafter: str) -> None:
    """The EAGLE-3 and MTP heads here read the target's raw embedding table and LM head and
    its residual stream with Llama semantics (no Gemma embedding scale, softcap or PLE)."""
    if not isinstance(target, llama.Model):
        raise ValueError(
            f"{drafter} drafting supports Llama / Qwen targets only, not {target.config.architecture} "
            "(use jspec.drafters.DraftModel or NGram for it)"
        )


class HiddenStateDrafter(abc.ABC):
    """Base of the one-layer heads over target features: prefill / propose / propose_tree / commit
    written once. A subclass (a registered pytree dataclass with an ``execution`` field, set by
    ``bind``) says what its layer is and how rows enter and leave it (the abstract members below).
    Shapes: ``B`` sequences, ``T`` rows, ``H`` the head's width, ``F`` the target features' width."""

    @property
    @abc.abstractmethod
    def layer(self) -> llama.Layer:
        """The head's decoder layer (Llama form, its own KV cache)."""

    @property
    @abc.abstractmethod
    def layer_config(self) -> LlamaConfig:
        """The config the layer runs with (widths, RoPE, norm eps, the draft vocabulary)."""

    @abc.abstractmethod
    def layer_inputs(self, tokens, g, from_target: bool):
        """``(residual [B, T, H], attention input [B, T, in])`` for rows of ``tokens [B, T]``
        and hidden ``g [B, T, F]`` (target features when ``from_target``, else recycled hidden)."""

    @abc.abstractmethod
    def recycle(self, x):
        """What a draft step feeds the next one as its hidden, from the layer output ``x [..., H]``."""

    @abc.abstractmethod
    def head_logits(self, x):
        """fp32 logits over the draft vocabulary ``[..., V_d]`` for layer outputs ``x [..., H]``."""

    @abc.abstractmethod
    def to_target(self, ids):
        """Draft-vocabulary ids -> target ids (identity without a reduced vocabulary)."""

    @abc.abstractmethod
    def draft_vocab_to_target(self, logits):
        """``[..., V_d]`` logits -> ``[..., V]`` over the target vocabulary, -inf off the draft vocabulary."""

    @abc.abstractmethod
    def target_features(self, features):
        """The captured target features (``capture``'s order) -> the ``g [B, T, F]`` the layer reads."""

    # --- the layer over rows ----------------------------------------------------------

    def run_rows(self, kv: KVCache, tokens, g, *, from_target: bool, keep_rows=None, tree_mask=None):
        """Run rows ``tokens [B, T]`` / hidden ``g [B, T, F]`` at positions ``kv.lengths + 0..T-1``.

        Writes the K/V of all ``T`` rows; returns ``(x, kv)`` with ``x`` the layer output
        ``[B, T, H]`` (or ``[B, H]`` at ``keep_rows [B]``, sliced right after the K/V write)
        and ``kv.lengths`` advanced by ``T``. ``tree_mask [B, T, T]``: the rows attend to the
        cached rows and to the rows the mask shows them, and sit at ``kv.lengths`` plus the rows
        they see, minus one (a causal mask gives the chain's positions).
        """
        c: LlamaConfig = self.layer_config
        num_rows = tokens.shape[1]
        step = Step.make(row_positions(kv.lengths, num_rows, tree_mask), kv.lengths + num_rows, c.rope_inv_freq(),
                         kv.k[0].dtype, self.execution, tree_mask=tree_mask, keep_rows=keep_rows)
        resid, attn_in = self.layer_inputs(tokens, g, from_target)
        residual, cache = decoder_layer(self.layer, c, resid, attn_in, (kv.k[0], kv.v[0]), step)
        x, _ = add_norm(residual, None, c.rms_norm_eps, self.execution)
        return (x[:, 0] if keep_rows is not None else x), kv.written([cache], num_rows)

    def init_kv(self, batch: int, max_len: int, dtype) -> KVCache:
        c = self.layer_config
        return KVCache.zeros(1, batch, c.num_kv_heads, max_len, c.head_dim, dtype)

    def catch_up(self, kv: KVCache, base, tokens, features, last_row) -> HeadState:
        """Rewrite the draft rows ``base .. base+T-1`` with target features and keep row
        ``last_row [B]``: returns ``HeadState`` with lengths ``base + last_row + 1``. Rows past
        ``base`` (drafts of the last ``propose``) are rolled back first."""
        g = self.target_features(features)
        x, kv = self.run_rows(kv.truncate(base), tokens, g, from_target=True, keep_rows=last_row)
        return HeadState(kv=kv.truncate(base + last_row + 1), hidden=x)

    # --- protocol ---------------------------------------------------------------------

    def max_positions(self) -> None:
        return None  # positions are the target's; RoPE has no hard limit

    def prefill(self, ctx: PrefillContext, *, max_len: int) -> HeadState:
        batch, width = ctx.tokens.shape
        kv = self.init_kv(batch, max_len, self.layer.o.dtype)
        last = ctx.prompt_lengths - 1
        shifted = jnp.concatenate([ctx.tokens[:, 1:], jnp.zeros((batch, 1), ctx.tokens.dtype)], axis=1)
        tokens = jnp.where(jnp.arange(width)[None, :] == last[:, None], ctx.next_token[:, None], shifted)
        return self.catch_up(kv, jnp.zeros((batch,), jnp.int32), tokens, ctx.features, last)

    def propose(self, dstate: HeadState, ctx: RoundContext, *, num_draft_tokens: int, params: SamplingParams, key):
        keys = jax.random.split(key, num_draft_tokens)

        def draw(step_key, x):
            logits = self.head_logits(x)  # [B, V_draft] fp32
            if params.greedy:
                return self.to_target(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
            full = self.draft_vocab_to_target(logits)  # [B, V] with -inf off the draft vocab
            return sample(step_key, full, params), probabilities(full, params)

        def step(carry, step_key):
            kv, x = carry
            token, probs = draw(step_key, x)
            x_next, kv = self.run_rows(kv, token[:, None], self.recycle(x)[:, None], from_target=False)
            return (kv, x_next[:, 0]), (token, probs)

        # Unrolled: one layer a step and a handful of steps, so the copies cost little compile time,
        # while a rolled loop launches its own bookkeeping kernels around every step (counter,
        # output row write, condition).
        (kv, x), (tokens, probs) = jax.lax.scan(step, (dstate.kv, dstate.hidden), keys[:-1], unroll=True)
        last, last_probs = draw(keys[-1], x)
        draft_tokens = jnp.concatenate([tokens.T, last[:, None]], axis=1)
        new_state = HeadState(kv=kv, hidden=dstate.hidden)
        if params.greedy:
            return draft_tokens, None, new_state
        draft_probs = jnp.concatenate([probs.transpose(1, 0, 2), last_probs[:, None]], axis=1)
        return draft_tokens, draft_probs, new_state

    def log_probs(self, x):
        """fp32 log-probabilities over the *target* vocabulary ``[..., V]`` of layer outputs
        ``x [..., H]`` (``-inf`` off the draft vocabulary)."""
        return jax.nn.log_softmax(self.draft_vocab_to_target(self.head_logits(x)), axis=-1)

    def propose_tree(
        self, dstate: HeadState, ctx: RoundContext, *, shape: TreeShape, params: SamplingParams, key
    ) -> tuple[DraftTree, HeadState]:
        """A draft tree (``jspec.tree.expand``) and the state ``commit`` takes, as after ``propose``.

        The root's children come from ``dstate.hidden``. Level ``l``'s frontier node ``j`` is fed
        with its parent's recycled hidden at draft row ``L + (l-1) * topk + j`` (``L`` committed
        rows), position ``L + l - 1``. Each level reruns all fed rows with the ancestor mask among them (rows not
        fed yet see only themselves and are never read): a tree mask covers only the rows of one
        forward, so a level attends to earlier levels' rows by running them again, identically.
        That keeps one fixed shape for every level, at the price of ``fed_rows`` rows per level
        instead of ``topk``: one layer over a few dozen rows, small beside the target's verify.
        """
        del params, key  # tree drafts are the deterministic top-k children, whatever the sampling
        draft_vocab = jax.eval_shape(self.head_logits, dstate.hidden).shape[-1]
        if shape.topk > draft_vocab:
            raise ValueError(f"topk={shape.topk} exceeds the draft vocabulary size {draft_vocab}")
        batch, topk, num_fed = dstate.hidden.shape[0], shape.topk, shape.fed_rows
        committed = dstate.kv.lengths

        def step(carry, tokens, parent_slot, level):
            kv, fed_tokens, fed_hidden, fed_mask, frontier_x = carry
            fed_mask, first = feed_level(fed_mask, parent_slot, level, topk)
            parent_x = jnp.take_along_axis(frontier_x, parent_slot[:, :, None], axis=1)  # [batch, topk, H]
            fed_tokens = jax.lax.dynamic_update_slice_in_dim(fed_tokens, tokens, first, axis=1)
            fed_hidden = jax.lax.dynamic_update_slice_in_dim(fed_hidden, self.recycle(parent_x), first, axis=1)
            x, kv = self.run_rows(kv.truncate(committed), fed_tokens, fed_hidden, from_target=False,
                                  tree_mask=fed_mask)
            frontier_x = jax.lax.dynamic_slice_in_dim(x, first, topk, axis=1)
            return self.log_probs(frontier_x), (kv, fed_tokens, fed_hidden, fed_mask, frontier_x)

        recycled = jax.eval_shape(self.recycle, dstate.hidden)  # [batch, H], what a fed row reads as its hidden
        carry = (
            dstate.kv,
            jnp.zeros((batch, num_fed), jnp.int32),
            jnp.zeros((batch, num_fed, recycled.shape[-1]), recycled.dtype),
            jnp.broadcast_to(jnp.eye(num_fed, dtype=bool), (batch, num_fed, num_fed)),
            jnp.broadcast_to(dstate.hidden[:, None], (batch, topk, dstate.hidden.shape[-1])),  # level 1: the root's
        )
        tree, (kv, *_), _ = expand(self.log_probs(dstate.hidden), ctx.root, step, carry, topk=topk, depth=shape.depth,
                                   num_nodes=shape.num_nodes)
        return tree, HeadState(kv=kv, hidden=dstate.hidden)

    def commit(self, dstate: HeadState, ctx: CommitContext) -> HeadState:
        tokens = catch_up_tokens(ctx.verify_tokens, ctx.num_accepted, ctx.next_token)
        return self.catch_up(dstate.kv, ctx.base_lengths, tokens, ctx.features, ctx.num_accepted)
