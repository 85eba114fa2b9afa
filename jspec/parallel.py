"""Tensor parallelism inside the model functions: where a placed model's (``jspec.shard``) KV caches
live, and the ``shard_map`` wrappers that run attention and the projections per device, since the
Pallas kernels are custom calls XLA cannot partition.

Megatron-style: column-split projections (``qkv``, ``gate_up``, the LM head) read the whole input
and write their own output columns; row-split ones (``o``, ``down``) read their share of the input
columns and all-reduce their partial products; attention runs on each device's KV heads and
their query heads. Anything whose split axis does not divide over the mesh runs unsplit (on
replicated operands), as ``jspec.sharding`` then replicates the weight too.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A placed model's mesh and its tensor-parallel axis (static, hashable)."""

    mesh: jax.sharding.Mesh
    axis: str

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    def cache_spec(self, num_kv_heads: int) -> PartitionSpec:
        """KV buffers ``[batch, kv_heads, max_len, head_dim]``: split over KV heads where they divide."""
        return PartitionSpec(None, self.axis) if num_kv_heads % self.size == 0 else PartitionSpec()

    def place_cache(self, buffer: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(buffer, NamedSharding(self.mesh, self.cache_spec(buffer.shape[1])))

    def _last_axis(self, ndim: int) -> PartitionSpec:
        return PartitionSpec(*([None] * (ndim - 1)), self.axis)

    def per_head(self, attend, q, k, v, *rest):
        """``attend(q [batch, T, q_heads, d], k, v [batch, kv_heads, L, d], *rest)`` on each device's
        KV heads and their query heads; ``rest`` (lengths, positions, masks) replicated."""
        if self.cache_spec(k.shape[1]) == PartitionSpec():
            return attend(q, k, v, *rest)
        heads, cache = PartitionSpec(None, None, self.axis), PartitionSpec(None, self.axis)
        return jax.shard_map(attend, mesh=self.mesh, in_specs=(heads, cache, cache) + (PartitionSpec(),) * len(rest),
                             out_specs=heads, check_vma=False)(q, k, v, *rest)

    def column(self, matmul, x, w):
        """``matmul(x [..., K], w [K, N])`` with ``w`` split by output columns: each device its columns."""
        if w.shape[-1] % self.size:
            return matmul(x, w)
        return jax.shard_map(matmul, mesh=self.mesh, in_specs=(PartitionSpec(), PartitionSpec(None, self.axis)),
                             out_specs=self._last_axis(x.ndim), check_vma=False)(x, w)

    def row(self, matmul, x, w):
        """``matmul(x [..., K], w [K, N])`` with ``w`` split by input rows: partial products all-reduced."""
        if w.shape[0] % self.size:
            return matmul(x, w)

        def partial_product(x, w):
            return jax.lax.psum(matmul(x, w), self.axis)

        return jax.shard_map(partial_product, mesh=self.mesh, out_specs=PartitionSpec(), check_vma=False,
                             in_specs=(self._last_axis(x.ndim), PartitionSpec(self.axis)))(x, w)
