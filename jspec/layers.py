"""Building blocks shared by every model family: norms and projections (through the kernels'
dispatchers); rotary embeddings live in ``jspec.rope``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.parallel import TensorParallel, split_columns
from pallas_kernels import skinny_matmul
from pallas_kernels._dispatch import check_impl
from pallas_kernels.gather_rows import FP32_SCALE, gather_rows_pallas, rms_norm as _rms_norm

__all__ = ["rms_norm", "rms_norm_fp32_scale", "linear", "fuses_norm", "gated_mlp", "silu_mlp"]


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
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, impl: str = "auto",
           parallel: TensorParallel | None = None, split: str | None = None,
           norm_weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """``x [..., in] @ w [in, out]`` (+ bias) in x's dtype, accumulated in fp32. A placed model's
    (``parallel``) ``split="column"`` / ``"row"`` weights run per device (``jspec.parallel``).
    ``norm_weight``: ``rms_norm(x, norm_weight, eps) @ w``, the norm inside the matmul kernel where
    one runs (:func:`fuses_norm`)."""
    if norm_weight is not None and not fuses_norm(impl, parallel):
        x, norm_weight = rms_norm(x, norm_weight, eps, impl=impl), None
    matmul = functools.partial(skinny_matmul, impl=impl, norm_weight=norm_weight, eps=eps)
    y = matmul(x, w) if parallel is None or split is None else getattr(parallel, split)(matmul, x, w)
    return y if bias is None else y + bias.astype(y.dtype)


def fuses_norm(impl: str, parallel: TensorParallel | None) -> bool:
    """Whether a norm (or a gate) goes into the matmul's dispatcher, which fuses it into the kernel
    where that runs: one device (a placed model's matmuls run per device, the norm beside them) and
    a kernel mode that fuses (not ``invariant``, whose norm is its own row kernel)."""
    return (parallel is None and check_impl(impl, "skinny_matmul") in ("auto", "pallas", "xla")
            and check_impl(impl, "gather_rows") != "invariant")


_GATES = {jax.nn.silu: "silu"}  # activations the matmul kernel applies to the gate itself


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation, *, impl: str = "auto",
              parallel: TensorParallel | None = None, norm_weight: jax.Array | None = None,
              eps: float = 1e-6) -> jax.Array:
    """``down(activation(gate(x)) * up(x))`` with gate and up fused into one ``[hidden, 2 * inter]``
    matrix; ``norm_weight``: of ``rms_norm(x, norm_weight, eps)``. On one device the norm and the
    gating go into the gate/up matmul's kernel where it runs (one launch instead of three)."""
    gate_name = _GATES.get(activation)
    if gate_name is not None and fuses_norm(impl, parallel):
        hidden = skinny_matmul(x, gate_up, impl=impl, norm_weight=norm_weight, eps=eps, gated=gate_name)
    else:
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps, impl=impl)
        inter = gate_up.shape[-1] // 2
        gate, up = split_columns(linear(x, gate_up, impl=impl, parallel=parallel, split="column"), (inter, inter),
                                 parallel)
        hidden = activation(gate) * up
    return linear(hidden, down, impl=impl, parallel=parallel, split="row")


def silu_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, *, impl: str = "auto",
             parallel: TensorParallel | None = None, norm_weight: jax.Array | None = None,
             eps: float = 1e-6) -> jax.Array:
    """The Llama / Qwen MLP: ``gated_mlp`` with SiLU."""
    return gated_mlp(x, gate_up, down, jax.nn.silu, impl=impl, parallel=parallel, norm_weight=norm_weight, eps=eps)
