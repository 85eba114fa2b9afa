"""After the q/k/v projection: RoPE on q and k (after an optional per-head RMSNorm, Qwen3's or
Gemma 4's ``q_norm`` / ``k_norm``; Gemma 4 also norms v, without a weight) and the K/V rows written
into the cache, in one launch.

Shapes: qkv [B, T, (H + 2 * Hkv) * D] (q heads, then k, then v, as the fused projection makes them;
[B, T, (H + Hkv) * D] with ``k_eq_v``: Gemma 4's full layers, whose V is the raw K before its norm),
cos / sin [B, T, D] (rotate-half tables), k_buf / v_buf [B, Hkv, L, D], kv_lengths [B] (where each
sequence's T new rows go). Returns (q [B, T, H, D] rotated, k_buf, v_buf) with the rows written;
the buffers are aliased to the outputs, so a donated cache is updated in place.

Unfused, a decode step spends four or more small launches per layer here (q's rotation, k's, the
two cache writes); at batch 1 on the 1B-and-smaller models each costs about as much as its work.
The kernel's grid is (sequence, head of q, k or v, T tile): a program rotates one head's rows
(the two halves of the rotation loaded and stored apart: no concatenate) or writes one KV head's rows
at the sequence's length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels.dispatch import check_impl, interpret_mode, on_gpu
from pallas_kernels.norm.gather_rows import FP32_SCALE, rms_norm, rms_norm_fp32_scale

MAX_BLOCK_T = 64  # rows of one program; longer inputs (prefill) take several T tiles
# Elements of one [rows, head_dim / 2] tile: six such tiles (both halves of x, cos and sin) live in
# registers at once, so wide heads (Gemma 4: 256, 512) take fewer rows per program than 64.
_TILE_ELEMENTS = 64 * 64
NORMS = {None: rms_norm, FP32_SCALE: rms_norm_fp32_scale}  # ``norm=``: Llama / Qwen3's, Gemma 4's


def rotate_half(x, cos, sin):
    """NeoX RoPE of ``x [..., D]`` with tables broadcast to it: ``x * cos + rotated * sin`` (the one
    rotation of the library: ``jspec.layers.apply_rope`` applies it per head)."""
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def write_rows(buffer, rows, offsets):
    """``rows [B, Hkv, T, D]`` into ``buffer [B, Hkv, L, D]`` at per-sequence ``offsets [B]`` (an in-place
    scatter of a donated buffer); callers keep ``offsets + T <= L``."""
    def one(buf, new, offset):
        return jax.lax.dynamic_update_slice_in_dim(buf, new, offset, axis=1)

    return jax.vmap(one)(buffer, rows.astype(buffer.dtype), offsets)


def rope_write_reference(qkv, cos, sin, k_buf, v_buf, kv_lengths, *, num_heads, num_kv_heads, q_norm=None,
                         k_norm=None, eps=1e-6, norm=None, v_norm=False, k_eq_v=False):
    batch, rows, _ = qkv.shape
    head_dim = k_buf.shape[-1]
    q, k, *v = (x.reshape(batch, rows, -1, head_dim) for x in jnp.split(
        qkv, [num_heads * head_dim, (num_heads + num_kv_heads) * head_dim][:1 if k_eq_v else 2], axis=-1))
    return rope_write_heads(q, k, k if k_eq_v else v[0], cos, sin, k_buf, v_buf, kv_lengths, q_norm=q_norm,
                            k_norm=k_norm, eps=eps, norm=NORMS[norm], v_norm=v_norm)


def rope_write_heads(q, k, v, cos, sin, k_buf, v_buf, kv_lengths, *, q_norm=None, k_norm=None, eps=1e-6,
                     norm=rms_norm, v_norm=False):
    """The reference's work on heads already split: q [B, T, H, D], k / v [B, T, Hkv, D]; ``norm(x, weight,
    eps)``: the per-head RMSNorm (a caller's own, e.g. one that dispatches to a row kernel); ``v_norm``: v
    normed too, without a weight (``norm(v, None, eps)``, Gemma 4)."""
    if q_norm is not None:
        q, k = norm(q, q_norm, eps), norm(k, k_norm, eps)
    if v_norm:
        v = norm(v, None, eps)
    q, k = (rotate_half(x, cos[:, :, None, :], sin[:, :, None, :]) for x in (q, k))
    k_buf = write_rows(k_buf, k.transpose(0, 2, 1, 3), kv_lengths)
    v_buf = write_rows(v_buf, v.transpose(0, 2, 1, 3), kv_lengths)
    return q, k_buf, v_buf


def _kernel(len_ref, qkv_ref, cos_ref, sin_ref, *refs, num_heads, num_kv_heads, rows, block_t, half, eps, qk_norm,
            norm, v_norm, k_eq_v):
    q_norm_ref, k_norm_ref = refs[:2] if qk_norm else (None, None)
    q_out, k_out, v_out = refs[-3:]  # k_out, v_out: the caches (aliased to their inputs)
    b, head, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = tile * block_t
    row_ok = first + jnp.arange(block_t) < rows
    mask = jnp.broadcast_to(row_ok[:, None], (block_t, half))
    row_block = pl.ds(first, block_t)

    def load_half(ref, column):
        return plgpu.load(ref.at[b, row_block, pl.ds(column, half)], mask=mask, other=0)

    def normed(x1, x2, norm_ref):  # each row over both halves, rounded as the reference (NORMS[norm]) rounds
        x1_32, x2_32 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        inv = jax.lax.rsqrt((jnp.sum(x1_32 * x1_32, axis=1) + jnp.sum(x2_32 * x2_32, axis=1)) / (2 * half) + eps)
        n1, n2 = x1_32 * inv[:, None], x2_32 * inv[:, None]
        if norm_ref is None:  # Gemma 4's v_norm: no weight
            return n1.astype(x1.dtype), n2.astype(x2.dtype)
        w1, w2 = plgpu.load(norm_ref.at[pl.ds(0, half)]), plgpu.load(norm_ref.at[pl.ds(half, half)])
        if norm == FP32_SCALE:  # scale in fp32, cast last
            return ((n1 * w1.astype(jnp.float32)[None, :]).astype(x1.dtype),
                    (n2 * w2.astype(jnp.float32)[None, :]).astype(x2.dtype))
        return w1[None, :] * n1.astype(x1.dtype), w2[None, :] * n2.astype(x2.dtype)  # cast, then scale

    def rotated(column, norm_ref):
        x1, x2 = load_half(qkv_ref, column), load_half(qkv_ref, column + half)
        if norm_ref is not None:
            x1, x2 = normed(x1, x2, norm_ref)
        cos1, cos2 = load_half(cos_ref, 0), load_half(cos_ref, half)
        sin1, sin2 = load_half(sin_ref, 0), load_half(sin_ref, half)
        return x1 * cos1 + -x2 * sin1, x2 * cos2 + x1 * sin2

    def store(ref, at, halves):
        for offset, value in zip((0, half), halves):
            plgpu.store(ref.at[(*at, pl.ds(offset, half))], value.astype(ref.dtype), mask=mask)

    @pl.when(head < num_heads)
    def _():
        store(q_out, (b, row_block, head), rotated(head * 2 * half, q_norm_ref))

    @pl.when(head >= num_heads)
    def _():
        kv_head = head - num_heads
        cache_rows = pl.ds(len_ref[b] + first, block_t)
        k_column = (num_heads + kv_head) * 2 * half
        store(k_out, (b, kv_head, cache_rows), rotated(k_column, k_norm_ref))
        v_column = k_column if k_eq_v else k_column + num_kv_heads * 2 * half
        v = load_half(qkv_ref, v_column), load_half(qkv_ref, v_column + half)
        store(v_out, (b, kv_head, cache_rows), normed(*v, None) if v_norm else v)


def check_norm(norm, v_norm):
    """A clear error for norm options no path takes (kernel, reference, or a caller's composition)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {list(NORMS)}, got {norm!r}")
    if v_norm and norm != FP32_SCALE:
        raise ValueError(f"v_norm (a norm without a weight) needs norm={FP32_SCALE!r}")


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "norm", "v_norm", "k_eq_v",
                                             "interpret"))
def rope_write_pallas(qkv, cos, sin, k_buf, v_buf, kv_lengths, q_norm=None, k_norm=None, *, num_heads, num_kv_heads,
                      eps=1e-6, norm=None, v_norm=False, k_eq_v=False, interpret=None):
    """The kernel (see the module docstring); ``interpret`` defaults to off a GPU only."""
    batch, rows, _ = qkv.shape
    head_dim = k_buf.shape[-1]
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"the rope-write kernel needs head_dim / 2 a power of two, got head_dim {head_dim}")
    check_norm(norm, v_norm)
    half = head_dim // 2
    block_t = min(MAX_BLOCK_T, max(16, 1 << (rows - 1).bit_length()), max(16, _TILE_ELEMENTS // half))
    norms = [] if q_norm is None else [q_norm, k_norm]
    kernel = functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, rows=rows, block_t=block_t,
                               half=half, eps=float(eps), qk_norm=q_norm is not None, norm=norm, v_norm=v_norm,
                               k_eq_v=k_eq_v)
    inputs = [kv_lengths.astype(jnp.int32), qkv, cos, sin, *norms, k_buf, v_buf]
    return pdl.pallas_call(
        kernel,
        grid=(batch, num_heads + num_kv_heads, pl.cdiv(rows, block_t)),
        out_shape=[jax.ShapeDtypeStruct((batch, rows, num_heads, head_dim), qkv.dtype),
                   jax.ShapeDtypeStruct(k_buf.shape, k_buf.dtype), jax.ShapeDtypeStruct(v_buf.shape, v_buf.dtype)],
        input_output_aliases={len(inputs) - 2: 1, len(inputs) - 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret_mode() if interpret is None else interpret,
        name="jspec_rope_write",
    )(*inputs)


def rope_write(qkv, cos, sin, k_buf, v_buf, kv_lengths, *, num_heads, num_kv_heads, q_norm=None, k_norm=None,
               eps=1e-6, norm=None, v_norm=False, k_eq_v=False, impl="auto"):
    """Dispatcher. ``"pallas"``, and ``"auto"`` on a GPU: the kernel (head_dim / 2 a power of two, else
    the reference); ``"xla"`` and ``"invariant"`` (elementwise work: exact either way): the reference.
    ``norm``: the q / k norms' rounding (None: Llama / Qwen3's :func:`rms_norm`; ``"fp32_scale"``: Gemma 4's),
    ``v_norm``: v normed without a weight (Gemma 4), ``k_eq_v``: qkv holds no v columns, V is the raw K.

    ``auto``'s choice follows the benchmarks (figures: ``benchmarks/README.md``, plain decode): the
    kernel wins or ties in every Llama-family model, in the on-device decode loop at batch 1 and 16,
    the verify forward and prefill. Gemma 4's variant (its norms, head_dim 256 / 512) wins in E4B's
    decode loop too, given that its attention runs on the kernel at small caches (with attention on
    XLA's reference the loop would run slower with this kernel)."""
    impl = check_impl(impl, "rope_write")
    check_norm(norm, v_norm)
    head_dim = k_buf.shape[-1]
    shapes_fit = head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0
    options = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, norm=norm, v_norm=v_norm, k_eq_v=k_eq_v)
    if shapes_fit and (impl == "pallas" or (impl == "auto" and on_gpu())):
        return tuple(rope_write_pallas(qkv, cos, sin, k_buf, v_buf, kv_lengths, q_norm, k_norm,
                                       interpret=not on_gpu(), **options))
    return rope_write_reference(qkv, cos, sin, k_buf, v_buf, kv_lengths, q_norm=q_norm, k_norm=k_norm, **options)
