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

from jspec.kv import KVCache
from jspec.parallel import TensorParallel, per_head
from jspec.layers import add_parts, add_rms_norm, fuses_around_kernels, linear, rms_norm, rope_and_write, silu_mlp
from jspec.models.base import (NO_CAPTURE, Capture, as_is, lm_head, random_matrix, random_norm_weight,
                               token_positions)
from jspec.models.llama.config import LlamaConfig
from jspec.rope import rope_cos_sin
from pallas_kernels import decode_attention, gather_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """One decoder layer. Linear weights are ``[in, out]`` (transposed once at load)."""

    attn_norm: jax.Array  # [hidden]
    qkv: jax.Array  # [hidden, q_size + 2 * kv_size]   (q | k | v)
    o: jax.Array  # [q_size, hidden]
    mlp_norm: jax.Array  # [hidden]
    gate_up: jax.Array  # [hidden, 2 * intermediate]  (gate | up)
    down: jax.Array  # [intermediate, hidden]
    qkv_bias: jax.Array | None = None  # [q_size + 2 * kv_size]   Qwen2
    q_norm: jax.Array | None = None  # [head_dim]   Qwen3
    k_norm: jax.Array | None = None  # [head_dim]   Qwen3


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """Parameters of a decoder LM; ``config`` is static (hashable) pytree aux data."""

    embed: jax.Array  # [vocab, hidden]
    layers: tuple[Layer, ...]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to ``embed``
    config: LlamaConfig = dataclasses.field(metadata=dict(static=True))
    tensor_parallel: TensorParallel | None = dataclasses.field(default=None, metadata=dict(static=True))  # jspec.shard

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
                             placement=self.tensor_parallel)


def qkv_parts(c: LlamaConfig) -> tuple[int, int, int]:
    """The column parts of the fused ``q | k | v`` projection."""
    return c.q_size, c.kv_size, c.kv_size


def attention(
    layer, c: LlamaConfig, h, positions, cos, sin, k_buf, v_buf, lengths, *, keep_rows=None, tree_mask=None,
    impl="auto", parallel: TensorParallel | None = None, split_parts: bool = False,
):
    """Self-attention of one layer over the normed rows ``h [batch, T, in]`` (``in`` is usually
    ``hidden``; EAGLE-3's midlayer reads ``2 * hidden``).

    Writes the K/V of all ``T`` rows at ``lengths[b] ..``. With ``keep_rows [batch]`` only that
    row's query is kept right after the K/V write (the others are dead: their K/V is all the
    caller needs) and the output is ``[batch, 1, hidden]``; otherwise ``[batch, T, hidden]``.
    ``parallel``: a placed model's (``jspec.shard``): attention and projections run per device.
    ``split_parts``: the output projection as partial sums ``[splits, batch, rows, hidden]``
    (``jspec.layers.linear``).
    """
    batch, num_rows, _ = h.shape
    if keep_rows is not None and tree_mask is not None:
        raise ValueError("keep_rows and tree_mask together are not supported")
    qkv = linear(h, layer.qkv, layer.qkv_bias, impl=impl, parallel=parallel, split="column")
    q, k_buf, v_buf = rope_and_write(qkv, qkv_parts(c), cos, sin, k_buf, v_buf, lengths, head_dim=c.head_dim,
                                     q_norm=layer.q_norm, k_norm=layer.k_norm, eps=c.rms_norm_eps, impl=impl,
                                     parallel=parallel)
    if keep_rows is not None:
        q = gather_rows(q.reshape(batch, num_rows, c.q_size), keep_rows, impl=impl)
        q = q.reshape(batch, 1, c.num_heads, c.head_dim)
        positions = jnp.take_along_axis(positions, keep_rows[:, None], axis=1)
        num_q = 1
    else:
        num_q = num_rows
    def attend(q, k_buf, v_buf, kv_lengths, positions, tree_mask):
        return decode_attention(q, k_buf, v_buf, kv_lengths, q_positions=positions, tail_mask=tree_mask, impl=impl)

    args = (q, k_buf, v_buf, lengths + num_rows, positions, tree_mask)
    attn = per_head(attend, *args, parallel=parallel)
    out = linear(attn.reshape(batch, num_q, c.q_size), layer.o, impl=impl, parallel=parallel, split="row",
                 split_parts=split_parts)
    return out, k_buf, v_buf


def decoder_layer(
    layer: Layer,
    c: LlamaConfig,
    x: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array,
    lengths: jax.Array,
    positions: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    *,
    attn_input: jax.Array | None = None,
    keep_rows: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
    impl: str = "auto",
    parallel: TensorParallel | None = None,
    defer_mlp: bool = False,
):
    """One pre-norm decoder layer on the residual stream ``x [batch, T, hidden]``.

    ``attn_input``: the attention's input rows instead of ``rms_norm(x, layer.attn_norm)``
    (EAGLE-3 feeds ``cat(norm(embedding), norm(hidden))``). ``keep_rows [batch]``: after the
    K/V write keep only that row of each sequence (attention query, residual, MLP), returning
    ``[batch, 1, hidden]`` -- dead rows never reach the rest of the layer. ``tree_mask [batch, T, T]``:
    tree attention among the ``T`` rows (``jspec.models.base``); not with ``keep_rows``.
    Returns ``(x, k_buf, v_buf)``; with ``defer_mlp`` (where kernels fuse) ``(x, mlp_parts, k_buf,
    v_buf)``: the MLP's output as partial sums ``[splits, batch, T, hidden]`` not yet added to x, for
    the next norm to add in its own launch (``forward``).
    """
    h = rms_norm(x, layer.attn_norm, c.rms_norm_eps, impl=impl) if attn_input is None else attn_input
    # Where kernels fuse, the output projection's split-K partials, the residual add and the MLP's
    # norm are one launch (jspec.layers.add_rms_norm).
    fused = fuses_around_kernels(impl, parallel)
    attn_out, k_buf, v_buf = attention(
        layer, c, h, positions, cos, sin, k_buf, v_buf, lengths, keep_rows=keep_rows, tree_mask=tree_mask, impl=impl,
        parallel=parallel, split_parts=fused,
    )
    if keep_rows is not None:
        x = gather_rows(x, keep_rows, impl=impl)[:, None]
    if fused:
        x, h = add_rms_norm(x, attn_out, layer.mlp_norm, c.rms_norm_eps, impl=impl)
    else:
        x = x + attn_out
        h = rms_norm(x, layer.mlp_norm, c.rms_norm_eps, impl=impl)
    mlp = silu_mlp(h, layer.gate_up, layer.down, impl=impl, parallel=parallel, split_parts=defer_mlp)
    return (x, mlp, k_buf, v_buf) if defer_mlp else (x + mlp, k_buf, v_buf)


def forward(
    model: Model,
    tokens: jax.Array,
    kv: KVCache,
    *,
    capture: Capture = NO_CAPTURE,
    logits_rows: jax.Array | None = None,
    compute_logits: bool = True,
    impl: str = "auto",
    tree_mask: jax.Array | None = None,
) -> tuple[jax.Array | None, tuple[jax.Array, ...], KVCache]:
    """Run ``tokens [batch, T]`` at positions ``kv.lengths[b] + 0..T-1`` (a tree's rows at their
    depths, with ``tree_mask``), writing their K/V.

    The contract of every family (``jspec.models.base``): returns ``(logits, features, kv)``
    with fp32 logits for every row or for ``logits_rows [batch, n]`` (None with
    ``compute_logits=False``), the ``capture``d hidden states ``[batch, T, hidden]`` and the
    cache with ``lengths`` advanced by ``T`` (callers that wrote padding or rejected rows shrink
    it with ``kv.truncate``).
    """
    c = model.config
    batch, num_rows = tokens.shape
    positions = token_positions(tokens, kv, capture, logits_rows, c.num_layers, tree_mask)  # [batch, T]
    cos, sin = rope_cos_sin(positions, jnp.asarray(c.rope_inv_freq()), model.dtype)
    x = model.embed[tokens]  # [batch, T, hidden]

    # Where kernels fuse, a layer's MLP output stays split-K partials that the next norm (the next
    # layer's, or the final one) adds to the residual stream in its own launch.
    deferred = fuses_around_kernels(impl, model.tensor_parallel)
    mlp_parts = None
    residuals = {}
    new_k, new_v = [], []
    for i, layer in enumerate(model.layers):
        h = None
        if mlp_parts is not None:
            x, h = add_rms_norm(x, mlp_parts, layer.attn_norm, c.rms_norm_eps, impl=impl)
        if i in capture.residuals:
            residuals[i] = x
        *out, k_buf, v_buf = decoder_layer(
            layer, c, x, kv.k[i], kv.v[i], kv.lengths, positions, cos, sin, attn_input=h, tree_mask=tree_mask,
            impl=impl, parallel=model.tensor_parallel, defer_mlp=deferred,
        )
        x, mlp_parts = out if deferred else (out[0], None)
        new_k.append(k_buf)
        new_v.append(v_buf)

    normed = None
    if capture.final_normed or (compute_logits and logits_rows is None):
        if mlp_parts is None:
            normed = rms_norm(x, model.final_norm, c.rms_norm_eps, impl=impl)
        else:
            x, normed = add_rms_norm(x, mlp_parts, model.final_norm, c.rms_norm_eps, impl=impl)
    elif mlp_parts is not None:
        x = add_parts(x, mlp_parts)
    residuals[c.num_layers] = x
    features = tuple(residuals[i] for i in capture.residuals)
    features += (normed,) if capture.final_normed else ()
    if not compute_logits:
        logits = None
    elif logits_rows is None:
        logits = lm_head(model.embed, model.lm_head, normed, impl=impl, parallel=model.tensor_parallel)
    else:
        rows = gather_rows(x, logits_rows, norm_weight=model.final_norm, eps=c.rms_norm_eps, impl=impl)
        logits = lm_head(model.embed, model.lm_head, rows, impl=impl, parallel=model.tensor_parallel)

    new_kv = KVCache(k=tuple(new_k), v=tuple(new_v), lengths=kv.lengths + num_rows)
    return logits, features, new_kv


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
