"""Tensor parallelism over a device mesh: parameters placed Megatron-style with ``jax.sharding``,
the KV cache split over KV heads; XLA's SPMD partitioner inserts the collectives.

``shard(tree, mesh)`` places every array of a model, a drafter or any pytree holding them as its
field declares (``jspec.parallel.split``):

* column-split (the output axis over ``axis``): ``qkv`` (and ``qkv_bias``), ``gate_up``, ``lm_head``;
* row-split (the input axis): ``o``, ``down``; an embedding table by its vocabulary rows;
* everything else (norms, small heads' odd pieces) replicated, and so is any of the above whose
  split axis does not divide evenly over the mesh axis.

A target model (Llama family or Gemma 4) also gets a :class:`jspec.parallel.TensorParallel` as the
placement of its ``execution`` (``jspec.execution``), so every
cache it makes (``init_cache``, inside ``generate`` and ``speculative_generate`` too) is split
over KV heads, or replicated where its KV heads do not divide over the mesh axis. ``generate``,
``speculative_generate`` and ``forward`` then run unchanged: their jitted programs take the
placed arrays and XLA partitions them. A one-device mesh takes the same path.

Attention, RoPE + the cache write and the split projections run per device in ``shard_map``
(``jspec.parallel``: the Pallas kernels are custom calls XLA cannot partition), the row-split ones
all-reducing their partial products; the residual add + norm kernels run on every device on its
whole copy of the activations, and the embedding lookup per device on its share of the vocabulary. The fused projections (``q | k | v``, ``gate | up``) are stored device-major
(``jspec.parallel``): each device's column block holds its own heads' q, k and v (its share of
gate and up), so the only collectives of a forward are the two all-reduces per layer (and the
embedding's). With the columns in their plain order, XLA would move them between devices after
every fused matmul (collective-permutes costing more than the split saves). ``jspec.save`` writes a
placed model in the plain order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jspec.execution import with_placement
from jspec.models import gemma4, init_params, llama
from jspec.parallel import COLUMN, ROW, TensorParallel, declared_split, map_fused, map_fused_layer, plain_order
from jspec.quant import quantized_layout

TP_AXIS = "tp"
_MODELS = (llama.Model, gemma4.Model)
_MODEL_OF = {llama.LlamaConfig: llama.Model, gemma4.Gemma4Config: gemma4.Model}


def tensor_parallel_mesh(devices=None, *, axis: str = TP_AXIS) -> Mesh:
    """A one-axis mesh over ``devices`` (default: all of them)."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (axis,))


def param_spec(how: str | None, shape: tuple[int, ...], size: int, axis: str = TP_AXIS) -> PartitionSpec:
    """The placement on ``size`` devices of a parameter of ``shape`` whose field declares the split
    ``how`` (``jspec.parallel.COLUMN`` / ``ROW`` / None): replicated where the split axis does not
    divide."""
    if how == COLUMN and shape and shape[-1] % size == 0:
        return PartitionSpec(*([None] * (len(shape) - 1)), axis)
    if how == ROW and len(shape) >= 2 and shape[0] % size == 0:
        return PartitionSpec(axis)
    return PartitionSpec()


def placements(tree, mesh: Mesh, *, axis: str = TP_AXIS):
    """The ``NamedSharding`` of every array (or ``ShapeDtypeStruct``) of ``tree``, as its field declares."""
    size = mesh.shape[axis]
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(declared_split(tree, path), leaf.shape, size, axis)), tree)


def init_sharded(config, key, dtype, mesh: Mesh, *, axis: str = TP_AXIS, **init_kw):
    """Random parameters (``jspec.init_params``, the same values) made already placed as :func:`shard`
    would place them: a model too large for one device never exists on one, nor on the host.

    Each piece (an embedding table, a layer, a norm) is made by a jitted program of its own with
    placed outputs, largest tables first, then each layer's fused weights are put in device-major
    order by a program per layer (donating the plain order). No program holds more than one piece's
    scratch: one program for the whole of a 70B-shaped model needs more than each of two 80 GB GPUs
    holds, and XLA's rematerialisation cannot bring it under the limit."""
    parallel = TensorParallel(mesh, axis)
    fields = {f.name: f.metadata.get("split") for f in dataclasses.fields(_MODEL_OF[type(config)])}

    def placed(fn, *, name=None, static_argnums=()):
        def make(*args):
            piece = fn(*args)
            shardings = (placements(piece, mesh, axis=axis) if name is None else
                         NamedSharding(mesh, param_spec(fields[name], piece.shape, parallel.size, axis)))
            return jax.lax.with_sharding_constraint(piece, shardings)

        return jax.jit(make, static_argnums=static_argnums)

    model = init_params(config, key, dtype=dtype, build=placed, **init_kw)
    layers = tuple(_device_major_layer(layer, tuple(model.fused_columns(index).items()), parallel)
                   for index, layer in enumerate(model.layers))
    return with_placement(dataclasses.replace(model, layers=layers), parallel)


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _device_major_layer(layer, columns, parallel: TensorParallel):
    layer = map_fused_layer(layer, dict(columns), parallel.interleave_columns)
    return jax.lax.with_sharding_constraint(layer, placements(layer, parallel.mesh, axis=parallel.axis))


def device_major(model, parallel: TensorParallel):
    """``model`` with its fused weights in ``parallel``'s device-major column order."""
    return map_fused(model, parallel.interleave_columns)


def shard(tree, mesh: Mesh, *, axis: str = TP_AXIS):
    """``tree`` with every array placed on ``mesh`` (module docstring) and every target model in it
    making its caches split over KV heads. ``ValueError`` for a tree with quantized weights."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no axis {axis!r} (axes: {mesh.axis_names})")
    if quantized_layout(tree):
        raise ValueError("jspec.shard places weight arrays; this tree holds quantized weights, which run on one "
                         "device: shard the unquantized model")

    def place_leaf(leaf):  # a model by its field names; an array outside any model replicated
        if isinstance(leaf, _MODELS):
            parallel = TensorParallel(mesh, axis)
            plain = plain_order(leaf)  # a model placed before: from its plain order again
            shardings = placements(plain, mesh, axis=axis)
            placed = jax.jit(functools.partial(device_major, parallel=parallel),
                             out_shardings=shardings)(jax.device_put(plain, shardings))
            return with_placement(placed, parallel)
        return jax.device_put(leaf, NamedSharding(mesh, PartitionSpec()))

    return jax.tree_util.tree_map(place_leaf, tree, is_leaf=lambda x: isinstance(x, _MODELS))
