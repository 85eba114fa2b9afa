"""The compiled decode step updates the cache in place: no copy of any cache buffer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

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
