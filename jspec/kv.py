"""Immutable KV cache: per-layer K/V buffers plus per-sequence valid lengths.

Writing ``T`` rows for sequence ``b`` puts them at ``lengths[b] .. lengths[b] + T - 1``.
Rejecting rows (draft tokens, prompt padding) only lowers ``lengths``: rows past a length
are never read (attention masks by length) and are overwritten by later writes. Nothing is
ever copied to roll back.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.parallel import TensorParallel
from pallas_kernels.rope_write import write_rows  # noqa: F401 (a batched in-place row write; the kernel's too)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: one ``[batch, num_kv_heads, max_len, head_dim]`` array per layer; lengths ``[batch]`` int32."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @classmethod
    def zeros(cls, num_layers, batch, num_kv_heads, max_len, head_dim, dtype, *,
              placement: TensorParallel | None = None) -> KVCache:
        return cls.of_shapes([(batch, num_kv_heads, max_len, head_dim)] * num_layers, dtype, placement=placement)

    @classmethod
    def of_shapes(cls, shapes, dtype, *, placement: TensorParallel | None = None) -> KVCache:
        """Zero K and V buffers of the given ``[batch, kv_heads, max_len, head_dim]`` shapes, one per layer."""
        place = (lambda buffer: buffer) if placement is None else placement.place_cache  # noqa: E731
        return cls(
            k=tuple(place(jnp.zeros(shape, dtype)) for shape in shapes),
            v=tuple(place(jnp.zeros(shape, dtype)) for shape in shapes),
            lengths=jnp.zeros((shapes[0][0],), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def truncate(self, lengths: jax.Array) -> KVCache:
        """Keep only the first ``lengths[b]`` rows of each sequence (never grows a sequence)."""
        return dataclasses.replace(self, lengths=jnp.minimum(self.lengths, lengths.astype(jnp.int32)))

    def move_rows(self, base: jax.Array, rows: jax.Array) -> KVCache:
        """Row ``base[b] + rows[b, j]`` of every layer moves to ``base[b] + j`` (``rows [batch, m]``,
        read before anything is written): a verified tree's accepted path, stored in node order,
        becomes a chain. Lengths are unchanged (the caller truncates)."""
        source = (base[:, None] + rows).astype(jnp.int32)[:, None, :, None]  # [batch, 1, m, 1]

        def move(buffer):
            picked = jnp.take_along_axis(buffer, source, axis=2, mode="clip")  # [batch, kv_heads, m, head_dim]
            return write_rows(buffer, picked, base)

        return dataclasses.replace(self, k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))

    def advance(self, num_rows) -> KVCache:
        """Count ``num_rows`` (scalar or ``[batch]``) more rows as valid."""
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(num_rows, jnp.int32))

    def written(self, buffers, num_rows) -> KVCache:
        """The cache after a forward wrote ``num_rows`` rows into ``buffers``: one ``(k, v)`` pair per
        layer of this cache, in its order; lengths advanced by ``num_rows``."""
        k, v = zip(*buffers)
        return dataclasses.replace(self, k=tuple(k), v=tuple(v)).advance(num_rows)


