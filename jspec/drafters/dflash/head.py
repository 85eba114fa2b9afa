"""The DFlash draft's parameters and its two forwards: the context K/V write and the block.

The draft is ``num_layers`` Qwen3 decoder layers (``jspec.models.llama`` layers with q/k norms)
without embedding or LM head (the target's serve). The target's captured layer outputs of each
committed token, concatenated, become one context vector (``fc``, then ``hidden_norm``) that every
layer turns into K/V with its own ``k_proj`` / ``v_proj`` (k normed, both rotated at the token's
position): the draft's cache holds only these rows. The block -- the last verified token, then
mask tokens -- makes queries, K and V as a layer's rows always do and attends non-causally to the
whole block and to every context row (the decode-attention kernels with an all-true tail mask).

Shapes: ``batch`` sequences, ``T`` rows, ``H`` the draft's (= the target's) hidden size, ``n`` the
number of captured target layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.drafters.dflash.config import DFlashConfig
from jspec.execution import DEFAULT, Execution
from jspec.kv import KVCache
from jspec.layers import HeadNorms, Residual, add_norm, linear, rms_norm, rope_and_write
from jspec.models.base import random_matrix, random_norm_weight
from jspec.models.llama import Layer, init_layer
from jspec.models.llama.model import decoder_layer, qkv_parts
from jspec.quant import MATMUL_WEIGHT
from jspec.step import Step, row_positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashHead:
    """``fc [n * H, H]`` (no bias), ``hidden_norm [H]`` on its output, the draft ``layers``, the final
    ``norm [H]``; linear weights ``[in, out]``."""

    fc: jax.Array = dataclasses.field(metadata=MATMUL_WEIGHT)
    hidden_norm: jax.Array
    layers: tuple[Layer, ...]
    norm: jax.Array
    config: DFlashConfig = dataclasses.field(metadata=dict(static=True))

    @property
    def dtype(self):
        return self.norm.dtype


def init_dflash_head(config: DFlashConfig, key: jax.Array, dtype=jnp.float32, *, scale: float = 0.02) -> DFlashHead:
    """Random parameters (normal(0, scale) matrices, norms near 1) for tests and benchmarks."""
    c = config.layer
    fc_key, hidden_key, norm_key, *layer_keys = jax.random.split(key, 3 + c.num_layers)
    return DFlashHead(
        fc=random_matrix(fc_key, (len(config.target_layer_ids) * c.hidden_size, c.hidden_size), dtype, scale),
        hidden_norm=random_norm_weight(hidden_key, (c.hidden_size,), dtype),
        layers=tuple(init_layer(c, k, dtype, scale=scale) for k in layer_keys),
        norm=random_norm_weight(norm_key, (c.hidden_size,), dtype),
        config=config,
    )


def init_context_kv(head: DFlashHead, batch: int, max_len: int) -> KVCache:
    """An empty context cache of ``max_len`` rows per sequence."""
    c = head.config.layer
    return KVCache.zeros(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, head.dtype)


def context_vectors(head: DFlashHead, features: tuple[jax.Array, ...], ex: Execution = DEFAULT) -> jax.Array:
    """The context vector ``[batch, T, H]`` of each row from the captured target layer outputs
    ``features`` (``n`` arrays ``[batch, T, H]``, ``target_layer_ids``' order)."""
    eps = head.config.layer.rms_norm_eps
    g = jnp.concatenate([f.astype(head.dtype) for f in features], axis=-1)  # [batch, T, n * H]
    return rms_norm(linear(g, head.fc, None, ex), head.hidden_norm, eps, ex)


def _step(head: DFlashHead, kv: KVCache, num_rows: int, ex: Execution, tree_mask=None, window=None) -> Step:
    c = head.config.layer
    return Step.make(row_positions(kv.lengths, num_rows), kv.lengths + num_rows, c.rope_inv_freq(), head.dtype, ex,
                     tree_mask=tree_mask, window=window)


def write_context(head: DFlashHead, kv: KVCache, context: jax.Array, ex: Execution = DEFAULT) -> KVCache:
    """Every layer's K/V of the context rows ``context [batch, T, H]`` (:func:`context_vectors`) at
    positions ``kv.lengths + 0..T-1``. Returns the cache with ``lengths`` advanced by ``T``."""
    c = head.config.layer
    step = _step(head, kv, context.shape[1], ex)
    caches = []
    for layer, k_buf, v_buf in zip(head.layers, kv.k, kv.v):
        qkv = linear(context, layer.qkv, layer.qkv_bias, ex, split="column")
        norms = HeadNorms(layer.q_norm, layer.k_norm, c.rms_norm_eps)
        _, k_buf, v_buf = rope_and_write(qkv, qkv_parts(c), c.head_dim, k_buf, v_buf, step, norms)
        caches.append((k_buf, v_buf))
    return kv.written(caches, context.shape[1])


def block_hidden(head: DFlashHead, kv: KVCache, x: jax.Array, ex: Execution = DEFAULT) -> tuple[jax.Array, KVCache]:
    """The draft's final-normed hidden ``[batch, T, H]`` of the block ``x [batch, T, H]`` (embedded
    tokens) at positions ``kv.lengths + 0..T-1``, every row seeing every context row and every row
    of the block (a sliding-window layer: the block causally, and rows in its window). Returns it
    with the cache whose buffers hold the block's K/V past ``kv.lengths`` (its lengths unchanged: the
    block never persists, and the next write overwrites it)."""
    config, num_rows = head.config, x.shape[1]
    c = config.layer
    shape = (x.shape[0], num_rows, num_rows)
    steps = {None: _step(head, kv, num_rows, ex, tree_mask=jnp.ones(shape, bool))}
    if config.sliding_window is not None:
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((num_rows, num_rows), bool)), shape)
        steps[config.sliding_window] = _step(head, kv, num_rows, ex, tree_mask=causal, window=config.sliding_window)
    residual = Residual(x)
    caches = []
    for i, (layer, k_buf, v_buf) in enumerate(zip(head.layers, kv.k, kv.v)):
        x, h = add_norm(residual, layer.attn_norm, c.rms_norm_eps, ex)
        residual, cache = decoder_layer(layer, c, x, h, (k_buf, v_buf), steps[config.window(i)])
        caches.append(cache)
    _, normed = add_norm(residual, head.norm, c.rms_norm_eps, ex)
    return normed, kv.written(caches, num_rows).truncate(kv.lengths)
