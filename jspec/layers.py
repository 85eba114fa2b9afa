"""Building blocks shared by every model family, through the kernels' dispatchers: norms,
projections, the gated MLP (its gate fused into the gate/up matmul where a kernel runs), the
residual stream, and RoPE with the K/V cache write after the q/k/v projection; the rotary tables
live in ``jspec.rope``. A projection's weight is an array or a ``jspec.quant.QuantizedWeight``.

The residual protocol, one for every family: a branch of a layer (attention, MLP, Gemma 4's
per-layer input) ends in its output projection's partial sums ``[splits, batch, T, hidden]``
(:func:`linear_parts`; one part, the product itself, where no kernel splits K). A layer returns
the stream with that branch pending (:class:`Residual`), and :func:`add_norm` -- the only place a
branch joins the stream -- adds it and norms the sum for the next consumer, in one launch where
kernels fuse (``pallas_kernels.norm.add_rms_norm``).

Shapes: ``x [batch, T, hidden]`` the residual stream; ``parts [splits, batch, T, hidden]``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.execution import DEFAULT, Execution
from jspec.parallel import TensorParallel, split_columns
from jspec.quant import QuantizedWeight, matmul, matmul_parts, out_features
from jspec.step import Step
from pallas_kernels.norm.add_rms_norm import add_rms_norm, sum_parts
from pallas_kernels.matmul.skinny_matmul import GATES
from pallas_kernels.norm.gather_rows import FP32_SCALE, gather_rows_pallas, rms_norm as _rms_norm
from pallas_kernels.norm.gather_rows import rms_norm_fp32_scale as _rms_norm_fp32_scale
from pallas_kernels.rope_write import check_norm, rope_write, rope_write_heads, rotate_half

__all__ = ["rms_norm", "rms_norm_fp32_scale", "Residual", "add_norm", "linear", "linear_parts", "gated_mlp",
           "check_unquantized", "ACTIVATIONS", "apply_rope", "HeadNorms", "rope_and_write"]

# The MLP gates by name: the matmul kernel applies these to the gate itself where it runs.
ACTIVATIONS = GATES  # "silu" (Llama / Qwen), "gelu_tanh" (HF gelu_pytorch_tanh, Gemma 4)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, ex: Execution = DEFAULT) -> jax.Array:
    """Llama RMSNorm over the last axis of ``x [..., d]`` (normalise in fp32, cast, scale by
    ``weight [d]``). Invariant kernels: the row-norm kernel (a fixed-order sum of squares per row),
    whose result for a row never depends on the program around it; XLA's fused reductions may sum in
    another order in another fusion."""
    if ex.mode("gather_rows") != "invariant":
        return _rms_norm(x, weight, eps)
    return _norm_every_row(x, weight, eps, norm=None)


def _norm_every_row(x, weight, eps, *, norm):
    rows = x.reshape(1, -1, x.shape[-1])
    every_row = jnp.arange(rows.shape[1], dtype=jnp.int32)[None]
    return gather_rows_pallas(rows, every_row, norm_weight=weight, eps=eps, norm=norm).reshape(x.shape)


def rms_norm_fp32_scale(x: jax.Array, weight: jax.Array | None, eps: float, ex: Execution = DEFAULT) -> jax.Array:
    """Gemma 4 RMSNorm of ``x [..., d]``: normalise and scale by ``weight [d]`` in fp32, cast last
    (``rms_norm`` casts before scaling). ``weight=None`` is the weightless variant (Gemma 4
    ``v_norm``). Invariant kernels: the row-norm kernel, as for :func:`rms_norm`."""
    if ex.mode("gather_rows") == "invariant":
        return _norm_every_row(x, weight, eps, norm=FP32_SCALE)
    return _rms_norm_fp32_scale(x, weight, eps)


def linear(x: jax.Array, w: jax.Array | QuantizedWeight, bias: jax.Array | None = None, ex: Execution = DEFAULT, *,
           split: str | None = None) -> jax.Array:
    """``x [..., in] @ w [in, out]`` (+ ``bias [out]``) in x's dtype, accumulated in fp32; ``w`` an
    array or a ``QuantizedWeight``. On a placed model (``ex.placement``) a ``split="column"`` /
    ``"row"`` weight runs per device (``jspec.parallel``)."""
    product = functools.partial(matmul, impl=ex.kernels)
    placement = ex.placement
    if placement is None or split is None:
        y = product(x, w)
    else:
        check_unquantized(w, "a placed model's split projections")
        y = getattr(placement, split)(product, x, w)
    return y if bias is None else y + bias.astype(y.dtype)


def embedding(table: jax.Array | QuantizedWeight, tokens: jax.Array, placement: TensorParallel | None) -> jax.Array:
    """The rows ``table[tokens]`` of an embedding table ``[vocab, hidden]`` -> ``[..., hidden]``; where the
    table is placed (``placement``: its model's) each device looks up its share of the vocabulary
    (``TensorParallel.lookup``)."""
    if placement is None or isinstance(table, QuantizedWeight):
        return table[tokens]
    return placement.lookup(table, tokens)


def check_unquantized(w, what: str) -> None:
    """``ValueError`` for a quantized ``w`` where ``what`` takes weight arrays only."""
    if isinstance(w, QuantizedWeight):
        raise ValueError(f"{what} take weight arrays, not quantized weights: quantize an unplaced model "
                         "and run it on one device")


def linear_parts(x: jax.Array, w: jax.Array | QuantizedWeight, ex: Execution = DEFAULT, *,
                 split: str | None = None) -> jax.Array:
    """A branch's output projection ``x [..., in] @ w [in, out]`` as partial sums ``[splits, ..., out]``
    for :func:`add_norm`: the kernel's split-K partials where kernels fuse, else ``[1, ..., out]``
    holding :func:`linear`'s product (a placed model's split projection: all-reduced)."""
    if ex.fuses and (ex.placement is None or split is None):
        return matmul_parts(x, w, impl=ex.kernels)
    return linear(x, w, None, ex, split=split)[None]


def gated_mlp(x: jax.Array, gate_up: jax.Array | QuantizedWeight, down: jax.Array | QuantizedWeight, activation: str,
              ex: Execution = DEFAULT) -> jax.Array:
    """The MLP branch ``down(activation(gate(x)) * up(x))`` for rows ``x [..., hidden]``, gate and up
    fused into one ``gate_up [hidden, 2 * inter]`` matrix, ``down [inter, hidden]`` (arrays or
    quantized weights); ``activation`` a name in :data:`ACTIVATIONS`. Where kernels fuse (``ex.fuses``) the gating goes into the gate/up
    matmul's kernel (one launch instead of two). Returns the down projection's partial sums
    ``[splits, ..., hidden]`` (:func:`linear_parts`)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown MLP activation {activation!r}: expected one of {tuple(ACTIVATIONS)}")
    inter = out_features(gate_up) // 2
    placement = ex.placement
    if ex.fuses and (placement is None or placement.interleaves((inter, inter))):
        gated = functools.partial(matmul, impl=ex.kernels, gated=activation)
        # Placed: gate_up is device-major, so each device gates its own share of the columns.
        hidden = gated(x, gate_up) if placement is None else placement.column(gated, x, gate_up)
    else:
        gate, up = split_columns(linear(x, gate_up, None, ex, split="column"), (inter, inter), ex.placement)
        hidden = ACTIVATIONS[activation](gate) * up
    return linear_parts(hidden, down, ex, split="row")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residual:
    """The residual stream ``x [batch, T, hidden]`` with a branch not yet added: its partial sums
    ``branch [splits, batch, T, hidden]`` (None: nothing pending), Gemma 4's post-norm of the branch
    ``branch_norm [hidden]`` and its ``layer_scalar`` ``scale [1]`` on the sum (None: none)."""

    x: jax.Array
    branch: jax.Array | None = None
    branch_norm: jax.Array | None = None
    scale: jax.Array | None = None


def add_norm(residual: Residual, weight: jax.Array | None, eps: float, ex: Execution = DEFAULT, *,
             rounding: str | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Add the pending branch to the stream and norm the sum for the next consumer.

    Args:
      residual: the stream and its pending branch (:class:`Residual`).
      weight: the next norm's ``[hidden]`` (the next layer's input norm, the MLP's, the final one);
        None: the sum alone.
      rounding: the norm's rounding, None (Llama's :func:`rms_norm`) or ``FP32_SCALE`` (Gemma 4's
        :func:`rms_norm_fp32_scale`); the branch's post-norm too.
    Returns:
      ``(x, normed)``: ``x = (x + branch_norm(sum(branch))) * scale [batch, T, hidden]`` in the
      stream's dtype and ``norm(x, weight)`` (None without ``weight``). One kernel launch where
      kernels fuse and a norm is taken; the bare sum is XLA's add, which joins its consumer's fusion,
      as do XLA's ops (or the invariant row norm) elsewhere.
    """
    x, branch = residual.x, residual.branch
    norm = functools.partial(rms_norm if rounding is None else rms_norm_fp32_scale, eps=eps, ex=ex)
    if branch is None:
        if residual.scale is not None:
            raise ValueError("a Residual's scale applies to its pending branch: there is none")
        return x, None if weight is None else norm(x, weight=weight)
    if ex.fuses and (weight is not None or residual.branch_norm is not None):
        def fused(x, branch, weight, branch_norm, scale):
            return add_rms_norm(x, branch, weight, eps, y_weight=branch_norm, norm=rounding, scale=scale, impl=ex.kernels)

        args = (x, branch, weight, residual.branch_norm, residual.scale)
        return fused(*args) if ex.placement is None else ex.placement.replicated(fused, *args)
    y = sum_parts(branch, x.dtype)
    x = x + (y if residual.branch_norm is None else norm(y, weight=residual.branch_norm))
    if residual.scale is not None:
        x = x * residual.scale.astype(x.dtype)
    return x, None if weight is None else norm(x, weight=weight)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half ("NeoX") RoPE. ``x [batch, T, heads, head_dim]``, cos/sin ``[batch, T, head_dim]``."""
    return rotate_half(x, cos[:, :, None, :], sin[:, :, None, :])
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadNorms:
    """RMSNorms of q and k per head before RoPE (Qwen3, Gemma 4): weights ``[head_dim]`` or None
    (no norm), rounded as ``rounding`` says (None: Llama's, ``FP32_SCALE``: Gemma 4's); ``v``: v
    normed too, without a weight (Gemma 4)."""

    q: jax.Array | None = None
    k: jax.Array | None = None
    eps: float = dataclasses.field(default=1e-6, metadata=dict(static=True))
    rounding: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    v: bool = dataclasses.field(default=False, metadata=dict(static=True))


NO_HEAD_NORMS = HeadNorms()


def rope_and_write(qkv: jax.Array, parts: tuple[int, ...], head_dim: int, k_buf: jax.Array, v_buf: jax.Array,
                   step: Step, norms: HeadNorms = NO_HEAD_NORMS):
    """From a fused q/k/v projection ``qkv [batch, T, sum(parts)]`` (``parts``: q, k, v columns; q and k
    only where V is the raw K, Gemma 4's ``attention_k_eq_v``): q and k per head (``norms`` first),
    rotated by the step's tables, and k and v written into the caches ``[batch, kv_heads, L, head_dim]``
    at ``step.kv_lengths - T``. Returns ``(q [batch, T, heads, head_dim], k_buf, v_buf)``. One kernel
    launch (``pallas_kernels.rope_write``) where it runs and the step's kernels fuse; else the
    composition of the pieces."""
    batch, rows, _ = qkv.shape
    ex = step.execution
    num_heads, num_kv_heads = parts[0] // head_dim, parts[1] // head_dim
    k_eq_v = len(parts) == 2
    check_norm(norms.rounding, norms.v)
    write_at = step.kv_lengths - rows
    placement = ex.placement
    if ex.fuses and (placement is None or placement.splits_heads(num_heads, num_kv_heads)):
        devices = 1 if placement is None else placement.size

        def fused(qkv, k_buf, v_buf, cos, sin, write_at, q_norm, k_norm):  # on one device's heads
            return rope_write(qkv, cos, sin, k_buf, v_buf, write_at, num_heads=num_heads // devices,
                              num_kv_heads=num_kv_heads // devices, q_norm=q_norm, k_norm=k_norm, eps=norms.eps,
                              norm=norms.rounding, v_norm=norms.v, k_eq_v=k_eq_v, impl=ex.kernels)

        args = (qkv, k_buf, v_buf, step.cos, step.sin, write_at, norms.q, norms.k)
        return fused(*args) if placement is None else placement.heads_write(fused, *args)
    q, k, *v = (x.reshape(batch, rows, -1, head_dim) for x in split_columns(qkv, parts, ex.placement))
    norm_fn = rms_norm if norms.rounding is None else rms_norm_fp32_scale
    return rope_write_heads(q, k, k if k_eq_v else v[0], step.cos, step.sin, k_buf, v_buf, write_at, q_norm=norms.q,
                            k_norm=norms.k, eps=norms.eps, norm=functools.partial(norm_fn, ex=ex), v_norm=norms.v)
