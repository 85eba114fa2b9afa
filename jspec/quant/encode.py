"""Round-to-nearest quantization of one matrix into a :class:`QuantizedWeight`.

Each group's scale (and min) is rounded to the weight's dtype first and the codes are computed
from the rounded values, so the stored scale is the one the codes were made for. Symmetric:
``s = max|w| / MAX_CODE`` (127 for int8, 448 for fp8 e4m3, 7 for int4), ``q = round(w / s)``
clipped to the format (fp8: rounded to nearest even by the cast). With mins: ``m = min w``,
``s = (max w - m) / L``, ``c = round((w - m) / s)`` clipped to 0..L (L = 15 for int4, 127 for int8). A group of zeros gets
``s = 0``: it dequantizes to zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.quant.scheme import LEVELS, MAX_CODE, Scheme
from jspec.quant.weight import QuantizedWeight
from pallas_kernels.matmul.quantized_matmul import FP8, INT4_OFFSET

FP8_MIN_COMPUTE_CAPABILITY = (8, 9)  # Ada, Hopper and later have fp8 units


def check_platform(scheme: Scheme, device=None) -> None:
    """``ValueError`` when ``device`` (default: the first of ``jax.devices()``) has no use for the
    scheme: fp8 on a GPU without fp8 units, where every read would widen it in software."""
    if scheme.format != "fp8":
        return
    device = jax.devices()[0] if device is None else device
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability is not None:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
        if (major, minor) < FP8_MIN_COMPUTE_CAPABILITY:
            raise ValueError(f"fp8 weights need a GPU of compute capability "
                             f"{'.'.join(map(str, FP8_MIN_COMPUTE_CAPABILITY))} or later (fp8 units); "
                             f"{device.device_kind} is {capability}: use int8")


@functools.partial(jax.jit, static_argnames=("scheme", "transposed"))
def quantize_matrix(w: jax.Array, scheme: Scheme, *, transposed: bool = False) -> QuantizedWeight:
    """``w [K, N]`` (``[N, K]`` when ``transposed``: a table, K its last axis) quantized by ``scheme``,
    round to nearest; scales and mins in ``w.dtype``. K must be a multiple of the group size."""
    wk = (w.T if transposed else w).astype(jnp.float32)  # [K, N]
    k, n = wk.shape
    group = scheme.group_size or k
    blocks = wk.reshape(k // group, group, n)  # [groups, group, N]

    def stored(a):  # [groups, N] as stored, and its fp32 value for the codes
        a = a.astype(w.dtype)
        return a, a.astype(jnp.float32)

    mins = None
    if scheme.mins:
        mins, low = stored(blocks.min(axis=1))
        levels = LEVELS[scheme.format]
        scales, step = stored((blocks.max(axis=1) - low) / levels)
        codes = jnp.clip(jnp.round((blocks - low[:, None]) / _nonzero(step)[:, None]), 0, levels)
    else:
        top = MAX_CODE[scheme.format]
        scales, step = stored(jnp.abs(blocks).max(axis=1) / top)
        ratio = blocks / _nonzero(step)[:, None]
        if scheme.format == "fp8":
            codes = jnp.clip(ratio, -top, top)  # e4m3fn has no infinity: beyond 448 a cast gives NaN
        else:
            codes = jnp.clip(jnp.round(ratio), -top - (scheme.format == "int4"), top)
    codes = codes.reshape(k, n)
    if scheme.format == "int4":
        codes = (codes if scheme.mins else codes + INT4_OFFSET).astype(jnp.uint8)
        values = codes[0::2] | (codes[1::2] << 4)  # [K / 2, N]: even k low, odd k high
    else:
        values = codes.astype(FP8 if scheme.format == "fp8" else jnp.int8)
    if transposed:
        values, scales, mins = (None if a is None else a.T for a in (values, scales, mins))
    return QuantizedWeight(values, scales, mins, transposed=transposed)


def _nonzero(step):
    # Step 0: a symmetric group of zeros, or a group of equal entries with a min; either way every
    # numerator is 0 and any divisor gives code 0.
    return jnp.where(step == 0, 1.0, step)
