"""Target model families, one package each (``llama``, ``gemma4``), as pure forward functions
over parameter pytrees.

``forward`` and ``init_params`` dispatch on the type of the model (of the config), so the
engine, the speculative loop and the drafters run any family through one call; the contract is
written in ``jspec.models.base``.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jspec.models import gemma4, llama
from jspec.models.base import NO_CAPTURE, Capture, as_is

# Any family's parameters (annotations only).
AnyModel = llama.Model | gemma4.Model
AnyConfig = llama.LlamaConfig | gemma4.Gemma4Config


@functools.singledispatch
def forward(model, tokens, kv, *, capture=NO_CAPTURE, logits_rows=None, compute_logits=True, tree_mask=None):
    """``(logits, features, kv)`` for ``tokens [batch, T]``: the contract of
    ``jspec.models.base``, implemented by each family's ``forward``."""
    raise TypeError(f"no forward registered for {type(model).__name__}")


forward.register(llama.Model, llama.forward)
forward.register(gemma4.Model, gemma4.forward)


@functools.singledispatch
def init_params(config, key, dtype=jnp.float32, *, scale: float = 0.02, build=as_is):
    """Random parameters of the family ``config`` belongs to (tests and benchmarks); ``build``: how
    each piece is made (:func:`jspec.models.base.as_is`, the default)."""
    raise TypeError(f"no init_params registered for {type(config).__name__}")


init_params.register(llama.LlamaConfig, llama.init_params)
init_params.register(gemma4.Gemma4Config, gemma4.init_params)

__all__ = ["AnyConfig", "AnyModel", "Capture", "forward", "gemma4", "init_params", "llama"]
