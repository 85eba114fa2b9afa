"""Target model families as pure forward functions over parameter pytrees.

``forward`` and ``init_params`` dispatch on the type of the model (of the config), so the
engine, the speculative loop and the drafters run any family through one call.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jspec.config import LlamaConfig
from jspec.gemma4_config import Gemma4Config
from jspec.models import gemma4, llama
from jspec.models.llama import FINAL_NORMED, Layer, Model

# Any family's parameters (annotations only).
AnyModel = llama.Model | gemma4.Model


@functools.singledispatch
def forward(model, tokens, kv, *, capture=(), logits_rows=None, impl="auto"):
    """``(logits, features, kv)`` for ``tokens [batch, T]``: the contract of
    ``jspec.models.llama.forward``, implemented by each family's ``forward``."""
    raise TypeError(f"no forward registered for {type(model).__name__}")


forward.register(llama.Model, llama.forward)
forward.register(gemma4.Model, gemma4.forward)


@functools.singledispatch
def init_params(config, key, dtype=jnp.float32, *, scale: float = 0.02):
    """Random parameters of the family ``config`` belongs to (tests and benchmarks)."""
    raise TypeError(f"no init_params registered for {type(config).__name__}")


init_params.register(LlamaConfig, llama.init_params)
init_params.register(Gemma4Config, gemma4.init_params)

__all__ = ["FINAL_NORMED", "AnyModel", "Layer", "Model", "forward", "gemma4", "init_params", "llama"]
