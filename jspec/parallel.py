"""Tensor parallelism inside the model functions: where a placed model's (``jspec.shard``) KV caches
live, and the ``shard_map`` wrappers that run attention, RoPE + the cache write, the projections, the
embedding lookup and the residual add + norm per device, since the Pallas kernels are custom calls
XLA cannot partition (and XLA, left to partition a lookup in a split table, may gather the table).

Megatron-style: column-split projections (``qkv``, ``gate_up``, the LM head) read the whole input
and write their own output columns; row-split ones (``o``, ``down``) read their share of the input
columns and all-reduce their partial products; attention runs on each device's KV heads and
their query heads. Anything whose split axis does not divide over the mesh runs unsplit (on
replicated operands), as ``jspec.sharding`` then replicates the weight too.

A fused weight (``q | k | v``, ``gate | up``) is stored device-major on a placed model: device
``d``'s column block is ``q_d | k_d | v_d``, its own heads' share of every part, so the parts
split on each device without moving columns between devices
(:meth:`TensorParallel.interleave_columns`, :meth:`TensorParallel.split_columns`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


# How tensor parallelism splits a parameter, declared on its field (:func:`split`): by its output
# columns (the last axis) or by its input rows (the first axis; an embedding table: its vocabulary).
COLUMN, ROW = "column", "row"


def split(how: str, *, metadata: Mapping | None = None, **field_options) -> dataclasses.Field:
    """A parameter field (``dataclasses.field``) declaring how ``jspec.shard`` splits it: :data:`COLUMN`
    or :data:`ROW`; a field without a declaration is replicated. ``metadata``: the field's other
    declarations (e.g. ``jspec.quant.MATMUL_WEIGHT``)."""
    if how not in (COLUMN, ROW):
        raise ValueError(f"split must be {COLUMN!r} or {ROW!r}, got {how!r}")
    return dataclasses.field(metadata={**(metadata or {}), "split": how}, **field_options)


def declared_split(tree, path) -> str | None:
    """The split declared on the field that holds the leaf at ``path`` (``jax.tree_util`` keys) of
    ``tree``: its last attribute's; None where it declares none."""
    node, how = tree, None
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            field = next((f for f in dataclasses.fields(node) if f.name == key.name), None)
            how = None if field is None else field.metadata.get("split")
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        else:
            raise TypeError(f"no split for a leaf under {key!r}")
    return how


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

    def interleaves(self, parts: tuple[int, ...]) -> bool:
        """Whether a fused weight of column ``parts`` (e.g. ``(q_size, kv_size, kv_size)``) is stored
        device-major: where every part divides over the devices."""
        return len(parts) > 1 and all(part % self.size == 0 for part in parts)

    def split_columns(self, y: jax.Array, parts: tuple[int, ...]) -> list[jax.Array]:
        """The parts of ``y [..., sum(parts)]``, the output (or the weight) of a fused projection
        stored device-major where :meth:`interleaves`: each part comes out split over the devices
        as a column-split weight of its own would be, and no column crosses a device."""
        if not self.interleaves(parts):
            return _split(y, parts)
        lead = y.shape[:-1]
        per_device = y.reshape(*lead, self.size, -1)
        shares = _split(per_device, [part // self.size for part in parts])
        return [share.reshape(*lead, -1) for share in shares]

    def interleave_columns(self, w: jax.Array, parts: tuple[int, ...]) -> jax.Array:
        """``w [..., sum(parts)]`` with its parts side by side -> device-major (inverse:
        :meth:`deinterleave_columns`)."""
        if not self.interleaves(parts):
            return w
        lead = w.shape[:-1]
        pieces = _split(w, parts)
        return jnp.concatenate([piece.reshape(*lead, self.size, -1) for piece in pieces], axis=-1).reshape(w.shape)

    def deinterleave_columns(self, w: jax.Array, parts: tuple[int, ...]) -> jax.Array:
        return jnp.concatenate(self.split_columns(w, parts), axis=-1)

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

    def column(self, matmul, x, w, *, w_transposed=False):
        """``matmul(x [..., K], w [K, N])`` with ``w`` split by output columns: each device its columns.
        ``w_transposed``: ``w [N, K]`` (a tied LM head's embedding table), split by its rows."""
        out_axis = 0 if w_transposed else -1
        if w.shape[out_axis] % self.size:
            return matmul(x, w)
        w_spec = PartitionSpec(self.axis, None) if w_transposed else PartitionSpec(None, self.axis)
        return jax.shard_map(matmul, mesh=self.mesh, in_specs=(PartitionSpec(), w_spec),
                             out_specs=self._last_axis(x.ndim), check_vma=False)(x, w)

    def splits_heads(self, num_heads: int, num_kv_heads: int) -> bool:
        """Whether attention's heads divide over the devices (the caches are then split over KV heads
        and a fused ``q | k | v`` is stored device-major)."""
        return num_heads % self.size == 0 and num_kv_heads % self.size == 0

    def heads_write(self, write, qkv, k_buf, v_buf, *rest):
        """``write(qkv [batch, T, columns], k_buf, v_buf, *rest) -> (q [batch, T, heads, d], k_buf, v_buf)``
        (RoPE and the cache write of a fused projection) on each device's own heads: ``qkv`` device-major,
        the caches ``[batch, kv_heads, L, d]`` split over KV heads, ``rest`` replicated; ``write`` sees one
        device's heads. Where :meth:`splits_heads`."""
        cache = PartitionSpec(None, self.axis)
        return jax.shard_map(write, mesh=self.mesh, in_specs=(self._last_axis(3), cache, cache) + (PartitionSpec(),) * len(rest),
                             out_specs=(PartitionSpec(None, None, self.axis), cache, cache), check_vma=False)(qkv, k_buf, v_buf, *rest)

    def replicated(self, fn, *args):
        """``fn(*args)`` on every device on replicated operands: a Pallas kernel (a custom call XLA cannot
        partition) on activations that every device holds whole, e.g. the residual add and norm."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(), check_vma=False)(*args)

    def lookup(self, table, ids):
        """``table[ids]`` for a table split by its rows (an embedding's vocabulary): each device takes the
        ids in its share (zeros for the rest) and one all-reduce of ``[..., hidden]`` sums them, exactly (one
        non-zero term per row). Left to itself, XLA may gather the whole table onto every device."""
        if table.shape[0] % self.size:
            return table[ids]

        def local(table, ids):
            local_ids = ids - jax.lax.axis_index(self.axis) * table.shape[0]
            inside = (local_ids >= 0) & (local_ids < table.shape[0])
            rows = table[jnp.where(inside, local_ids, 0)]
            return jax.lax.psum(jnp.where(inside[..., None], rows, jnp.zeros((), table.dtype)), self.axis)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(PartitionSpec(self.axis), PartitionSpec()),
                             out_specs=PartitionSpec(), check_vma=False)(table, ids)

    def row(self, matmul, x, w):
        """``matmul(x [..., K], w [K, N])`` with ``w`` split by input rows: partial products all-reduced."""
        if w.shape[0] % self.size:
            return matmul(x, w)

        def partial_product(x, w):
            return jax.lax.psum(matmul(x, w), self.axis)

        return jax.shard_map(partial_product, mesh=self.mesh, out_specs=PartitionSpec(), check_vma=False,
                             in_specs=(self._last_axis(x.ndim), PartitionSpec(self.axis)))(x, w)


def per_head(attend, *args, parallel: TensorParallel | None):
    """``attend(q, k, v, *rest)`` as it is, or on a placed model's (``parallel``) devices per KV head."""
    return attend(*args) if parallel is None else parallel.per_head(attend, *args)


def split_columns(y: jax.Array, parts: tuple[int, ...], parallel: TensorParallel | None) -> list[jax.Array]:
    """The parts of a fused projection's output ``y [..., sum(parts)]``, on a placed model's
    (``parallel``) device-major layout or the plain one."""
    return _split(y, parts) if parallel is None else parallel.split_columns(y, parts)


def _split(y: jax.Array, sizes) -> list[jax.Array]:
    """``y`` cut along its last axis into consecutive pieces of ``sizes`` columns."""
    return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)


def map_fused(model, convert: Callable[[jax.Array, tuple[int, ...]], jax.Array]):
    """``model`` with every fused weight of every layer passed through ``convert(weight, parts)``;
    ``model.fused_columns(index)`` names them and their column parts."""
    layers = tuple(map_fused_layer(layer, model.fused_columns(index), convert) for index, layer in enumerate(model.layers))
    return dataclasses.replace(model, layers=layers)


def map_fused_layer(layer, columns: Mapping[str, tuple[int, ...]], convert):
    """One layer of :func:`map_fused`: ``columns`` is its model's ``fused_columns(index)``."""
    return dataclasses.replace(layer, **{name: convert(getattr(layer, name), parts)
                                         for name, parts in columns.items() if getattr(layer, name) is not None})


def plain_order(model):
    """A placed model (``jspec.shard``) with its fused weights back in their plain column order and
    no placement: what a checkpoint stores; an unplaced model as it is."""
    placement = model.execution.placement
    if placement is None:
        return model
    plain = map_fused(model, placement.deinterleave_columns)
    return dataclasses.replace(plain, execution=dataclasses.replace(model.execution, placement=None))
