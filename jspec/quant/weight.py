"""The quantized weight: a pytree of packed values, scales and mins that every model, drafter and
kernel takes wherever it takes a weight array, and which parameter fields declare.

Layout (``pallas_kernels.matmul.quantized_matmul`` reads the parts as they are): jspec stores every
quantized weight with K last (``transposed``): a matmul weight ``[K, N]`` (``x @ w``) as ``[N, K]``,
as GGUF, HF's quantized formats and PyTorch's ``[out, in]`` hold it, and an embedding table
``[V, H]`` as it is, its hidden axis the K of the tied LM head that contracts against it (a token
lookup gathers whole rows and dequantizes only them). K-contiguous rows stream faster: at
Llama-3.1-8B's shapes on an H200 the kernel reads 8-bit weights stored so at up to 1.5x the rate
of the same weights stored ``[K, N]`` (benchmarks/README.md, quantized matmul). A weight stored
``[K, N]`` (``transposed=False``) works everywhere too.

=========  ==================================  ===============================  =============
format     ``values``                          ``scales`` (``mins``)            weight
=========  ==================================  ===============================  =============
int8       int8 ``[K, N]``: -127..127, or       ``[K / g, N]`` (``mins`` too)   ``s * q``
           codes >= 0 with mins                                                  or ``s * q + m``
fp8        float8_e4m3fn ``[K, N]``             ``[K / g, N]``                  ``s * q``
int4       uint8 ``[K / 2, N]``: even k in the  ``[K / g, N]`` (``mins`` too)   ``s * (c - 8)``
           low nibble, k + 1 in the high one                                     or ``s * c + m``
=========  ==================================  ===============================  =============

(``transposed``: every array with its two axes swapped.) Per output channel ``g = K``: scales
``[1, N]``. Scales and mins are in the dtype the weight dequantizes to (the model's), the codes
``c`` of int4 in 0..15. Symmetric int4 codes are GGUF Q4_0's, int4 with mins is Q4_1's and Q4_K's
formula (``d * q + m``), int8 Q8_0's, Q5_0's and Q6_K's, int8 with mins Q5_1's and Q5_K's: those
blocks are repacked into this type losslessly (``jspec.io.gguf_packed``).

Why not qwix's ``QArray`` (google/qwix): it holds 4-bit values as ``jnp.int4`` arrays, whose bytes
are XLA's to lay out and which a Pallas kernel cannot load as packed bytes; its zero point
(``(q - z) * s``) is not GGUF's ``d * q + m``; and it would bring flax in. This is a plain pytree
whose leaves a kernel reads directly.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp

from jspec.quant.scheme import Scheme
from pallas_kernels.matmul.quantized_matmul import FP8, INT4_PAIRS, dequantize as dequantize_parts
from pallas_kernels.matmul.quantized_matmul import quantized_matmul, quantized_matmul_parts
from pallas_kernels.matmul.skinny_matmul import skinny_matmul, skinny_matmul_parts

# Field metadata declaring what a parameter field holds, for ``jspec.quantize``: a matmul weight
# ``[K, N]`` or an embedding table ``[V, H]`` (looked up by rows, and the tied LM head where a model
# has no head of its own). Fields without it are never quantized (norms, biases, index tables).
QUANTIZE = "quantize"
MATMUL, TABLE = "matmul", "table"
MATMUL_WEIGHT = types.MappingProxyType({QUANTIZE: MATMUL})
TABLE_WEIGHT = types.MappingProxyType({QUANTIZE: TABLE})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized ``[K, N]`` matrix (``[N, K]`` when ``transposed``); layout in the module docstring."""

    values: jax.Array  # int8 / float8_e4m3fn [K, N], or uint8 [K / 2, N] (two int4 codes a byte)
    scales: jax.Array  # [K / group, N] in the weight's dtype
    mins: jax.Array | None = None  # [K / group, N] (int4 / int8 with mins), None when symmetric
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))  # stored [N, K]: K last

    @property
    def _k_axis(self) -> int:
        return 1 if self.transposed else 0

    @property
    def shape(self) -> tuple[int, int]:
        """The matrix's logical shape, as stored: ``(K, N)``, or ``(N, K)`` when ``transposed``."""
        shape = list(self.values.shape)
        if jnp.dtype(self.values.dtype) == INT4_PAIRS:
            shape[self._k_axis] *= 2
        return tuple(shape)

    @property
    def k(self) -> int:
        """The contraction size: the K of ``x [..., K] @ w`` (a table's hidden size)."""
        return self.shape[self._k_axis]

    @property
    def n(self) -> int:
        """The output size: the N of ``x @ w -> [..., N]`` (a table's vocabulary)."""
        return self.shape[1 - self._k_axis]

    @property
    def dtype(self):
        """The dtype the weight dequantizes to (its scales')."""
        return self.scales.dtype

    @property
    def scheme(self) -> Scheme:
        """The scheme its parts hold (a per-channel scheme when one group spans K)."""
        fmt = {INT4_PAIRS: "int4", FP8: "fp8"}.get(jnp.dtype(self.values.dtype), "int8")
        k, groups = self.shape[self._k_axis], self.scales.shape[self._k_axis]
        group = None if groups == 1 and fmt != "int4" else k // groups
        return Scheme(fmt, group, mins=self.mins is not None)

    def __getitem__(self, rows: jax.Array) -> jax.Array:
        """A table's rows ``rows [...]`` (token ids), dequantized: ``[..., H]`` in :attr:`dtype`."""
        if not self.transposed:
            raise TypeError("row lookups are for quantized embedding tables ([V, H], transposed=True)")
        mins = None if self.mins is None else self.mins[rows]
        return dequantize_parts(self.values[rows], self.scales[rows], mins, w_transposed=True)


def dequantize(w: QuantizedWeight, dtype=None) -> jax.Array:
    """The matrix ``w`` stands for, ``[K, N]`` (``[N, K]`` when transposed), in ``dtype`` (default:
    ``w.dtype``), computed exactly as every quantized matmul's reference computes it."""
    return dequantize_parts(w.values, w.scales, w.mins, w_transposed=w.transposed, dtype=dtype)


def in_features(w) -> int:
    """K of a matmul weight: an array ``[K, N]`` or a :class:`QuantizedWeight` however stored."""
    return w.k if isinstance(w, QuantizedWeight) else w.shape[0]


def out_features(w) -> int:
    """N of a matmul weight: an array ``[K, N]`` or a :class:`QuantizedWeight` however stored."""
    return w.n if isinstance(w, QuantizedWeight) else w.shape[1]


def matmul(x: jax.Array, w, *, impl, w_transposed: bool = False, gated: str | None = None) -> jax.Array:
    """``x [..., K] @ w -> [..., N]`` for a weight array ``[K, N]`` (``[N, K]`` with ``w_transposed``:
    ``pallas_kernels.skinny_matmul``) or a :class:`QuantizedWeight`, read as it is stored whatever
    ``w_transposed`` says (``pallas_kernels.matmul.quantized_matmul``); ``gated`` as for
    ``skinny_matmul``."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w.values, w.scales, w.mins, impl=impl, w_transposed=w.transposed, gated=gated)
    return skinny_matmul(x, w, impl=impl, w_transposed=w_transposed, gated=gated)


def matmul_parts(x: jax.Array, w, *, impl) -> jax.Array:
    """:func:`matmul` as partial sums ``[splits, ..., N]`` (``skinny_matmul_parts``' contract)."""
    if isinstance(w, QuantizedWeight):
        return quantized_matmul_parts(x, w.values, w.scales, w.mins, impl=impl, w_transposed=w.transposed)
    return skinny_matmul_parts(x, w, impl=impl)
