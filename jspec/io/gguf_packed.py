"""GGUF quantization blocks repacked, losslessly, into :class:`jspec.quant.QuantizedWeight`.

Each type's block layout is read as ``gguf.quants``' dequantizers read it; a tensor becomes integer
codes ``q`` and one scale ``s`` (and min ``m``) per group along K (a row of the stored
``[out, in]`` tensor), ``w = s * q`` or ``w = s * q + m``:

=====  =====================================  =====  ==========================  =====================
type   GGUF's value                           group  ``s`` / ``m``               kept as
=====  =====================================  =====  ==========================  =====================
Q8_0   ``d * q``, q int8                      32     ``d``                       int8
Q4_0   ``d * (c - 8)``, c 4-bit               32     ``d``                       int4, symmetric
Q4_1   ``d * c + m``                          32     ``d`` / ``m``               int4 with mins
Q5_0   ``d * (c - 16)``, c 5-bit              32     ``d``                       int8 (q = c - 16)
Q5_1   ``d * c + m``, c 5-bit                 32     ``d`` / ``m``               int8 with mins
Q4_K   ``d * sc * c - dmin * mc``, c 4-bit    32     ``d * sc`` / ``-dmin * mc``  int4 with mins
Q5_K   as Q4_K, c 5-bit                       32     ``d * sc`` / ``-dmin * mc``  int8 with mins
Q6_K   ``d * sc * (c - 32)``, c 6-bit         16     ``d * sc``                  int8 (q = c - 32)
=====  =====================================  =====  ==========================  =====================

Exact in float32: ``d``, ``dmin`` and ``m`` are fp16 (11 significant bits) and ``sc``, ``mc`` 6- or
8-bit integers, so ``s`` and ``m`` are exact products, and ``s * q (+ m)`` rounds once where
gguf's ``d * q (+ m)`` (or ``(d * sc) * q - dmin * mc``) rounds once: the same float32, signed
zeros included. Q4_0 stores a block's elements 0..15 in the low nibbles and 16..31 in the high
ones, the K-quants each run of 32 bytes as two sub-blocks (low nibbles, then high): the codes are
reordered into ``QuantizedWeight``'s pairs (even k low).

Projections fused into one weight (``q | k | v``, ``gate | up``) whose parts have different types
are joined in the widest form any part needs, still losslessly: int8 codes, the smallest group,
and mins of ``-0.0`` for symmetric parts where another part has mins (``x + -0.0 == x`` for every
float ``x``, ``-0.0`` too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import gguf
import jax
import numpy as np

from jspec.quant import QuantizedWeight
from pallas_kernels.matmul.quantized_matmul import INT4_OFFSET

QK_K = 256  # elements of a K-quant super-block


@dataclasses.dataclass(frozen=True)
class Codes:
    """A stored ``[rows, K]`` tensor (rows: output channels) as ``w = scales * q (+ mins)`` per
    group of K."""

    q: np.ndarray  # int8 [rows, K]: the integer each entry's value is a multiple of
    scales: np.ndarray  # float32 [rows, K / group]
    mins: np.ndarray | None  # float32 [rows, K / group], or None (symmetric)
    bits: int  # 4: q fits a 4-bit code (-8..7 symmetric, 0..15 with mins); 8: it needs int8

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Codes:
        """The tensor with ``fn`` (a reordering of rows) applied to its codes, scales and mins alike."""
        return Codes(fn(self.q), fn(self.scales), None if self.mins is None else fn(self.mins), self.bits)


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[n, 2]`` bytes holding an fp16 -> ``[n, 1]`` float32."""
    return raw.view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray, run: int) -> np.ndarray:
    """``[n, bytes]`` -> ``[n, 2 * bytes]`` 4-bit values: each run of ``run`` bytes gives its low
    nibbles, then its high nibbles."""
    n = raw.shape[0]
    shifted = raw.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (shifted & 0x0F).reshape(n, -1)


def _bit_planes(raw: np.ndarray, bits_per_byte: int) -> np.ndarray:
    """``[n, 32]`` bytes -> ``[n, 32 * 8 / bits_per_byte]``: field ``j`` of every byte, for each ``j``
    in turn (the high bits of a K-quant's 32-element sub-blocks, sub-block ``j`` in field ``j``)."""
    n = raw.shape[0]
    shifts = np.arange(0, 8, bits_per_byte, dtype=np.uint8).reshape(1, 1, -1, 1)
    fields = raw.reshape(n, -1, 1, 32) >> shifts
    return (fields & ((1 << bits_per_byte) - 1)).reshape(n, -1)


def _five_bit_high(raw: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's ``qh``: ``[n, 4]`` bytes, one little-endian uint32 whose bit ``j`` is element
    ``j``'s fifth bit -> ``[n, 32]`` of 0 / 16."""
    qh = raw.view(np.uint32)  # [n, 1]
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


# Each decoder: ``[n, type_size]`` blocks -> (q [n, block] int8, scales [n, groups], mins or None).
def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b):
    return _nibbles(b[:, 2:], 16).astype(np.int8) - INT4_OFFSET, _f16(b[:, :2]), None


def _q4_1(b):
    return _nibbles(b[:, 4:], 16).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b):
    return (_nibbles(b[:, 6:], 16) | _five_bit_high(b[:, 2:6])).astype(np.int8) - 16, _f16(b[:, :2]), None


def _q5_1(b):
    return (_nibbles(b[:, 8:], 16) | _five_bit_high(b[:, 4:8])).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b):
    """Q4_K / Q5_K: ``(d * sc, -dmin * mc)``, ``[n, 8]`` each (gguf's own unpacking of the 6-bit pairs)."""
    sc, mc = gguf.quants.Q4_K.get_scale_min(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * mc.astype(np.float32))


def _q4_k(b):
    return (_nibbles(b[:, 16:], 32).astype(np.int8), *_k_scales(b))


def _q5_k(b):
    high = _bit_planes(b[:, 16:48], 1) << 4
    return ((_nibbles(b[:, 48:], 32) | high).astype(np.int8), *_k_scales(b))


def _q6_k(b):
    low, high = _nibbles(b[:, :128], 64), _bit_planes(b[:, 128:192], 2) << 4
    scales = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
    return (low | high).astype(np.int8) - 32, scales, None


# GGUF type -> (decoder, bits its codes need as QuantizedWeight values).
DECODERS = {
    "Q8_0": (_q8_0, 8), "Q4_0": (_q4_0, 4), "Q4_1": (_q4_1, 4), "Q5_0": (_q5_0, 8), "Q5_1": (_q5_1, 8),
    "Q4_K": (_q4_k, 4), "Q5_K": (_q5_k, 8), "Q6_K": (_q6_k, 8),
}
PACKABLE = frozenset(DECODERS)
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def decode(tensor) -> Codes:
    """A 2-D GGUF tensor (``gguf.ReaderTensor`` of a type in :data:`PACKABLE`) as :class:`Codes`,
    rows in stored order."""
    kind = tensor.tensor_type.name
    decoder, bits = DECODERS[kind]
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    raw = np.asarray(tensor.data)  # [rows, bytes per row] uint8
    rows = raw.shape[0]
    q, scales, mins = decoder(raw.reshape(-1, type_size))
    per_row = raw.shape[1] // type_size * scales.shape[1]
    return Codes(q.reshape(rows, -1), scales.reshape(rows, per_row),
                 None if mins is None else mins.reshape(rows, per_row), bits)


def join(parts: list[Codes]) -> Codes:
    """``parts`` stacked along rows (fused output channels), in the widest form any of them needs
    (module docstring); one part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    group = math.gcd(*(p.group for p in parts))
    with_mins = any(p.mins is not None for p in parts)
    same_kind = len({(p.bits, p.mins is None) for p in parts}) == 1
    bits = parts[0].bits if same_kind else 8

    def regrouped(a, p):  # [rows, K / p.group] -> [rows, K / group]: each value for its finer groups
        return np.repeat(a, p.group // group, axis=1)

    scales = [regrouped(p.scales, p) for p in parts]
    mins = [regrouped(p.mins, p) if p.mins is not None else np.full_like(s, -0.0) for p, s in zip(parts, scales)]
    return Codes(np.concatenate([p.q for p in parts]), np.concatenate(scales),
                 np.concatenate(mins) if with_mins else None, bits)


def pack(codes: Codes, *, dtype) -> QuantizedWeight:
    """``codes`` as a :class:`QuantizedWeight` on the device, stored as the file stores it, K last
    (``[N, K]``: a matmul weight's output channels or a table's rows first); scales and mins in
    ``dtype`` (exact in float32)."""
    if codes.bits == 4:
        c = (codes.q if codes.mins is not None else codes.q + INT4_OFFSET).astype(np.uint8)
        values = c[:, 0::2] | (c[:, 1::2] << 4)  # [rows, K / 2]: even k in the low nibble
    else:
        values = codes.q
    parts = [values, codes.scales.astype(dtype), None if codes.mins is None else codes.mins.astype(dtype)]
    return QuantizedWeight(*(None if a is None else jax.device_put(a) for a in parts), transposed=True)
