"""The model runs end to end on the Pallas kernels (interpret mode on CPU) and agrees with
the XLA references: the forward code reaches the kernels only through their dispatchers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import forward, with_kernels
from tests.tiny import tiny_model


def _prefill_then_decode(model, tokens, *, impl):
    return _prefill_then_decode_on(with_kernels(model, impl), tokens)


@jax.jit
def _prefill_then_decode_on(model, tokens):
    kv = model.init_cache(tokens.shape[0], 128)
    prefill_logits, _, kv = forward(model, tokens, kv)
    kv = kv.truncate(jnp.array([4, tokens.shape[1]]))  # ragged: sequence 0 drops two rows
    step_logits, _, _ = forward(model, tokens[:, :1], kv, logits_rows=jnp.zeros((2, 1), jnp.int32))
    return prefill_logits, step_logits


def test_forward_on_pallas_kernels_matches_xla():
    model = tiny_model(0, qkv_bias=True, qk_norm=True)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, model.config.vocab_size)
    for kernel, reference in zip(
        _prefill_then_decode(model, tokens, impl="pallas"), _prefill_then_decode(model, tokens, impl="xla"), strict=True
    ):
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), rtol=1e-4, atol=1e-4)


def test_impl_names_per_kernel_exceptions():
    """``"<default>,<kernel>=<choice>"`` overrides one kernel; anything else is a clear error."""
    from pallas_kernels.dispatch import check_impl

    assert check_impl("auto", "skinny_matmul") == "auto"
    assert check_impl("auto,skinny_matmul=xla", "skinny_matmul") == "xla"
    assert check_impl("auto,skinny_matmul=xla", "decode_attention") == "auto"
    assert check_impl("xla,gather_rows=pallas,decode_attention=pallas", "decode_attention") == "pallas"
    for bad in ("fast", "auto,skinny_matmul", "auto,matmul=xla", "auto,skinny_matmul=fast",
                "auto,gather_rows=xla,gather_rows=pallas"):
        with pytest.raises(ValueError, match="impl"):
            check_impl(bad, "skinny_matmul")


def test_forward_with_one_kernel_overridden():
    model = tiny_model(0)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, model.config.vocab_size)
    mixed = _prefill_then_decode(model, tokens, impl="xla,skinny_matmul=pallas")
    reference = _prefill_then_decode(model, tokens, impl="xla")
    for a, b in zip(mixed, reference, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_bf16_decode_on_the_short_k_tilings_matches_xla():
    """A 16-bit model's one-row matmuls over a short K take one split of narrow tiles (the small
    models' decode step under ``auto`` on a GPU); the step agrees with XLA's within bf16 rounding."""
    import dataclasses
    import importlib

    import jspec
    from tests.tiny import TINY

    sm = importlib.import_module("pallas_kernels.matmul.skinny_matmul")
    model = jspec.init_params(dataclasses.replace(TINY, qkv_bias=True), jax.random.key(0), jnp.bfloat16, scale=0.3)
    assert sm.default_config(2, model.config.hidden_size, 64).split_k == 1  # decode rows: the short-K tiling
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, model.config.vocab_size)
    kernel = _prefill_then_decode(model, tokens, impl="xla,skinny_matmul=pallas")[1]
    reference = _prefill_then_decode(model, tokens, impl="xla")[1]
    kernel, reference = (np.asarray(a, np.float32) for a in (kernel, reference))
    assert np.isfinite(kernel).all()
    # bf16 roundings of the activations, carried through the layers: a few bf16 ulps of the logits' scale
    assert np.max(np.abs(kernel - reference)) <= 0.02 * np.max(np.abs(reference))
