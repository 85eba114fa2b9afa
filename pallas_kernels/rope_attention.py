"""A step's attention straight from its q/k/v projection: RoPE (after the q / k norms where a model
has them), the K/V cache write and decode attention in one launch.

Shapes: qkv [B, T, C] (``C``: q heads, then k, then v, as :mod:`pallas_kernels.rope_write` takes
them; q and k with ``k_eq_v``; q only with ``writes_kv=False``: Gemma 4's KV-shared layers, which
read another layer's cache as it is), or the projection's split-K partials [S, B, T, C]
(``jspec.layers.linear(split_parts=True)``: summed and rounded to the cache's dtype, in the kernel
as it loads them: no launch of their own), cos / sin [B, T, D], k_buf / v_buf [B, Hkv, L, D],
kv_lengths [B] (valid rows once this step's T are in: the new rows go to ``kv_lengths - T ..``),
q_positions [B, T]; ``tail_mask``, ``window``, ``scale`` as :func:`pallas_kernels.decode_attention`.
Returns (out [B, T, H, D], k_buf, v_buf).

At batch 1 a small model's decode step is bound by its launches: RoPE + cache write was a launch of
its own between the q/k/v projection and attention, each layer. Here the flash-decoding kernel
(:mod:`pallas_kernels.flash_decoding`) rotates its query rows as it loads them, and the tail's K/V
rows (the T this step makes) are computed in every program that reads them and put in place of
what its K/V blocks hold there, while one program per (sequence, KV head) writes them to the cache:
no program waits for another's write. The rows come out as :func:`pallas_kernels.rope_write.rope_write`
makes them (``rope_write.NewRows``).
"""

from __future__ import annotations

import jax

from pallas_kernels._dispatch import check_impl, interpret_mode, on_gpu
from pallas_kernels.add_rms_norm import sum_parts
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference, use_pallas, wide_head_kernel
from pallas_kernels.decode_tiling import tiling
from pallas_kernels.flash_decoding import _decode_call
from pallas_kernels.rope_write import NORMS, check_norm, rope_write, rope_write_reference, rotate_half

MAX_ROWS = 16  # query rows of one step here (decode, verify, small trees); more (a prefill) compose the two kernels


def _split_q(qkv, num_heads, head_dim):
    batch, rows, _ = qkv.shape
    return qkv[..., :num_heads * head_dim].reshape(batch, rows, num_heads, head_dim)


def _rotated_q(qkv, cos, sin, q_norm, *, num_heads, head_dim, eps, norm):
    """A projection's q heads, normed and rotated (the rows of a step that writes no K/V)."""
    q = _split_q(qkv, num_heads, head_dim)
    if q_norm is not None:
        q = NORMS[norm](q, q_norm, eps)
    return rotate_half(q, cos[:, :, None, :], sin[:, :, None, :])


def rope_attention_reference(qkv, cos, sin, k_buf, v_buf, kv_lengths, *, q_positions, num_heads, writes_kv=True,
                             q_norm=None, k_norm=None, eps=1e-6, norm=None, v_norm=False, k_eq_v=False,
                             tail_mask=None, window=None, scale=None):
    """:func:`rope_write_reference` (or q alone), then :func:`decode_attention_reference`."""
    qkv = _summed(qkv, k_buf.dtype)
    rows, head_dim = qkv.shape[1], k_buf.shape[-1]
    if writes_kv:
        q, k_buf, v_buf = rope_write_reference(
            qkv, cos, sin, k_buf, v_buf, kv_lengths - rows, num_heads=num_heads, num_kv_heads=k_buf.shape[1],
            q_norm=q_norm, k_norm=k_norm, eps=eps, norm=norm, v_norm=v_norm, k_eq_v=k_eq_v)
    else:
        q = _rotated_q(qkv, cos, sin, q_norm, num_heads=num_heads, head_dim=head_dim, eps=eps, norm=norm)
    out = decode_attention_reference(q, k_buf, v_buf, kv_lengths, q_positions=q_positions, tail_mask=tail_mask,
                                     window=window, scale=scale)
    return out, k_buf, v_buf


def _summed(qkv, dtype):
    """The projection ``[B, T, C]`` from ``qkv`` as given (split-K partials summed in XLA)."""
    return sum_parts(qkv, dtype) if qkv.ndim == 4 else qkv


def supports(batch, rows, num_heads, num_kv_heads, max_len, head_dim, *, window=None) -> bool:
    """Shapes the one-launch kernel takes: at most ``MAX_ROWS`` query rows, ``head_dim`` a power of two
    >= 16 (the rotation's halves) and a cache of whole KV blocks (it is written in place, never
    copied to pad it)."""
    if rows > MAX_ROWS or head_dim < 16 or head_dim & (head_dim - 1) or num_heads % num_kv_heads:
        return False
    return max_len % tiling(batch, rows, num_heads, num_kv_heads, max_len, head_dim, window=window)["block_k"] == 0


def rope_attention_pallas(qkv, cos, sin, k_buf, v_buf, kv_lengths, q_norm=None, k_norm=None, *, q_positions,
                          num_heads, writes_kv=True, eps=1e-6, norm=None, v_norm=False, k_eq_v=False, tail_mask=None,
                          window=None, scale=None, interpret=None, **tiling_knobs):
    """The one-launch kernel (module docstring); tiling knobs as :func:`decode_attention_pallas`."""
    check_norm(norm, v_norm)
    splits = qkv.shape[0] if qkv.ndim == 4 else 1
    batch, rows, columns = qkv.shape[-3:]
    _, num_kv_heads, max_len, head_dim = k_buf.shape
    if not supports(batch, rows, num_heads, num_kv_heads, max_len, head_dim, window=window):
        raise ValueError(f"the RoPE + attention kernel takes at most {MAX_ROWS} rows, head_dim a power of two >= 16 "
                         f"and whole KV blocks; got {rows} rows, {num_heads} / {num_kv_heads} heads of {head_dim}, "
                         f"{max_len} cache rows")
    cfg = tiling(batch, rows, num_heads, num_kv_heads, max_len, head_dim, window=window, **tiling_knobs)
    new_rows = dict(qkv=qkv, cos=cos, sin=sin, q_norm=q_norm, k_norm=k_norm if writes_kv else None, columns=columns,
                    num_heads=num_heads, num_kv_heads=num_kv_heads if writes_kv else 0, head_dim=head_dim,
                    eps=float(eps), norm=norm, v_norm=v_norm, k_eq_v=k_eq_v, dtype=k_buf.dtype, splits=splits,
                    split_stride=batch * rows * columns)
    q = jax.ShapeDtypeStruct((batch, rows, num_heads, head_dim), qkv.dtype)
    result = _decode_call(q, k_buf, v_buf, kv_lengths, q_positions, tail_mask, window,
                          head_dim**-0.5 if scale is None else scale, new_rows=new_rows,
                          interpret=interpret_mode() if interpret is None else interpret, **cfg)
    out, k_buf, v_buf = result if writes_kv else (result, k_buf, v_buf)
    return out.reshape(batch, rows, num_heads, head_dim), k_buf, v_buf


def rope_attention(qkv, cos, sin, k_buf, v_buf, kv_lengths, *, q_positions, num_heads, writes_kv=True, q_norm=None,
                   k_norm=None, eps=1e-6, norm=None, v_norm=False, k_eq_v=False, tail_mask=None, window=None,
                   scale=None, impl="auto"):
    """Dispatcher. The one-launch kernel where both kernels it replaces would run (``"pallas"``; ``"auto"``
    on a GPU where :func:`pallas_kernels.decode_attention`'s rule takes the flash-decoding kernel) and
    :func:`supports` the shapes; elsewhere :func:`rope_write` (or q alone) and :func:`decode_attention`,
    each through its own dispatcher. ``impl="invariant"`` composes too (its attention kernel is
    another), as does a ``rope_attention=xla`` override (``pallas_kernels._dispatch``)."""
    check_norm(norm, v_norm)
    batch, rows, _ = qkv.shape[-3:]
    _, num_kv_heads, max_len, head_dim = k_buf.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    shape = (batch, rows, num_heads, num_kv_heads, max_len, head_dim, k_buf.dtype)
    # The one launch where this, the rope-write and the attention choice all take kernels
    # ("auto,rope_attention=xla" keeps the two launches, each kernel as its own choice says).
    choices = [check_impl(impl, name) for name in ("rope_attention", "rope_write", "decode_attention")]
    kernel = (all(c == "pallas" or (c == "auto" and on_gpu() and use_pallas(*shape)) for c in choices)
              and not (on_gpu() and wide_head_kernel(*shape, tail_mask=tail_mask, window=window))
              and supports(batch, rows, num_heads, num_kv_heads, max_len, head_dim, window=window))
    options = dict(eps=eps, norm=norm, v_norm=v_norm, k_eq_v=k_eq_v)
    if kernel:
        return rope_attention_pallas(qkv, cos, sin, k_buf, v_buf, kv_lengths, q_norm, k_norm, q_positions=q_positions,
                                     num_heads=num_heads, writes_kv=writes_kv, tail_mask=tail_mask, window=window,
                                     scale=scale, interpret=not on_gpu(), **options)
    qkv = _summed(qkv, k_buf.dtype)
    if writes_kv:
        q, k_buf, v_buf = rope_write(qkv, cos, sin, k_buf, v_buf, kv_lengths - rows, num_heads=num_heads,
                                     num_kv_heads=num_kv_heads, q_norm=q_norm, k_norm=k_norm, impl=impl, **options)
    else:
        q = _rotated_q(qkv, cos, sin, q_norm, num_heads=num_heads, head_dim=head_dim, eps=eps, norm=norm)
    out = decode_attention(q, k_buf, v_buf, kv_lengths, q_positions=q_positions, tail_mask=tail_mask, window=window,
                           scale=scale, impl=impl)
    return out, k_buf, v_buf
