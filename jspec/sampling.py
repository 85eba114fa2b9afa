"""Temperature / top-k / top-p -> the sampling distribution, as HF ``generate`` shapes it.

Order as in transformers' logits processors: temperature, then top-k, then top-p. All math
in fp32. ``temperature == 0`` means greedy (argmax), decided statically.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """fp32 logits with temperature applied and filtered tokens set to ``-inf``. ``[..., vocab]``."""
    logits = logits.astype(jnp.float32)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p is not None and params.top_p < 1.0:
        # Remove the low-probability tail whose total mass is <= 1 - top_p; the top token stays.
        sorted_logits = jnp.sort(logits, axis=-1)  # ascending
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        remove_sorted = cumulative <= 1 - params.top_p
        remove_sorted = remove_sorted.at[..., -1].set(False)
        # Threshold: the smallest kept logit; ties with it are kept too.
        threshold = jnp.min(jnp.where(remove_sorted, jnp.inf, sorted_logits), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The exact distribution ``sample`` draws from (one-hot argmax when greedy). ``[..., vocab]``."""
    if params.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(processed_logits(logits, params), axis=-1)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """One token per row of ``logits [..., vocab]`` -> int32 ``[...]``."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, processed_logits(logits, params), axis=-1).astype(jnp.int32)
