"""Training a hidden-state draft head for a frozen target: features on the fly, optax, one jitted
step, checkpoints through orbax.

``TrainState`` is a registered pytree (parameters, optimizer state, step, PRNG key); ``train_step``
is pure: ``(state, batch) -> (state, metrics)``. The target's features and labels for a batch of
windows come from :func:`target_batch` (one forward of the frozen target, capturing the layers
the head reads).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.execution import with_kernels
from jspec.models import forward
from jspec.drafters import DFlash
from jspec.training.dflash_objective import dflash_loss_fn
from jspec.training.objective import draft_vocabulary_ids, loss_fn, trainable_params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any  # the head's trainable parameters (objective.trainable_params)
    opt_state: Any
    step: jax.Array  # int32 scalar
    key: jax.Array  # PRNG key for anchor sampling


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training settings (hashable: a jit static argument)."""

    learning_rate: float = 3e-4
    warmup_steps: int = 50
    total_steps: int = 1000
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    steps: int = 4  # draft steps unrolled (training-time test); 1 = step 0 only
    anchors: int = 16  # anchor rows per window: EAGLE-3's later steps start there, DFlash's blocks
    step_weight: float = 0.8
    gamma: float = 7.0  # DFlash: block slot j's loss weighted exp(-(j - 1) / gamma) (SpecForge's 7)
    soft_labels: bool = True  # distil the target's distribution (False: its greedy token only)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.total_steps, 1),
                                                  end_value=cfg.learning_rate * 0.1)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(schedule, weight_decay=cfg.weight_decay))


def init_state(drafter, cfg: TrainConfig, key) -> TrainState:
    """A fresh state from the drafter's current head (copied: ``train_step`` donates the state)."""
    params = jax.tree.map(jnp.copy, trainable_params(drafter))
    return TrainState(params, optimizer(cfg).init(params), jnp.zeros((), jnp.int32), key)


def target_batch(target, drafter, tokens, lengths, *, soft_labels: bool = False, impl="xla") -> dict:
    """The frozen target over ``tokens [batch, T]``: the objective's batch (``tokens``, ``lengths``,
    the captured ``features`` of ``drafter.capture``, ``labels [batch, T]``: the greedy next token
    after each position, and with ``soft_labels`` ``probs [batch, T, V_d]``: the next-token
    distribution over the draft vocabulary)."""
    kv = target.init_cache(tokens.shape[0], tokens.shape[1])
    logits, features, _ = forward(with_kernels(target, impl), tokens, kv, capture=drafter.capture)
    labels = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    labels = jnp.where(jnp.arange(tokens.shape[1])[None, :] < lengths[:, None], labels, -1)
    batch = dict(tokens=tokens, lengths=lengths, features=jax.lax.stop_gradient(features), labels=labels)
    if soft_labels:
        hot = draft_vocabulary_ids(drafter)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        batch["probs"] = jax.lax.stop_gradient(probs if hot is None else probs[..., hot])
    return batch


def sample_anchors(key, lengths, width: int, num_anchors: int, steps: int):
    """``[batch, num_anchors]`` distinct rows of windows of ``width`` tokens, drawn first among the
    rows from which all ``steps`` predictions fall inside the window (uniformly, without
    replacement); a window with fewer such rows fills up with others, whose predictions past the
    window count nowhere."""
    if num_anchors > width:
        raise ValueError(f"{num_anchors} anchors per window: more than its {width} rows")
    usable = jnp.maximum(lengths - steps - 1, 1)  # anchor r needs the token at r + 1 + steps
    noise = jax.random.uniform(key, (lengths.shape[0], width))
    noise = jnp.where(jnp.arange(width)[None, :] < usable[:, None], noise, noise - 1.0)
    return jax.lax.top_k(noise, num_anchors)[1].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def train_step(state: TrainState, drafter, target, tokens, lengths, *, cfg: TrainConfig):
    """One optimizer step on windows ``tokens [batch, T]`` (``lengths [batch]``): target features
    on the fly, the objective's loss, clipped AdamW. Returns ``(state, metrics)``."""
    key, anchor_key = jax.random.split(state.key)
    batch = target_batch(target, drafter, tokens, lengths, soft_labels=cfg.soft_labels)
    if isinstance(drafter, DFlash):  # a block of B - 1 predictions from each anchor
        batch["anchors"] = sample_anchors(anchor_key, lengths, tokens.shape[1], cfg.anchors,
                                          drafter.config.block_size - 2)
        objective = functools.partial(dflash_loss_fn, gamma=cfg.gamma)
    else:
        batch["anchors"] = sample_anchors(anchor_key, lengths, tokens.shape[1], cfg.anchors, cfg.steps)
        objective = functools.partial(loss_fn, steps=cfg.steps, step_weight=cfg.step_weight)
    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params, drafter, batch)
    updates, opt_state = optimizer(cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, total=loss, grad_norm=optax.tree.norm(grads))
    return TrainState(params, opt_state, state.step + 1, key), metrics


def save_state(state: TrainState, path, *, metadata: dict | None = None) -> None:
    """Write a training checkpoint (orbax, atomic: ``jspec.io.orbax.atomic_directory``)."""
    import json

    import orbax.checkpoint as ocp

    from jspec.io.orbax import atomic_directory

    with atomic_directory(path) as staging:
        (staging / "metadata.json").write_text(json.dumps(dict(metadata or {}, step=int(state.step)), indent=2))
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(staging / "state", jax.tree.map(np.asarray, _storable(state)), force=True)
            ckptr.wait_until_finished()


def restore_state(path, like: TrainState) -> TrainState:
    """Read a checkpoint of ``save_state`` into the structure of ``like``."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.restore(Path(path).absolute() / "state", jax.tree.map(np.asarray, _storable(like)))
    return dataclasses.replace(jax.tree.map(jnp.asarray, stored), key=jax.random.wrap_key_data(stored.key))


def _storable(state: TrainState) -> TrainState:
    """PRNG keys as their raw data (orbax stores plain arrays)."""
    return dataclasses.replace(state, key=jax.random.key_data(state.key))


def train(state: TrainState, drafter, target, batches, *, cfg: TrainConfig, num_steps: int, callback=None):
    """Run ``num_steps`` steps from ``state`` over ``batches`` (an iterator of ``(tokens, lengths)``);
    ``callback(state, metrics)`` after each (progress, evaluation, checkpoints). Returns the state."""
    for _ in range(num_steps):
        tokens, lengths = next(batches)
        state, metrics = train_step(state, drafter, target, tokens, lengths, cfg=cfg)
        if callback is not None:
            callback(state, metrics)
    return state
