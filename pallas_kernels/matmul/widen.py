"""Quantized codes widened to bf16 weights two at a time, by inline PTX (the GPU lowering only).

The fp32 widening of :class:`pallas_kernels.matmul.quantized_kernel.QuantizedLoader` spends about
eight instructions an entry (extract, bias, subtract, scale, offset, round, and back). Here each
``elementwise_inline_asm`` instance takes four codes (one 32-bit register of bytes) and builds their
bf16 values in packed ``bf16x2`` registers, with byte permutes (``prmt``), one logic op for
mask-and-or (``lop3``) and packed fused multiply-adds (``fma.rn.bf16x2``). On an H200 at
Llama-3.1-8B's gate|up that made int4 1.25x faster at one row and 2.2x at 16; 8-bit weights were
bound by their layout instead (``jspec.quant.weight``: stored K last).

* int4: a nibble ``c`` or'ed into the mantissa of bf16 128.0 is ``128 + c`` exactly; one packed
  fma subtracts the bias (``c - 8`` symmetric, ``c`` with mins), a second computes ``q * s`` (``+ m``)
  rounded once to bf16. Symmetric, that is :func:`~pallas_kernels.matmul.quantized_matmul.dequantize`'s
  value bit for bit (``q * s`` is exact in fp32, so rounding it once to bf16 is the same); with mins
  ``dequantize`` rounds ``q * s + m`` in fp32 first, so the two can differ by one bf16 unit where that
  fp32 sum is inexact (terms far apart in magnitude) and its rounding moves a tie (none in the
  device check: ``quant_matmul_sweep_h200.json``).
* fp8 e4m3: its sign and its seven exponent and mantissa bits moved into a bf16's (``prmt`` with the
  sign replicated, a shift, a mask) are the value times 2^-120 exactly, subnormals included; a
  packed multiply by 2^120 and one by the scale give ``q * s`` rounded once (bit for bit; NaN codes,
  which ``jspec.quantize`` never makes, come out finite).
* int8: ``q`` has eight significant bits, one more than a bf16 holds, so the bytes become fp32 (a
  permute into the mantissa of 2^23, one subtraction), ``q * s`` (``+ m``) in fp32 against fp32
  scales, and one packed conversion rounds two of them to bf16: bit for bit ``dequantize``.

Each takes its operands broadcast to the codes' shape; the scales (and mins) as bf16 (int8: fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

_BF16X2 = {"one": 0x3F803F80, "neg_zero": 0x80008000, "two_p120": 0x7B807B80,
           "neg128": 0xC300C300, "neg136": 0xC308C308}

# Four codes a byte each -> bf16 pairs (0, 1) and (2, 3): the lanes take bytes 0 / 1 (2 / 3) of the
# source and zeros, 0x4140 / 0x4342; with each byte's sign replicated above it, 0x9180 / 0xB3A2.
_INT4_NIBBLES = """
    prmt.b32 %0, %1, z, 0x4140;
    prmt.b32 %2, %1, z, 0x4342;
    lop3.b32 %0, %0, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 %2, %2, 0x000f000f, 0x43004300, 0xea;"""


def _int4_asm(mins: bool, high: bool) -> tuple[str, str]:
    """Outputs: the low (or high) nibbles' weights (2 regs); inputs: codes, scales (2)[, mins (2)]."""
    bias = "neg128" if mins else "neg136"
    lines = ["{", ".reg .b32 w01, w23, c, one, bias, add, z;", "mov.b32 z, 0;",
             f"mov.b32 one, {_BF16X2['one']:#x};", f"mov.b32 bias, {_BF16X2[bias]:#x};",
             "shr.b32 c, $2, 4;" if high else "mov.b32 c, $2;",
             _INT4_NIBBLES.replace("%0", "w01").replace("%2", "w23").replace("%1", "c"),
             "fma.rn.bf16x2 w01, w01, one, bias;", "fma.rn.bf16x2 w23, w23, one, bias;"]
    if not mins:
        lines.append(f"mov.b32 add, {_BF16X2['neg_zero']:#x};")
    lines += [f"fma.rn.bf16x2 $0, w01, $3, {'$5' if mins else 'add'};",
              f"fma.rn.bf16x2 $1, w23, $4, {'$6' if mins else 'add'};", "}"]
    return "\n".join(lines), ",".join(["=r"] * 2 + ["r"] * (5 if mins else 3))


_FP8_ASM = "\n".join([
    "{", ".reg .b32 v01, v23, p120, nz, z;", "mov.b32 z, 0;",
    f"mov.b32 p120, {_BF16X2['two_p120']:#x};", f"mov.b32 nz, {_BF16X2['neg_zero']:#x};",
    "prmt.b32 v01, $2, z, 0x9180;", "prmt.b32 v23, $2, z, 0xB3A2;",
    "shl.b32 v01, v01, 4;", "shl.b32 v23, v23, 4;",
    "and.b32 v01, v01, 0x87F087F0;", "and.b32 v23, v23, 0x87F087F0;",
    "fma.rn.bf16x2 v01, v01, p120, nz;", "fma.rn.bf16x2 v23, v23, p120, nz;",
    "fma.rn.bf16x2 $0, v01, $3, nz;", "fma.rn.bf16x2 $1, v23, $4, nz;", "}"])


def _int8_asm(mins: bool) -> tuple[str, str]:
    """Outputs: 2 bf16x2 regs; inputs: codes, fp32 scales (4)[, fp32 mins (4)]."""
    lines = ["{", ".reg .b32 x, m;", ".reg .f32 f<4>, w<4>;",
             "xor.b32 x, $2, 0x80808080;",  # q + 128 as an unsigned byte
             "mov.b32 m, 0x4B000000;"]
    for i in range(4):
        lines.append(f"prmt.b32 f{i}, x, m, {0x7440 + i:#x};")  # 2^23 + q + 128 as fp32 bits
        lines.append(f"sub.f32 f{i}, f{i}, 0f4B000080;")
        lines.append(f"fma.rn.f32 w{i}, f{i}, ${3 + i}, ${7 + i};" if mins else f"mul.rn.f32 w{i}, f{i}, ${3 + i};")
    lines += ["cvt.rn.bf16x2.f32 $0, w1, w0;", "cvt.rn.bf16x2.f32 $1, w3, w2;", "}"]
    constraints = ",".join(["=r"] * 2 + ["r"] + ["f"] * (8 if mins else 4))
    return "\n".join(lines), constraints


def widen(fmt: str, codes: jax.Array, scale: jax.Array, low: jax.Array | None) -> list[jax.Array]:
    """bf16 weights of ``codes`` with one scale (and min) row or column broadcast over them:
    ``[w]`` (int8 / fp8: ``codes`` int8 / uint8 bytes) or ``[even, odd]`` (int4: the low and the high
    nibbles of the uint8 ``codes``, the even and the odd K rows). ``scale`` / ``low``: bf16, shaped
    to broadcast against ``codes``. Inside a Pallas (Triton) kernel on a GPU only."""
    shape = codes.shape
    if fmt == "int8":
        params = [jnp.broadcast_to(p.astype(jnp.float32), shape) for p in (scale, low) if p is not None]
        asm, constraints = _int8_asm(low is not None)
    else:
        params = [jnp.broadcast_to(p.astype(jnp.bfloat16), shape) for p in (scale, low) if p is not None]
        if fmt == "int4":  # two programs, not one of two results: jax lowers inline asm of one result only
            return [_asm(*_int4_asm(low is not None, high), codes, params) for high in (False, True)]
        asm, constraints = _FP8_ASM, ",".join(["=r"] * 2 + ["r"] * 3)
    return [_asm(asm, constraints, codes, params)]


def _asm(asm, constraints, codes, params):
    result = jax.ShapeDtypeStruct(codes.shape, jnp.bfloat16)
    (out,) = plgpu.elementwise_inline_asm(asm, args=[codes, *params], constraints=constraints, pack=4,
                                          result_shape_dtypes=[result])
    return out
