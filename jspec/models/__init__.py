"""Target model families, one package each (``llama``, ``gemma4``), as pure forward functions
over parameter pytrees.

``forward`` and ``init_params`` dispatch on the type of the model (of the config), so the
engine, the speculative loop and the drafters run any family through one call; the contract is
written in ``jspec.models.base``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.models import gemma4, llama
from jspec.execution import DEFAULT, Execution
from jspec.layers import embedding
from jspec.models.base import NO_CAPTURE, Capture, as_is, lm_head
from jspec.parallel import TensorParallel
from jspec.models.gemma4.model import embed_tokens as gemma4_embed_tokens, softcap
from jspec.quant import MATMUL_WEIGHT, TABLE_WEIGHT

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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenIO:
    """A target's token embedding and LM head, for drafters that borrow both (DFlash).

    ``embed [vocab, hidden]``; ``lm_head [hidden, vocab]`` or None when tied; ``embed_scale``:
    whether embedded rows are scaled by ``sqrt(hidden)`` in the table's dtype (Gemma 4);
    ``softcap``: the family's logit soft-cap (Gemma 4), None for none."""

    embed: jax.Array = dataclasses.field(metadata=TABLE_WEIGHT)
    lm_head: jax.Array | None = dataclasses.field(metadata=MATMUL_WEIGHT)
    embed_scale: bool = dataclasses.field(default=False, metadata=dict(static=True))
    softcap: float | None = dataclasses.field(default=None, metadata=dict(static=True))
    placement: TensorParallel | None = dataclasses.field(default=None, metadata=dict(static=True))  # the target's

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``tokens [...]`` -> ``[..., hidden]`` as the target embeds its input."""
        if self.embed_scale:
            return gemma4_embed_tokens(self.embed, tokens, self.placement)
        return embedding(self.embed, tokens, self.placement)

    def logits(self, h: jax.Array, ex: Execution = DEFAULT) -> jax.Array:
        """fp32 logits ``[..., vocab]`` of final-normed rows ``h [..., hidden]``, as the target's head
        (``ex``: the caller's kernels; placed as the target is)."""
        ex = dataclasses.replace(ex, placement=self.placement)
        return softcap(lm_head(self.embed, self.lm_head, h, ex), self.softcap)


def token_io(model: AnyModel) -> TokenIO:
    """The :class:`TokenIO` of a target of any family."""
    if isinstance(model, gemma4.Model):
        return TokenIO(model.embed, model.lm_head, embed_scale=True, softcap=model.config.final_logit_softcapping,
                       placement=model.execution.placement)
    if isinstance(model, llama.Model):
        return TokenIO(model.embed, model.lm_head, placement=model.execution.placement)
    raise TypeError(f"no token embedding / LM head known for {type(model).__name__}")


__all__ = ["AnyConfig", "AnyModel", "Capture", "TokenIO", "forward", "gemma4", "init_params", "llama", "token_io"]
