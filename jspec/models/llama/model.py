"""Llama 3 / Qwen2 / Qwen3 decoder as a pure forward function over a parameter pytree.

Layers are held one pytree node per layer and looped in Python inside the jitted caller:
a decode step runs markedly faster than with ``lax.scan`` over stacked weights, at the price of
compile time growing with depth.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.execution import DEFAULT, Execution
from jspec.kv import KVCache
from jspec.parallel import COLUMN, ROW, per_head, split
from jspec.layers import HeadNorms, Residual, add_norm, embedding, gated_mlp, linear, linear_parts, rope_and_write
from jspec.models.base import (NO_CAPTURE, Capture, as_is, check_forward_args, lm_head, random_matrix,
                               random_norm_weight)
from jspec.models.llama.config import LlamaConfig
from jspec.quant import MATMUL_WEIGHT, TABLE_WEIGHT
from jspec.step import Step, row_positions
from pallas_kernels import decode_attention, gather_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """One decoder layer. Linear weights are ``[in, out]`` (transposed once at load)."""

    attn_norm: jax.Array  # [hidden]
    qkv: jax.Array = split(COLUMN, metadata=MATMUL_WEIGHT)  # [hidden, q_size + 2 * kv_size]   (q | k | v)
    o: jax.Array = split(ROW, metadata=MATMUL_WEIGHT)  # [q_size, hidden]
    mlp_norm: jax.Array  # [hidden]
    gate_up: jax.Array = split(COLUMN, metadata=MATMUL_WEIGHT)  # [hidden, 2 * intermediate]  (gate | up)
    down: jax.Array = split(ROW, metadata=MATMUL_WEIGHT)  # [intermediate, hidden]
    qkv_bias: jax.Array | None = split(COLUMN, default=None)  # [q_size + 2 * kv_size]   Qwen2
    q_norm: jax.Array | None = None  # [head_dim]   Qwen3
    k_norm: jax.Array | None = None  # [head_dim]   Qwen3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """Parameters of a decoder LM; ``config`` is static (hashable) pytree aux data."""

    embed: jax.Array = split(ROW, metadata=TABLE_WEIGHT)  # [vocab, hidden]
    layers: tuple[Layer, ...]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None = split(COLUMN, metadata=MATMUL_WEIGHT)  # [hidden, vocab]; None when tied to ``embed``
    config: LlamaConfig = dataclasses.field(metadata=dict(static=True))
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))  # kernels, placement

    @property
    def dtype(self):
        return self.embed.dtype

    def fused_columns(self, index: int) -> dict[str, tuple[int, ...]]:
        """The fused weights of layer ``index`` and their column parts (``jspec.parallel``)."""
        c = self.config
        return {"qkv": qkv_parts(c), "qkv_bias": qkv_parts(c), "gate_up": (c.intermediate_size,) * 2}

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache.zeros(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.dtype,
                             placement=self.execution.placement)


def qkv_parts(c: LlamaConfig) -> tuple[int, int, int]:
    """The column parts of the fused ``q | k | v`` projection."""
    return c.q_size, c.kv_size, c.kv_size


def attention(layer, c: LlamaConfig, h, cache, step: Step):
    """Self-attention of one layer.

    Args:
      h: the normed input rows ``[batch, T, in]`` (``in`` is usually ``hidden``; EAGLE-3's midlayer
        reads ``2 * hidden``).
      cache: the layer's ``(k_buf, v_buf)``, each ``[batch, kv_heads, L, head_dim]``.
      step: positions, RoPE tables and lengths (:class:`jspec.step.Step`). The K/V of all ``T`` rows
        is written; with ``step.keep_rows`` only that row's query is kept right after the write (the
        others are dead: their K/V is all the caller needs).
    Returns:
      ``(parts, (k_buf, v_buf))``: the output projection's partial sums ``[splits, batch, T', hidden]``
      (``jspec.layers.linear_parts``), ``T' = 1`` with ``keep_rows``, else ``T``. On a placed model
      attention and projections run per device.
    """
    ex, keep_rows = step.execution, step.keep_rows
    batch, num_rows, _ = h.shape
    if keep_rows is not None and step.tree_mask is not None:
        raise ValueError("keep_rows and tree_mask together are not supported")
    qkv = linear(h, layer.qkv, layer.qkv_bias, ex, split="column")
    norms = HeadNorms(layer.q_norm, layer.k_norm, c.rms_norm_eps)
    q, k_buf, v_buf = rope_and_write(qkv, qkv_parts(c), c.head_dim, *cache, step, norms)
    positions = step.positions
    if keep_rows is not None:
        q = gather_rows(q.reshape(batch, num_rows, c.q_size), keep_rows, impl=ex.kernels)
        q = q.reshape(batch, 1, c.num_heads, c.head_dim)
        positions = jnp.take_along_axis(positions, keep_rows[:, None], axis=1)

    def attend(q, k_buf, v_buf, kv_lengths, positions, tree_mask):
        return decode_attention(q, k_buf, v_buf, kv_lengths, q_positions=positions, tail_mask=tree_mask,
                                window=step.window, impl=ex.kernels)

    attn = per_head(attend, q, k_buf, v_buf, step.kv_lengths, positions, step.tree_mask, parallel=ex.placement)
    out = linear_parts(attn.reshape(batch, q.shape[1], c.q_size), layer.o, ex, split="row")
    return out, (k_buf, v_buf)


def decoder_layer(layer: Layer, c: LlamaConfig, x: jax.Array, h: jax.Array, cache, step: Step):
    """One pre-norm decoder layer.

    Args:
      x: the residual stream ``[batch, T, hidden]``, its pending branches added.
      h: the attention's input rows: ``rms_norm(x, layer.attn_norm)`` from the caller's
        ``add_norm`` (EAGLE-3 feeds ``cat(norm(embedding), norm(hidden))``, ``[batch, T, 2 * hidden]``).
      cache: the layer's ``(k_buf, v_buf)``.
      step: as for :func:`attention`. ``step.keep_rows [batch]``: after the K/V write only that row
        of each sequence goes on (attention query, residual, MLP): dead rows never reach the rest of
        the layer. ``step.tree_mask``: tree attention among the ``T`` rows; not with ``keep_rows``.
    Returns:
      ``(Residual, (k_buf, v_buf))``: the stream after the attention with the MLP's output pending
      (``[batch, T', hidden]``, ``T' = 1`` with ``keep_rows``), for the next ``add_norm`` to add in
      its own launch (``jspec.layers``).
    """
    ex = step.execution
    attn_out, cache = attention(layer, c, h, cache, step)
    if step.keep_rows is not None:
        x = gather_rows(x, step.keep_rows, impl=ex.kernels)[:, None]
    x, h = add_norm(Residual(x, attn_out), layer.mlp_norm, c.rms_norm_eps, ex)
    return Residual(x, gated_mlp(h, layer.gate_up, layer.down, "silu", ex)), cache


def forward(
    model: Model,
    tokens: jax.Array,
    kv: KVCache,
    *,
    capture: Capture = NO_CAPTURE,
    logits_rows: jax.Array | None = None,
    compute_logits: bool = True,
    tree_mask: jax.Array | None = None,
) -> tuple[jax.Array | None, tuple[jax.Array, ...], KVCache]:
    """Run ``tokens [batch, T]`` at positions ``kv.lengths[b] + 0..T-1`` (a tree's rows at their
    depths, with ``tree_mask``), writing their K/V. The contract of every family
    (``jspec.models.base``).

    Args:
      model: the parameters; ``model.execution`` (static) picks the kernels and the placement.
      tokens: ``[batch, T]`` int32.
      kv: the cache, ``lengths [batch]`` rows valid per sequence.
      capture: the hidden states to return (a drafter's ``capture()``).
      logits_rows: ``[batch, n]`` int32, the rows that get logits (negative: from the end);
        None: every row.
      compute_logits: False: no LM head (a drafter's catch-up, a prefill that samples elsewhere).
      tree_mask: ``[batch, T, T]`` bool, tree attention among the rows (``jspec.step``).
    Returns:
      ``(logits, features, kv)``: fp32 logits ``[batch, T or n, vocab]`` (None without
      ``compute_logits``), the ``capture``d hidden states ``[batch, T, hidden]`` in its order, and
      the cache with ``lengths`` advanced by ``T`` (callers that wrote padding or rejected rows
      shrink it with ``kv.truncate``).
    """
    c, ex = model.config, model.execution
    num_rows = tokens.shape[1]
    check_forward_args(tokens, capture, logits_rows, c.num_layers, tree_mask)
    step = Step.make(row_positions(kv.lengths, num_rows, tree_mask), kv.lengths + num_rows, c.rope_inv_freq(),
                     model.dtype, ex, tree_mask=tree_mask)
    residual = Residual(embedding(model.embed, tokens, ex.placement))  # [batch, T, hidden]
    residuals = {}
    caches = []
    for i, layer in enumerate(model.layers):
        x, h = add_norm(residual, layer.attn_norm, c.rms_norm_eps, ex)
        if i in capture.residuals:
            residuals[i] = x
        residual, cache = decoder_layer(layer, c, x, h, (kv.k[i], kv.v[i]), step)
        caches.append(cache)

    wants_normed = capture.final_normed or (compute_logits and logits_rows is None)
    x, normed = add_norm(residual, model.final_norm if wants_normed else None, c.rms_norm_eps, ex)
    residuals[c.num_layers] = x
    features = tuple(residuals[i] for i in capture.residuals)
    features += (normed,) if capture.final_normed else ()
    if not compute_logits:
        logits = None
    elif logits_rows is None:
        logits = lm_head(model.embed, model.lm_head, normed, ex)
    else:
        rows = gather_rows(x, logits_rows, norm_weight=model.final_norm, eps=c.rms_norm_eps, impl=ex.kernels)
        logits = lm_head(model.embed, model.lm_head, rows, ex)
    return logits, features, kv.written(caches, num_rows)


def init_layer(config: LlamaConfig, key: jax.Array, dtype=jnp.float32, *, scale: float = 0.02, in_size=None) -> Layer:
    """A random ``Layer``; its attention reads ``in_size``-wide rows (default ``hidden_size``)."""
    c = config
    in_size = c.hidden_size if in_size is None else in_size
    k = iter(jax.random.split(key, 9))
    return Layer(
        attn_norm=random_norm_weight(next(k), (c.hidden_size,), dtype),
        qkv=random_matrix(next(k), (in_size, c.q_size + 2 * c.kv_size), dtype, scale),
        o=random_matrix(next(k), (c.q_size, c.hidden_size), dtype, scale),
        mlp_norm=random_norm_weight(next(k), (c.hidden_size,), dtype),
        gate_up=random_matrix(next(k), (c.hidden_size, 2 * c.intermediate_size), dtype, scale),
        down=random_matrix(next(k), (c.intermediate_size, c.hidden_size), dtype, scale),
        qkv_bias=random_matrix(next(k), (c.q_size + 2 * c.kv_size,), dtype, scale) if c.qkv_bias else None,
        q_norm=random_norm_weight(next(k), (c.head_dim,), dtype) if c.qk_norm else None,
        k_norm=random_norm_weight(next(k), (c.head_dim,), dtype) if c.qk_norm else None,
    )


def init_params(config: LlamaConfig, key: jax.Array, dtype=jnp.float32, *, scale: float = 0.02, build=as_is) -> Model:
    """Random parameters (normal(0, scale) matrices, norms near 1), generated where jax runs;
    ``build``: how each piece is made (:func:`jspec.models.base.as_is`).

    For tests and benchmarks at real shapes; not a training initialisation.
    """
    c = config
    embed_key, norm_key, head_key, *layer_keys = jax.random.split(key, 3 + c.num_layers)
    embed = build(random_matrix, name="embed", static_argnums=(1, 2, 3))(
        embed_key, (c.vocab_size, c.hidden_size), dtype, scale)
    head = None if c.tie_word_embeddings else build(random_matrix, name="lm_head", static_argnums=(1, 2, 3))(
        head_key, (c.hidden_size, c.vocab_size), dtype, scale)
    layer = build(functools.partial(init_layer, scale=scale), static_argnums=(0, 2))  # one program for every layer
    return Model(
        embed=embed,
        layers=tuple(layer(c, k, dtype) for k in layer_keys),
        final_norm=build(random_norm_weight, name="final_norm", static_argnums=(1, 2))(norm_key, (c.hidden_size,), dtype),
        lm_head=head,
        config=c,
    )
