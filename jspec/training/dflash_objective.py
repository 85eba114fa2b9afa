"""The DFlash training objective (arXiv 2602.06036; SpecForge's and speculators' recipes agree),
through the drafter's own inference functions: the context K/V of every position of a window
(``write_context``, what ``prefill`` runs) and one block forward per anchor (``block_hidden``,
what ``propose`` runs). There is one definition of the draft's forward.

Anchor ``a`` forms the block ``[x_a, MASK x (B-1)]`` at positions ``a .. a+B-1``; its queries see
the context rows ``< a`` and their own block, nothing else (each anchor a sequence of its own,
its cache the window's context rows truncated at ``a``). Slot ``j`` predicts the token at
``a + j``; its label is the target's greedy token after position ``a + j - 1`` (what greedy
verification accepts there), or with ``probs`` the target's whole distribution (distillation).
Slot ``j``'s loss is weighted ``exp(-(j - 1) / gamma)``: an early slot's miss ends the round.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.drafters.dflash.head import block_hidden, write_context
from jspec.kv import KVCache
from jspec.training.objective import cross_entropy, with_params


def block_logits(drafter, tokens, features, anchors):
    """The draft's fp32 logits ``[batch * A, B - 1, vocab]`` of every anchor's block; anchor ``i`` is
    sequence ``i // A``'s row ``anchors.reshape(-1)[i]``. Arguments as :func:`block_losses`."""
    batch, width = tokens.shape
    head, config, ex = drafter.head, drafter.config, drafter.execution
    context_kv = KVCache.zeros(config.layer.num_layers, batch, config.layer.num_kv_heads,
                               width + config.block_size, config.layer.head_dim, head.dtype)
    context_kv = write_context(head, context_kv, drafter.context(features), ex)
    seq = jnp.repeat(jnp.arange(batch), anchors.shape[1])
    anchor = anchors.reshape(-1).astype(jnp.int32)
    anchor_kv = KVCache(k=tuple(k[seq] for k in context_kv.k), v=tuple(v[seq] for v in context_kv.v), lengths=anchor)
    block = jnp.full((anchor.shape[0], config.block_size), config.mask_token_id, jnp.int32)
    block = block.at[:, 0].set(tokens[seq, anchor])
    io = drafter.token_io()
    hidden, _ = block_hidden(head, anchor_kv, io.embed_tokens(block).astype(head.dtype), ex)
    return io.logits(hidden[:, 1:], ex)


def block_losses(drafter, tokens, features, labels, lengths, anchors, *, probs=None):
    """Per block slot ``j = 1 .. B-1``: summed loss, correct top-1 predictions, counted rows; three
    ``[B - 1]`` arrays.

    Args:
      drafter: a DFlash drafter bound to a target on ``xla`` kernels (the kernels have no gradients).
      tokens: ``[batch, T]`` int32 windows of text.
      features: the target's captures over ``tokens`` (``drafter.capture``).
      labels: ``[batch, T]`` int32, the target's greedy token after each position (-1: none).
      lengths: ``[batch]`` valid tokens per window.
      anchors: ``[batch, A]`` int32 block starts (a block whose slot falls past the window counts
        nowhere there).
      probs: optional ``[batch, T, V]``, the target's next-token distribution after each position:
        soft labels (``labels`` then only score the top-1).
    """
    batch = tokens.shape[0]
    logits = block_logits(drafter, tokens, features, anchors)  # [batch * A, B - 1, V]
    seq = jnp.repeat(jnp.arange(batch), anchors.shape[1])[:, None]
    before = anchors.reshape(-1, 1) + jnp.arange(logits.shape[1])[None, :]  # slot j: the position a + j - 1
    row = jnp.minimum(before, tokens.shape[1] - 1)
    valid = before + 1 < lengths[seq]
    target_probs = None if probs is None else probs[seq, row]
    per_slot = [cross_entropy(logits[:, j], labels[seq, row][:, j], valid[:, j],
                              None if target_probs is None else target_probs[:, j]) for j in range(logits.shape[1])]
    return tuple(jnp.stack(t) for t in zip(*per_slot))


def dflash_loss_fn(params, drafter, batch, *, gamma: float):
    """Mean loss per slot weighted ``exp(-(j - 1) / gamma)`` and normalised by the weights, and
    metrics. ``batch``: dict of the :func:`block_losses` arrays (``probs`` optional)."""
    drafter = with_params(drafter, params)
    loss, correct, count = block_losses(drafter, batch["tokens"], batch["features"], batch["labels"],
                                        batch["lengths"], batch["anchors"], probs=batch.get("probs"))
    count = jnp.maximum(count, 1)
    weights = jnp.exp(-jnp.arange(loss.shape[0], dtype=jnp.float32) / gamma)
    total = jnp.sum(weights * loss / count) / jnp.sum(weights)
    return total, dict(loss=loss / count, accuracy=correct / count)
