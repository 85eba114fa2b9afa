"""The model runs end to end on the Pallas kernels (interpret mode on CPU) and agrees with
the XLA references: the forward code reaches the kernels only through their dispatchers."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec import forward
from tests.tiny import tiny_model


@functools.partial(jax.jit, static_argnames="impl")
def _prefill_then_decode(model, tokens, *, impl):
    kv = model.init_cache(tokens.shape[0], 128)
    prefill_logits, _, kv = forward(model, tokens, kv, impl=impl)
    kv = kv.truncate(jnp.array([4, tokens.shape[1]]))  # ragged: sequence 0 drops two rows
    step_logits, _, _ = forward(model, tokens[:, :1], kv, logits_rows=jnp.zeros(2, jnp.int32), impl=impl)
    return prefill_logits, step_logits


def test_forward_on_pallas_kernels_matches_xla():
    model = tiny_model(0, qkv_bias=True, qk_norm=True)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, model.config.vocab_size)
    for kernel, reference in zip(
        _prefill_then_decode(model, tokens, impl="pallas"), _prefill_then_decode(model, tokens, impl="xla"), strict=True
    ):
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), rtol=1e-4, atol=1e-4)
