"""Building blocks shared by every model family, through the kernels' dispatchers: norms,
projections, the gated MLP (its gate fused into the gate/up matmul where a kernel runs), and RoPE
with the K/V cache write after the q/k/v projection; the rotary tables live in ``jspec.rope``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.parallel import TensorParallel, split_columns
from pallas_kernels import skinny_matmul
from pallas_kernels.add_rms_norm import add_parts, add_rms_norm
from pallas_kernels.skinny_matmul import GATES
from pallas_kernels._dispatch import check_impl
from pallas_kernels.gather_rows import FP32_SCALE, gather_rows_pallas, rms_norm as _rms_norm
from pallas_kernels.gather_rows import rms_norm_fp32_scale as _rms_norm_fp32_scale
from pallas_kernels.rope_write import check_norm, rope_write, rope_write_heads, rotate_half

__all__ = ["rms_norm", "rms_norm_fp32_scale", "add_parts", "add_rms_norm", "linear", "fuses_around_kernels",
           "gated_mlp", "silu_mlp", "gelu_tanh", "apply_rope", "rope_and_write"]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, impl: str = "auto") -> jax.Array:
    """Llama RMSNorm over the last axis (normalise in fp32, cast, scale). ``impl="invariant"``: the
    row-norm kernel (a fixed-order sum of squares per row), whose result for a row never depends on
    the program around it; XLA's fused reductions may sum in another order in another fusion."""
    if check_impl(impl, "gather_rows") != "invariant":
        return _rms_norm(x, weight, eps)
    return _norm_every_row(x, weight, eps, norm=None)


def _norm_every_row(x, weight, eps, *, norm):
    rows = x.reshape(1, -1, x.shape[-1])
    every_row = jnp.arange(rows.shape[1], dtype=jnp.int32)[None]
    return gather_rows_pallas(rows, every_row, norm_weight=weight, eps=eps, norm=norm).reshape(x.shape)


def rms_norm_fp32_scale(x: jax.Array, weight: jax.Array | None, eps: float, *, impl: str = "auto") -> jax.Array:
    """Gemma 4 RMSNorm: normalise and scale by ``weight`` in fp32, cast last (``rms_norm`` casts
    before scaling). ``weight=None`` is the weightless variant (Gemma 4 ``v_norm``).
    ``impl="invariant"``: the row-norm kernel, as for :func:`rms_norm`."""
    if check_impl(impl, "gather_rows") == "invariant":
        return _norm_every_row(x, weight, eps, norm=FP32_SCALE)
    return _rms_norm_fp32_scale(x, weight, eps)


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, impl: str = "auto",
           parallel: TensorParallel | None = None, split: str | None = None, split_parts: bool = False) -> jax.Array:
    """``x [..., in] @ w [in, out]`` (+ bias) in x's dtype, accumulated in fp32. A placed model's
    (``parallel``) ``split="column"`` / ``"row"`` weights run per device (``jspec.parallel``).
    ``split_parts``: the product as partial sums ``[splits, ..., out]`` for :func:`add_rms_norm`
    (one device, no bias)."""
    if split_parts and (bias is not None or parallel is not None):
        raise ValueError("split_parts is for a product without bias on one device")
    matmul = functools.partial(skinny_matmul, impl=impl, split_parts=split_parts)
    y = matmul(x, w) if parallel is None or split is None else getattr(parallel, split)(matmul, x, w)
    return y if bias is None else y + bias.astype(y.dtype)


def fuses_around_kernels(impl: str, parallel: TensorParallel | None) -> bool:
    """Whether the work around a kernel (the MLP's gate, RoPE and the cache write) goes to that
    kernel's dispatcher, which fuses it where the kernel runs: one device (a placed model's matmuls
    run per device, the rest beside them) and a kernel mode that fuses (not ``invariant``, which
    keeps every op in its pinned form)."""
    return (parallel is None and check_impl(impl, "skinny_matmul") in ("auto", "pallas", "xla")
            and check_impl(impl, "gather_rows") != "invariant")


gelu_tanh = GATES["gelu_tanh"]  # HF gelu_pytorch_tanh (Gemma 4)
_GATES = {fn: name for name, fn in GATES.items()}  # activations the matmul kernel applies to the gate itself


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation, *, impl: str = "auto",
              parallel: TensorParallel | None = None, split_parts: bool = False) -> jax.Array:
    """``down(activation(gate(x)) * up(x))`` with gate and up fused into one ``[hidden, 2 * inter]``
    matrix. On one device the gating goes into the gate/up matmul's kernel where it runs (one launch
    instead of two). ``split_parts``: the down projection as partial sums (:func:`linear`)."""
    gate_name = _GATES.get(activation)
    if gate_name is not None and fuses_around_kernels(impl, parallel):
        hidden = skinny_matmul(x, gate_up, impl=impl, gated=gate_name)
    else:
        inter = gate_up.shape[-1] // 2
        gate, up = split_columns(linear(x, gate_up, impl=impl, parallel=parallel, split="column"), (inter, inter),
                                 parallel)
        hidden = activation(gate) * up
    return linear(hidden, down, impl=impl, parallel=parallel, split="row", split_parts=split_parts)


def silu_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, *, impl: str = "auto",
             parallel: TensorParallel | None = None, split_parts: bool = False) -> jax.Array:
    """The Llama / Qwen MLP: ``gated_mlp`` with SiLU."""
    return gated_mlp(x, gate_up, down, jax.nn.silu, impl=impl, parallel=parallel, split_parts=split_parts)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half ("NeoX") RoPE. ``x [batch, T, heads, head_dim]``, cos/sin ``[batch, T, head_dim]``."""
    return rotate_half(x, cos[:, :, None, :], sin[:, :, None, :])


def rope_and_write(qkv: jax.Array, parts: tuple[int, ...], cos: jax.Array, sin: jax.Array, k_buf: jax.Array,
                   v_buf: jax.Array, kv_lengths: jax.Array, *, head_dim: int, q_norm: jax.Array | None = None,
                   k_norm: jax.Array | None = None, eps: float = 1e-6, norm: str | None = None, v_norm: bool = False,
                   impl: str = "auto", parallel: TensorParallel | None = None):
    """From a fused q/k/v projection ``qkv [batch, T, sum(parts)]`` (``parts``: q, k, v columns; q and k
    only where V is the raw K, Gemma 4's ``attention_k_eq_v``): q and k per head (RMS-normed by
    ``q_norm`` / ``k_norm`` first where given, rounded as ``norm`` says: None for Llama / Qwen3,
    ``FP32_SCALE`` for Gemma 4; ``v_norm``: v normed too, without a weight), rotated, and k and v written
    into the caches ``[batch, kv_heads, L, head_dim]`` at ``kv_lengths``. Returns ``(q [batch, T, heads,
    head_dim], k_buf, v_buf)``. One kernel launch (``pallas_kernels.rope_write``) where it runs and
    :func:`fuses_around_kernels` allows; else the composition of the pieces."""
    batch, rows, _ = qkv.shape
    num_heads, num_kv_heads = parts[0] // head_dim, parts[1] // head_dim
    k_eq_v = len(parts) == 2
    check_norm(norm, v_norm)
    if fuses_around_kernels(impl, parallel):
        return rope_write(qkv, cos, sin, k_buf, v_buf, kv_lengths, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          q_norm=q_norm, k_norm=k_norm, eps=eps, norm=norm, v_norm=v_norm, k_eq_v=k_eq_v, impl=impl)
    q, k, *v = (x.reshape(batch, rows, -1, head_dim) for x in split_columns(qkv, parts, parallel))
    norm_fn = rms_norm if norm is None else rms_norm_fp32_scale
    return rope_write_heads(q, k, k if k_eq_v else v[0], cos, sin, k_buf, v_buf, kv_lengths, q_norm=q_norm,
                            k_norm=k_norm, eps=eps, norm=functools.partial(norm_fn, impl=impl), v_norm=v_norm)
