"""Compiled decode steps and speculation rounds update the caches in place: no copy of any
cache buffer (checked in the compiled HLO)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jspec import engine
from jspec.sampling import SamplingParams
from tests.tiny import tiny_model


def test_decode_step_aliases_and_never_copies_the_cache():
    model = tiny_model()
    params = SamplingParams()
    state = engine.start_decoding(
        model, jnp.ones((2, 16), jnp.int32), jnp.array([3, 9]), jax.random.key(0),
        params=params, eos_ids=(), output_width=4, max_len=256,
    )
    hlo = engine.decode_step_jit.lower(model, state, params=params).compile().as_text()
    header = hlo.splitlines()[0]
    num_aliased = len(re.findall(r"may-alias|must-alias", header))
    num_cache_buffers = 2 * model.config.num_layers
    assert num_aliased >= num_cache_buffers
    cache_shape = r"f32\[2,2,256,16\]"
    copies = re.findall(rf"= {cache_shape}\{{[^}}]*\}} copy\(", hlo)
    assert copies == []
    # Each layer's K and V are updated by an in-place scatter on the donated parameter.
    assert len(re.findall(rf"= {cache_shape}\{{[^}}]*\}} (?:scatter|fusion)\(%state_kv_[kv]_", hlo)) == num_cache_buffers


def test_decode_step_continues_generation():
    model = tiny_model()
    params = SamplingParams()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    expected = engine.generate(model, prompts, 5)
    tokens, lengths = engine.pad_prompts(prompts)
    state = engine.start_decoding(
        model, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
        params=params, eos_ids=(), output_width=5, max_len=128,
    )
    for _ in range(4):
        state = engine.decode_step_jit(model, state, params=params)
    assert state.output.tolist() == expected


@pytest.mark.parametrize("kind", ["draft-model", "eagle3"])
def test_speculative_round_never_copies_a_cache(kind):
    """Target and draft caches (the draft's carried through the scan of draft steps) stay in place."""
    from jspec import speculative
    from jspec.drafters import DraftModel, Eagle3
    from tests.tiny import eagle3_head

    target = tiny_model()
    if kind == "draft-model":
        drafter = DraftModel(tiny_model(1, num_layers=1, num_heads=2, num_kv_heads=1))
    else:
        drafter = Eagle3(eagle3_head(2, target, aux=(0, 1, 1))).bind(target)
    params = SamplingParams()
    state = speculative.start(
        target, drafter, jnp.ones((2, 16), jnp.int32), jnp.array([3, 9]), jax.random.key(0),
        params=params, eos_ids=(), capacity=256, max_len=256,
    )
    round_fn = jax.jit(
        lambda t, d, s: speculative.speculative_round(
            t, d, s, num_draft_tokens=3, params=params, eos_ids=(), max_new_tokens=100
        ),
        donate_argnums=2,
    )
    hlo = round_fn.lower(target, drafter, state).compile().as_text()
    assert re.findall(r"= f32\[2,\d+,256,\d+\]\{[^}]*\} copy\(", hlo) == []
