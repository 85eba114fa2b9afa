"""The per-step metadata every layer of a forward reads: one :class:`Step` pytree per forward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.execution import DEFAULT, Execution
from jspec.rope import rope_cos_sin


def mask_depths(tree_mask: jax.Array) -> jax.Array:
    """The depth ``[batch, T]`` of each row of a tree's ancestor mask ``[batch, T, T]`` (each row sees
    itself and its ancestors): the ancestors it sees."""
    return jnp.sum(tree_mask, axis=-1, dtype=jnp.int32) - 1


def row_positions(lengths: jax.Array, num_rows: int, tree_mask: jax.Array | None = None) -> jax.Array:
    """Positions ``[batch, T]`` of ``T`` rows after ``lengths [batch]`` cached rows: consecutive, or
    with ``tree_mask [batch, T, T]`` each row at its depth (the ancestors it sees, itself excluded)."""
    if tree_mask is None:
        return lengths[:, None] + jnp.arange(num_rows, dtype=jnp.int32)[None, :]
    return lengths[:, None] + mask_depths(tree_mask)



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Step:
    """What every layer of one forward reads besides its weights, the residual stream and its cache
    buffers: one value per forward (per layer type where RoPE differs), made by :meth:`make`.

    Shapes: ``batch`` sequences, ``T`` rows each.
      positions   [batch, T] int32   each row's position (RoPE angle and causal / window limit)
      cos, sin    [batch, T, d]      the rows' RoPE tables (``d``: the layer type's head_dim)
      kv_lengths  [batch] int32      cache rows valid once this step's rows are in; a layer that
                                     owns its cache writes the step's K/V at ``kv_lengths - T``
      tree_mask   [batch, T, T] bool or None: tree attention among the rows (None: causal)
      keep_rows   [batch] int32 or None: the one row per sequence kept right after the K/V write
      window      static int or None: a sliding window (a row sees rows less than ``window``
                  positions back), for families whose layers take it from the step
      execution   static: the kernels and placement (``jspec.execution``)
    """

    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    kv_lengths: jax.Array
    tree_mask: jax.Array | None = None
    keep_rows: jax.Array | None = None
    window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))

    @classmethod
    def make(cls, positions, kv_lengths, inv_freq, dtype, execution: Execution = DEFAULT, *, tree_mask=None,
             keep_rows=None, window=None) -> Step:
        """The step of rows at ``positions [batch, T]`` with RoPE frequencies ``inv_freq [d / 2]``,
        tables in ``dtype``."""
        cos, sin = rope_cos_sin(positions, jnp.asarray(inv_freq), dtype)
        return cls(positions, cos, sin, kv_lengths, tree_mask, keep_rows, window, execution)

    def rows(self, rows: jax.Array) -> Step:
        """The step of rows ``rows [batch, n]`` (indices into T) alone: positions and RoPE tables."""
        def take(a):
            return jnp.take_along_axis(a, rows.reshape(*rows.shape, *([1] * (a.ndim - 2))), axis=1)

        return dataclasses.replace(self, positions=take(self.positions), cos=take(self.cos), sin=take(self.sin))
