"""What every model family shares: the forward contract's argument types, the LM head, and the
random initialisation used by tests and benchmarks.

Every family's ``forward(model, tokens [batch, T], kv, *, capture, logits_rows, compute_logits,
tree_mask) -> (logits, features, kv)`` runs ``tokens`` at positions ``kv.lengths[b] + 0..T-1`` with
the kernels and placement of ``model.execution`` (``jspec.execution``), writes their K/V and
advances ``kv.lengths`` by ``T``:

* ``logits``: fp32, ``[batch, T, vocab]`` when ``logits_rows`` is None, ``[batch, n, vocab]`` for
  ``logits_rows [batch, n]`` (indices into T: only those rows get the final norm and LM head), or
  None with ``compute_logits=False`` (a prefill that only fills the cache).
* ``features``: the hidden states ``capture`` names, ``[batch, T, hidden]`` each, in its order.
* ``tree_mask [batch, T, T]`` bool (a draft tree, ``jspec.tree``): row ``i`` sees the cached rows
  and the rows ``j`` with ``tree_mask[b, i, j]`` (itself and its ancestors) instead of rows ``0..i``,
  at position ``kv.lengths[b] + depth_i`` with ``depth_i = sum_j tree_mask[b, i, j] - 1``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.execution import DEFAULT, Execution
from jspec.layers import check_unquantized, linear
from jspec.quant import QuantizedWeight, matmul


@dataclasses.dataclass(frozen=True)
class Capture:
    """Which hidden states ``forward`` returns as ``features`` (static, hashable).

    ``residuals``: the residual stream entering layer ``i`` (HF ``hidden_states[i]``), in the
    order given; ``i == num_layers`` is the last layer's output before the final norm.
    ``final_normed``: the last hidden after the final norm (what the LM head reads), appended
    after the residuals.
    """

    residuals: tuple[int, ...] = ()
    final_normed: bool = False

    def __post_init__(self):
        residuals = tuple(self.residuals)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in residuals):
            raise ValueError(f"Capture.residuals must be layer indices >= 0, got {self.residuals!r}")
        object.__setattr__(self, "residuals", residuals)

    def check(self, num_layers: int) -> None:
        bad = [i for i in self.residuals if i > num_layers]
        if bad:
            raise ValueError(f"Capture.residuals {bad} out of range for a model with {num_layers} layers")


NO_CAPTURE = Capture()


def check_forward_args(tokens: jax.Array, capture: Capture, logits_rows, num_layers: int, tree_mask=None) -> None:
    """The static checks of a forward's arguments: ``capture`` against the depth, ``logits_rows``
    None or ``[batch, n]``, ``tree_mask`` None or ``[batch, T, T]``."""
    batch, num_rows = tokens.shape
    capture.check(num_layers)
    if logits_rows is not None and (logits_rows.ndim != 2 or logits_rows.shape[0] != batch):
        raise ValueError(f"logits_rows must be [batch={batch}, n] row indices, got shape {logits_rows.shape}")
    if tree_mask is not None and tree_mask.shape != (batch, num_rows, num_rows):
        raise ValueError(f"tree_mask must be [batch={batch}, T={num_rows}, T={num_rows}], got shape {tree_mask.shape}")


def lm_head(embed: jax.Array | QuantizedWeight, head: jax.Array | QuantizedWeight | None, h: jax.Array,
            ex: Execution = DEFAULT) -> jax.Array:
    """Logits in fp32 for normed hidden rows ``h [..., hidden]`` -> ``[..., vocab]``; ``head
    [hidden, vocab]``, or None when tied to ``embed [vocab, hidden]`` (arrays or quantized weights; a
    quantized table is stored as the head reads it). On a placed model (``ex.placement``) an untied
    head runs column-split per device."""
    if head is None and (ex.mode("skinny_matmul") == "invariant" or isinstance(embed, QuantizedWeight)):
        # The table as stored ([vocab, hidden]), never a transposed copy: the row-invariant kernel, the
        # quantized matmul.
        product = functools.partial(matmul, impl=ex.kernels, w_transposed=True)
        placement = ex.placement
        if placement is None:
            logits = product(h, embed)
        else:
            check_unquantized(embed, "a placed model's LM head and embedding")
            logits = placement.column(product, h, embed, w_transposed=True)
        return logits.astype(jnp.float32)
    if head is None:
        # Tied: contract against the embedding table as stored, no transposed copy.
        return jnp.einsum("...h,vh->...v", h, embed, preferred_element_type=jnp.float32)
    return linear(h, head, None, ex, split="column").astype(jnp.float32)


def as_is(fn, *, name=None, static_argnums=()):
    """The default ``build`` of the families' ``init_params``: each piece made by ``fn`` itself.

    ``init_params(..., build=b)`` makes every piece (each embedding table, each layer, the norms)
    through ``b(fn, name=field name or None, static_argnums=...)(*args)``, largest tables first, so a
    builder can make each piece in a program of its own (:func:`jspec.sharding.init_sharded`)."""
    return fn


def random_matrix(key, shape, dtype, scale):
    """normal(0, scale) entries (random weights for tests and benchmarks)."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_norm_weight(key, shape, dtype):
    """Norm weights near 1, so that a test notices a norm applied to the wrong tensor."""
    return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
