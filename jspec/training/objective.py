"""The training objective of a hidden-state draft head (EAGLE-3, MTP), through the drafter's own
inference functions: ``run_rows`` (the head's layer over rows with its KV cache) and
``head_logits``. There is one definition of the head's forward; training runs it

* over all rows of a window at once (step 0, target features: what ``prefill`` / ``commit`` run),
* then for ``steps - 1`` more steps at ``anchors`` (the EAGLE-3 paper's training-time test): each
  anchor row becomes a sequence of its own whose cache holds the step-0 rows up to the anchor,
  and each step feeds one row (the next true token, the head's own recycled hidden) exactly as
  ``propose`` does, so step ``j`` is trained on the inputs it sees at draft step ``j``.

Row ``r`` of step 0 pairs the token at ``r + 1`` with the target feature at ``r`` and predicts the
token at ``r + 2``; step ``j`` from anchor ``r`` predicts the token at ``r + 2 + j``. The label is
the target's own next-token choice there (``labels[:, i]``: the target's greedy token after
position ``i``, in the target vocabulary), so the head learns what greedy verification accepts;
or, with ``probs``, the target's whole next-token distribution over the draft vocabulary
(distillation, SpecForge's EAGLE-3 objective): a richer signal per row, and the one rejection
sampling's acceptance ``sum(min(p, q))`` rewards.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.kv import KVCache

# Integer leaves of a head (the reduced-vocabulary map): kept, never trained.
_FROZEN_FIELDS = ("d2t",)


def trainable_params(drafter):
    """The head's parameters that training updates (its integer maps set aside)."""
    return dataclasses.replace(drafter.head, **{f: None for f in _FROZEN_FIELDS if hasattr(drafter.head, f)})


def with_params(drafter, params):
    """``drafter`` with its head's trainable parameters replaced by ``params``."""
    kept = {f: getattr(drafter.head, f) for f in _FROZEN_FIELDS if hasattr(drafter.head, f)}
    return dataclasses.replace(drafter, head=dataclasses.replace(params, **kept))


def draft_vocabulary_ids(drafter):
    """``[V_d]`` int32: the sorted target ids of the head's vocabulary (None: the whole target's)."""
    d2t = getattr(drafter.head, "d2t", None)
    return None if d2t is None else jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t


def draft_labels(drafter, labels):
    """Target-vocabulary ids -> the head's vocabulary (``-1`` where the draft vocabulary lacks
    them). ``labels [...]`` int32."""
    hot = draft_vocabulary_ids(drafter)
    if hot is None:
        return labels
    index = jnp.clip(jnp.searchsorted(hot, labels), 0, hot.shape[0] - 1)
    return jnp.where(hot[index] == labels, index, -1).astype(jnp.int32)


def cross_entropy(logits, labels, valid, probs=None):
    """Summed loss and correct-argmax count over ``valid`` rows. ``logits [..., V_d]`` fp32,
    ``labels`` / ``valid`` ``[...]``; labels -1 count as wrong. The loss is the cross-entropy
    against ``labels`` (where -1, none), or the KL divergence from ``probs [..., V_d]`` (the
    target's distribution; its mass outside the draft vocabulary is unreachable) when given: the
    cross-entropy's gradient, with 0 as the floor instead of the target's entropy."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    if probs is None:
        picked = jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
        row_loss, counted = -picked, valid & (labels >= 0)
    else:
        plogp = jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0)
        row_loss, counted = jnp.sum(plogp - probs * logp, axis=-1), valid
    correct = (jnp.argmax(logits, axis=-1) == labels) & valid
    return jnp.sum(jnp.where(counted, row_loss, 0.0)), jnp.sum(correct), jnp.sum(valid)


def step_logits(drafter, tokens, features, anchors, *, steps: int):
    """The head's logits (its own vocabulary, fp32) of every trained prediction.

    Returns ``first [batch, T, V_d]``: step 0 at every row (row ``r`` predicts the token at
    ``r + 2``), and ``later [steps - 1, batch * A, V_d]``: step ``j`` from anchor ``a`` (sequence
    ``i // A``, row ``anchors.reshape(-1)[i]``) predicts the token at ``a + 2 + j``, having been fed
    the true tokens at ``a + 2 .. a + 1 + j``. Arguments as :func:`step_losses`.
    """
    batch, width = tokens.shape
    # Step 0 over every row: (token at r + 1, feature at r) -- prefill's and commit's catch-up.
    inputs = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1)
    kv = drafter.init_kv(batch, width + steps, drafter.layer.o.dtype)
    x, kv = drafter.run_rows(kv, inputs, drafter.target_features(features), from_target=True)
    # Later steps: each anchor a sequence of its own, its cache the step-0 rows 0..anchor, one row
    # per step as propose feeds it.
    seq = jnp.repeat(jnp.arange(batch), anchors.shape[1])
    anchor = anchors.reshape(-1).astype(jnp.int32)
    anchor_kv = KVCache(k=tuple(k[seq] for k in kv.k), v=tuple(v[seq] for v in kv.v), lengths=anchor + 1)
    hidden, later = x[seq, anchor], []
    for j in range(1, steps):
        fed = jnp.take_along_axis(tokens[seq], jnp.minimum(anchor + 1 + j, width - 1)[:, None], axis=1)
        out, anchor_kv = drafter.run_rows(anchor_kv, fed, drafter.recycle(hidden)[:, None], from_target=False)
        hidden = out[:, 0]
        later.append(drafter.head_logits(hidden))
    first = drafter.head_logits(x)
    later = jnp.stack(later) if later else jnp.zeros((0, batch * anchors.shape[1], first.shape[-1]), jnp.float32)
    return first, later


def step_losses(drafter, tokens, features, labels, lengths, anchors, *, steps: int, probs=None):
    """Per draft step: summed loss, correct top-1 predictions, counted rows; three ``[steps]`` arrays.

    Args:
      drafter: a hidden-state drafter bound to a target on ``xla`` kernels (the kernels have no gradients).
      tokens: ``[batch, T]`` int32 windows of text.
      features: the target's captures over ``tokens`` (``drafter.capture``), ``[batch, T, H_t]`` each.
      labels: ``[batch, T]`` int32, the target's greedy token after each position.
      lengths: ``[batch]`` valid tokens per window.
      anchors: ``[batch, A]`` int32 rows the later steps start from (any rows; invalid ones count
        nowhere).
      steps: draft steps trained (1: step 0 only).
      probs: optional ``[batch, T, V_d]``, the target's next-token distribution after each position
        over the draft vocabulary: the loss's soft labels (``labels`` then only score the top-1).
    """
    batch, width = tokens.shape
    first, later = step_logits(drafter, tokens, features, anchors, steps=steps)
    shifted = jnp.concatenate([labels[:, 1:], jnp.full((batch, 1), -1, labels.dtype)], axis=1)
    shifted_probs = None if probs is None else jnp.concatenate([probs[:, 1:], jnp.zeros_like(probs[:, :1])], axis=1)
    valid = jnp.arange(width)[None, :] + 2 < lengths[:, None]
    totals = [cross_entropy(first, draft_labels(drafter, shifted), valid, shifted_probs)]
    seq = jnp.repeat(jnp.arange(batch), anchors.shape[1])
    anchor = anchors.reshape(-1).astype(jnp.int32)
    for j in range(1, steps):
        position = anchor + 1 + j  # the last fed token; the label is the target's choice after it
        row = jnp.minimum(position, width - 1)
        label = labels[seq, row]
        target_probs = None if probs is None else probs[seq, row]
        totals.append(cross_entropy(later[j - 1], draft_labels(drafter, label), position + 1 < lengths[seq],
                                     target_probs))
    return tuple(jnp.stack(t) for t in zip(*totals))


def loss_fn(params, drafter, batch, *, steps: int, step_weight: float = 0.8):
    """Mean cross-entropy per step, weighted ``step_weight ** j`` (later steps see more drift,
    EAGLE-3's weighting), and metrics. ``batch``: dict of the ``step_losses`` arrays (``probs``
    optional)."""
    drafter = with_params(drafter, params)
    loss, correct, count = step_losses(drafter, batch["tokens"], batch["features"], batch["labels"],
                                       batch["lengths"], batch["anchors"], steps=steps, probs=batch.get("probs"))
    count = jnp.maximum(count, 1)
    weights = step_weight ** jnp.arange(steps, dtype=jnp.float32)
    total = jnp.sum(weights * loss / count) / jnp.sum(weights)
    return total, dict(loss=loss / count, accuracy=correct / count)
