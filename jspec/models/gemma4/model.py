"""Gemma 4 dense text decoder (transformers ``Gemma4ForCausalLM``) as a pure forward function over a parameter pytree.

Same contract as every family (``jspec.models.base``). What differs from Llama:

* two layer types: sliding-window layers (``head_dim``, ``num_kv_heads``, default RoPE) and
  full layers (``global_head_dim``, ``num_global_kv_heads``, proportional RoPE; with
  ``attention_k_eq_v`` no ``v_proj``: V is the raw ``k_proj`` output). Every cache buffer is
  full length; sliding layers mask by window (the window includes the query).
* q/k RMSNorm with weight, weightless v RMSNorm, attention scale 1.0; four norms per layer
  (each branch output is normed before the residual add); the layer output is multiplied by
  ``layer_scalar``; GELU-tanh MLP; embeddings scaled by ``sqrt(hidden)`` in the weight dtype;
  final logits soft-capped in fp32.
* per-layer embeddings (PLE, E2B / E4B): every layer gets its own ``[P]`` input, from a token
  table plus a projection of the embedded input, through a gated residual branch after the MLP.
* KV sharing (E2B / E4B): the last ``num_kv_shared_layers`` layers have no K/V projections and
  attend to the cache of the last non-shared layer of their type. They own no cache buffer:
  the cache holds ``first_kv_shared_layer`` layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.execution import DEFAULT, Execution
from jspec.kv import KVCache
from jspec.parallel import COLUMN, ROW, TensorParallel, per_head, split, split_columns
from jspec.layers import (ACTIVATIONS, HeadNorms, Residual, add_norm, apply_rope, embedding, gated_mlp, linear,
                          linear_parts, rope_and_write)
from jspec.layers import rms_norm_fp32_scale as rms_norm
from jspec.models.base import (NO_CAPTURE, Capture, as_is, check_forward_args, lm_head, random_matrix,
                               random_norm_weight)
from jspec.models.gemma4.config import SLIDING, Gemma4Config
from jspec.quant import MATMUL_WEIGHT, TABLE_WEIGHT
from jspec.step import Step, row_positions
from pallas_kernels import decode_attention, gather_rows
from pallas_kernels.norm.gather_rows import FP32_SCALE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """One decoder layer; ``hd`` and ``kv`` are the layer type's head_dim and KV heads.
    Linear weights are ``[in, out]`` (transposed once at load)."""

    attn_norm: jax.Array  # [hidden]   input_layernorm
    qkv: jax.Array = split(COLUMN, metadata=MATMUL_WEIGHT)  # [hidden, heads*hd (+ kv*hd k) (+ kv*hd v)]: no k, v on KV-shared layers, no v with k_eq_v
    q_norm: jax.Array  # [hd]
    o: jax.Array = split(ROW, metadata=MATMUL_WEIGHT)  # [heads * hd, hidden]
    post_attn_norm: jax.Array  # [hidden]
    mlp_norm: jax.Array  # [hidden]   pre_feedforward_layernorm
    gate_up: jax.Array = split(COLUMN, metadata=MATMUL_WEIGHT)  # [hidden, 2 * intermediate]  (gate | up)
    down: jax.Array = split(ROW, metadata=MATMUL_WEIGHT)  # [intermediate, hidden]
    post_mlp_norm: jax.Array  # [hidden]   post_feedforward_layernorm
    layer_scalar: jax.Array  # [1]
    k_norm: jax.Array | None = None  # [hd]; None on KV-shared layers
    ple_gate: jax.Array | None = dataclasses.field(default=None, metadata=MATMUL_WEIGHT)  # [hidden, P]   per_layer_input_gate
    ple_proj: jax.Array | None = dataclasses.field(default=None, metadata=MATMUL_WEIGHT)  # [P, hidden]   per_layer_projection
    ple_norm: jax.Array | None = None  # [hidden]      post_per_layer_input_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PerLayerEmbedding:
    """PLE inputs shared by all layers; the ``L * P`` axes pack layer-major ``[L, P]``."""

    embed: jax.Array = split(ROW, metadata=TABLE_WEIGHT)  # [vocab_per_layer, L * P]   embed_tokens_per_layer
    projection: jax.Array = dataclasses.field(metadata=MATMUL_WEIGHT)  # [hidden, L * P]   per_layer_model_projection
    norm: jax.Array  # [P]                           per_layer_projection_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """Gemma 4 parameters; ``config`` is static (hashable) pytree aux data."""

    embed: jax.Array = split(ROW, metadata=TABLE_WEIGHT)  # [vocab, hidden]
    layers: tuple[Layer, ...]
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None = split(COLUMN, metadata=MATMUL_WEIGHT)  # [hidden, vocab]; None when tied to ``embed``
    ple: PerLayerEmbedding | None
    config: Gemma4Config = dataclasses.field(metadata=dict(static=True))
    execution: Execution = dataclasses.field(default=DEFAULT, metadata=dict(static=True))  # kernels, placement

    @property
    def dtype(self):
        return self.embed.dtype

    def fused_columns(self, index: int) -> dict[str, tuple[int, ...]]:
        """The fused weights of layer ``index`` and their column parts (``jspec.parallel``)."""
        return {"qkv": qkv_parts(self.config, index), "gate_up": (self.config.mlp_size(index),) * 2}

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Buffers for the layers that own K/V, each in its layer type's shape."""
        c = self.config
        geometry = [c.attention_shape(i) for i in range(c.first_kv_shared_layer)]
        shapes = [(batch, kv_heads, max_len, head_dim) for kv_heads, head_dim in geometry]
        return KVCache.of_shapes(shapes, self.dtype, placement=self.execution.placement)


def qkv_parts(c: Gemma4Config, index: int) -> tuple[int, ...]:
    """The column parts of layer ``index``'s fused projection: ``q``, then ``k`` on a layer that
    owns its K/V, then ``v`` unless ``attention_k_eq_v`` reuses k."""
    kv_heads, head_dim = c.attention_shape(index)
    q_size, kv_size = c.num_heads * head_dim, kv_heads * head_dim
    if c.kv_source(index) != index:
        return (q_size,)
    return (q_size, kv_size, kv_size) if c.has_v_proj(index) else (q_size, kv_size)


def _scale_in_dtype(value: float, dtype) -> jax.Array:
    # HF makes an fp32 tensor and casts it to the weight dtype (sqrt(3072) is 55.5 in bf16).
    return jnp.asarray(np.float32(value)).astype(dtype)


def embed_tokens(embed: jax.Array, tokens: jax.Array, placement: TensorParallel | None = None) -> jax.Array:
    """Gemma's input embedding ``embed[tokens] * sqrt(hidden)``, scaled in the table's dtype.
    ``embed [vocab, hidden]``, ``tokens [...]`` -> ``[..., hidden]``."""
    return embedding(embed, tokens, placement) * _scale_in_dtype(embed.shape[1] ** 0.5, embed.dtype)


def per_layer_inputs(model: Model, tokens: jax.Array, x: jax.Array) -> jax.Array:
    """Each layer's PLE input ``[batch, T, L, P]`` for ``tokens [batch, T]`` with scaled
    embeddings ``x [batch, T, hidden]``: ``(norm(proj(x) / sqrt(H)) + table[t] * sqrt(P)) / sqrt(2)``
    (HF ``get_per_layer_inputs`` + ``project_per_layer_inputs``)."""
    c, ple = model.config, model.ple
    shape = (*tokens.shape, c.num_layers, c.hidden_size_per_layer_input)
    from_token = (embedding(ple.embed, tokens, model.execution.placement) * _scale_in_dtype(c.hidden_size_per_layer_input**0.5, model.dtype)).reshape(shape)
    from_context = linear(x, ple.projection, None, model.execution) * c.hidden_size**-0.5
    from_context = rms_norm(from_context.reshape(shape), ple.norm, c.rms_norm_eps, model.execution)
    return (from_context + from_token) * 2.0**-0.5


def attention(layer: Layer, c: Gemma4Config, index: int, h, cache, step: Step):
    """Self-attention of layer ``index`` over normed rows ``h [batch, T, hidden]`` (``Step``: their
    positions and RoPE tables for this layer's type); ``cache``: the ``(k_buf, v_buf)`` it writes or,
    on a KV-shared layer, reads.

    A layer that owns its cache writes the K/V of its ``T`` rows as the last ``T`` of
    ``step.kv_lengths``; a KV-shared layer reads its source layer's buffers (written earlier in this
    step) as they are, so its rows may be any subset of the step's. On a placed model attention and
    projections run per device. Returns ``(parts, (k_buf, v_buf))``: the output projection's partial
    sums ``[splits, batch, T, hidden]`` (``jspec.layers.linear_parts``).
    """
    ex = step.execution
    batch, num_rows, _ = h.shape
    _, head_dim = c.attention_shape(index)
    q_size = c.num_heads * head_dim
    proj = linear(h, layer.qkv, None, ex, split="column")
    parts = qkv_parts(c, index)
    k_buf, v_buf = cache
    if len(parts) > 1:  # q, k and (unless k_eq_v: the raw k) v: normed, rotated and written in one kernel
        norms = HeadNorms(layer.q_norm, layer.k_norm, c.rms_norm_eps, FP32_SCALE, v=True)
        q, k_buf, v_buf = rope_and_write(proj, parts, head_dim, k_buf, v_buf, step, norms)
    else:  # a KV-shared layer: q only
        q = split_columns(proj, parts, ex.placement)[0].reshape(batch, num_rows, c.num_heads, head_dim)
        q = rms_norm(q, layer.q_norm, c.rms_norm_eps, ex)
        q = apply_rope(q, step.cos, step.sin)

    def attend(q, k_buf, v_buf, kv_lengths, positions, tree_mask):
        return decode_attention(q, k_buf, v_buf, kv_lengths, q_positions=positions, tail_mask=tree_mask,
                                window=c.window(index), scale=1.0, impl=ex.kernels)

    attn = per_head(attend, q, k_buf, v_buf, step.kv_lengths, step.positions, step.tree_mask, parallel=ex.placement)
    out = linear_parts(attn.reshape(batch, num_rows, q_size), layer.o, ex, split="row")
    return out, (k_buf, v_buf)


def decoder_layer(layer: Layer, c: Gemma4Config, index: int, x: jax.Array, h: jax.Array, cache, step: Step,
                  per_layer_input):
    """Layer ``index``.

    Args:
      x: the residual stream ``[batch, T, hidden]``, its pending branches added.
      h: ``norm(x, layer.attn_norm)``, from the caller's ``add_norm``.
      cache, step: as for :func:`attention`.
      per_layer_input: ``[batch, T, P]``, or None without PLE.
    Returns:
      ``(Residual, (k_buf, v_buf))``: the stream with the layer's last branch pending, its post-norm
      and ``layer_scalar`` too, for the next ``add_norm`` (``jspec.layers``): where kernels fuse, one
      launch post-norms the branch's partial sums, adds them, scales, and norms the result for the
      next consumer.
    """
    ex, eps = step.execution, c.rms_norm_eps
    add = functools.partial(add_norm, eps=eps, ex=ex, rounding=FP32_SCALE)
    attn_out, cache = attention(layer, c, index, h, cache, step)
    x, h = add(Residual(x, attn_out, layer.post_attn_norm), layer.mlp_norm)
    branch = Residual(x, gated_mlp(h, layer.gate_up, layer.down, "gelu_tanh", ex), layer.post_mlp_norm)
    if per_layer_input is not None:
        x, _ = add(branch, None)
        gated = ACTIVATIONS["gelu_tanh"](linear(x, layer.ple_gate, None, ex)) * per_layer_input
        branch = Residual(x, linear_parts(gated, layer.ple_proj, ex), layer.ple_norm)
    return dataclasses.replace(branch, scale=layer.layer_scalar), cache


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
    depths, with ``tree_mask``), writing their K/V.

    The contract of every family (``jspec.models.base``); logits are soft-capped here.

    KV-shared layers write no cache, so with ``logits_rows`` only those rows enter them (HF
    ``_maybe_slice_kv_shared_inputs``) unless a later feature is captured: a prefill runs the
    last ``num_kv_shared_layers`` layers on one row per sequence.
    """
    c, ex = model.config, model.execution
    if c.first_kv_shared_layer == 0:
        raise ValueError(
            "every layer of this Gemma 4 model is KV-shared (a Gemma 4 assistant): it has no K/V of its own"
        )
    num_rows = tokens.shape[1]
    check_forward_args(tokens, capture, logits_rows, c.num_layers, tree_mask)
    positions = row_positions(kv.lengths, num_rows, tree_mask)  # [batch, T]
    steps = {}  # layer type -> its step (RoPE tables [batch, T, its head_dim])
    for kind in dict.fromkeys(c.layer_types):
        head_dim = c.head_dim if kind == SLIDING else c.global_head_dim
        steps[kind] = Step.make(positions, kv.lengths + num_rows, c.rope(kind).inv_freq(head_dim), model.dtype, ex,
                                tree_mask=tree_mask)
    x = embed_tokens(model.embed, tokens, ex.placement)  # [batch, T, hidden]
    ple = None if model.ple is None else per_layer_inputs(model, tokens, x)  # [batch, T, L, P]

    head_rows = None  # [batch, n] rows that get logits, negative ones counted from the end (as gather_rows)
    if logits_rows is not None and compute_logits:
        head_rows = logits_rows.astype(jnp.int32)
        head_rows = jnp.clip(jnp.where(head_rows < 0, head_rows + num_rows, head_rows), 0, num_rows - 1)
    late_capture = capture.final_normed or any(i > c.first_kv_shared_layer for i in capture.residuals)
    # A tree's rows attend to each other through the mask: all of them stay to the end.
    slice_rows = head_rows is not None and not late_capture and tree_mask is None
    keep_head_rows_at = c.first_kv_shared_layer if slice_rows else None

    residuals = {}
    caches = list(zip(kv.k, kv.v))
    add = functools.partial(add_norm, eps=c.rms_norm_eps, ex=ex, rounding=FP32_SCALE)
    residual = Residual(x)
    for i, layer in enumerate(model.layers):
        cut = i == keep_head_rows_at  # the rows that get logits alone from here (HF _maybe_slice_kv_shared_inputs)
        x, h = add(residual, None if cut else layer.attn_norm)  # the cut takes the stream's rows, not the normed
        if i in capture.residuals:
            residuals[i] = x
        if cut:
            x = gather_rows(x, head_rows, impl=ex.kernels)
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps, ex)
            steps = {kind: step.rows(head_rows) for kind, step in steps.items()}
            ple = None if ple is None else jnp.take_along_axis(ple, head_rows[:, :, None, None], axis=1)
        src = c.kv_source(i)
        residual, caches[src] = decoder_layer(layer, c, i, x, h, caches[src], steps[c.layer_types[i]],
                                              None if ple is None else ple[:, :, i])
    wants_normed = capture.final_normed or (compute_logits and logits_rows is None)
    x, normed = add(residual, model.final_norm if wants_normed else None)
    residuals[c.num_layers] = x
    features = tuple(residuals[i] for i in capture.residuals)
    features += (normed,) if capture.final_normed else ()
    if not compute_logits:
        logits = None
    elif logits_rows is None:
        logits = lm_head(model.embed, model.lm_head, normed, ex)
        logits = softcap(logits, c.final_logit_softcapping)
    else:
        if keep_head_rows_at is None or keep_head_rows_at == c.num_layers:  # x still holds all T rows
            x = gather_rows(x, head_rows, impl=ex.kernels)
        normed_rows = rms_norm(x, model.final_norm, c.rms_norm_eps, ex)
        logits = softcap(lm_head(model.embed, model.lm_head, normed_rows, ex), c.final_logit_softcapping)

    return logits, features, kv.written(caches, num_rows)


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(logits / cap)`` on fp32 logits; identity for ``cap=None``."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def init_layer(c: Gemma4Config, index: int, key: jax.Array, dtype=jnp.float32, *, scale: float = 0.02) -> Layer:
    """A random layer ``index`` (its shapes depend on the layer type, KV sharing and PLE)."""
    _, head_dim = c.attention_shape(index)
    q_size, qkv_size = c.num_heads * head_dim, sum(qkv_parts(c, index))
    owns_kv = c.kv_source(index) == index
    H, inter, P = c.hidden_size, c.mlp_size(index), c.hidden_size_per_layer_input
    k = iter(jax.random.split(key, 14))
    return Layer(
        attn_norm=random_norm_weight(next(k), (H,), dtype),
        qkv=random_matrix(next(k), (H, qkv_size), dtype, scale),
        q_norm=random_norm_weight(next(k), (head_dim,), dtype),
        o=random_matrix(next(k), (q_size, H), dtype, scale),
        post_attn_norm=random_norm_weight(next(k), (H,), dtype),
        mlp_norm=random_norm_weight(next(k), (H,), dtype),
        gate_up=random_matrix(next(k), (H, 2 * inter), dtype, scale),
        down=random_matrix(next(k), (inter, H), dtype, scale),
        post_mlp_norm=random_norm_weight(next(k), (H,), dtype),
        layer_scalar=random_norm_weight(next(k), (1,), dtype),
        k_norm=random_norm_weight(next(k), (head_dim,), dtype) if owns_kv else None,
        ple_gate=random_matrix(next(k), (H, P), dtype, scale) if P else None,
        ple_proj=random_matrix(next(k), (P, H), dtype, scale) if P else None,
        ple_norm=random_norm_weight(next(k), (H,), dtype) if P else None,
    )


def init_params(config: Gemma4Config, key: jax.Array, dtype=jnp.float32, *, scale: float = 0.02,
                build=as_is) -> Model:
    """Random parameters (normal(0, scale) matrices, norms near 1), for tests and benchmarks;
    ``build``: how each piece is made (:func:`jspec.models.base.as_is`)."""
    c = config
    embed_key, norm_key, head_key, ple_key, *layer_keys = jax.random.split(key, 4 + c.num_layers)
    matrix = functools.partial(build, random_matrix, static_argnums=(1, 2, 3))
    embed = matrix(name="embed")(embed_key, (c.vocab_size, c.hidden_size), dtype, scale)
    head = None if c.tie_word_embeddings else matrix(name="lm_head")(head_key, (c.hidden_size, c.vocab_size), dtype,
                                                                     scale)
    ple = None
    if c.hidden_size_per_layer_input:
        width = c.num_layers * c.hidden_size_per_layer_input
        k1, k2, k3 = jax.random.split(ple_key, 3)
        ple = PerLayerEmbedding(
            embed=matrix(name="embed")(k1, (c.vocab_size_per_layer_input, width), dtype, scale),
            projection=matrix(name="projection")(k2, (c.hidden_size, width), dtype, scale),
            norm=build(random_norm_weight, name="norm", static_argnums=(1, 2))(
                k3, (c.hidden_size_per_layer_input,), dtype),
        )
    layer = build(functools.partial(init_layer, scale=scale), static_argnums=(0, 1, 3))
    return Model(
        embed=embed,
        layers=tuple(layer(c, i, k, dtype) for i, k in enumerate(layer_keys)),
        final_norm=build(random_norm_weight, name="final_norm", static_argnums=(1, 2))(norm_key, (c.hidden_size,), dtype),
        lm_head=head,
        ple=ple,
        config=c,
    )
