"""Tiny random models for tests (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import jax

import jspec

TINY = jspec.LlamaConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=10000.0,
)


def tiny_model(seed: int = 0, **overrides) -> jspec.Model:
    config = dataclasses.replace(TINY, **overrides)
    return jspec.init_params(config, jax.random.key(seed), scale=0.3)
