"""Few-query attention against a long, read-only KV cache (decode, verify, frozen-KV drafting).

Shapes:
  q            [batch, num_q, num_q_heads, head_dim]
  k, v         [batch, num_kv_heads, max_len, head_dim]   (never written here)
  kv_lengths   [batch]           valid cache rows, incl. rows just written for q
  q_positions  [batch, num_q]    absolute positions of the query rows
  tail_mask    [batch, num_q, num_q] bool, optional (tree attention)
  out          [batch, num_q, num_q_heads, head_dim]  (q's dtype)

Visibility rule (``L = min(kv_lengths[b], max_len)``, ``p_i = q_positions[b, i]``):

* without ``tail_mask``: cache row ``j`` is visible to query ``i`` iff ``j < L`` and ``j <= p_i``
  and (no window or ``p_i - j < window``);
* with ``tail_mask``: the last ``num_q`` valid rows ``j = L - num_q + c`` (``c`` in
  ``0..num_q-1``; row ``c`` of the tail holds the K/V written for query ``c``) are visible iff
  ``tail_mask[b, i, c]`` and (no window or ``p_i - p_c < window``) -- the mask replaces the
  causal rule there, the window still applies, measured between the two rows' positions.
  Rows before the tail follow the rule above.
* A query that sees no row at all (e.g. a padding query with ``p_i < 0``) gets a zero output.

``scale`` defaults to ``head_dim ** -0.5``. Softmax and accumulation are in fp32; the
probabilities are cast to V's dtype before the PV product (as a flash kernel does).

The Pallas kernel (flash-decoding with the batch's KV blocks shared out evenly over its programs,
stream-K) lives in :mod:`pallas_kernels.attention.flash_decoding`; its tiling, a function of the shapes and
the window, in :mod:`pallas_kernels.attention.decode_tiling`. Wide heads (head_dim 512) with neither window
nor tail mask run on a GPU in Mosaic GPU kernels instead: up to 40 query rows x GQA group with the
rows on WGMMA's N axis (:mod:`pallas_kernels.attention.wide_head_swapped`, :func:`use_swapped_kernel`), more
in 64-row M tiles (:mod:`pallas_kernels.attention.wide_head_decode`, :func:`use_wide_kernel`).

``impl="auto"`` (see :func:`use_pallas`): the reference on CPU; on a GPU the kernel wherever the
recorded benchmarks show it faster (figures: ``benchmarks/README.md``, decode attention).
``impl="invariant"``: :mod:`pallas_kernels.attention.invariant_attention` (each row's output independent of
the other rows, the batch and the cache capacity; tree attention too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.dispatch import check_impl, on_gpu
from pallas_kernels.attention.flash_decoding import _effective_tail_mask, decode_attention_pallas
from pallas_kernels.attention.invariant_attention import decode_attention_invariant
from pallas_kernels.attention.split_kv import _MASK_VALUE
from pallas_kernels.attention.wide_head_decode import decode_attention_wide
from pallas_kernels.attention.wide_head_swapped import decode_attention_swapped, default_row_groups
from pallas_kernels.attention.wide_head_swapped import supports as swapped_kernel_supports
from pallas_kernels.attention.wide_head_tiling import supports as wide_kernel_supports

__all__ = ["decode_attention", "decode_attention_pallas", "decode_attention_reference", "use_pallas", "visibility_mask"]


def visibility_mask(kv_lengths, q_positions, max_len, *, tail_mask=None, window=None):
    """Which cache rows each query sees: bool [batch, num_q, max_len] (module docstring rule)."""
    lengths = jnp.minimum(kv_lengths.astype(jnp.int32), max_len)[:, None, None]
    rows = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    pos = q_positions.astype(jnp.int32)[:, :, None]
    visible = (rows < lengths) & (rows <= pos)
    if window is not None:
        visible &= pos - rows < window
    if tail_mask is not None:
        num_q = q_positions.shape[1]
        tail = _effective_tail_mask(tail_mask, q_positions, window)
        tail_start = lengths - num_q
        in_tail = (rows >= tail_start) & (rows < lengths)
        # Tail row j holds the K/V of query column j - tail_start.
        col = jnp.clip(rows - tail_start, 0, num_q - 1)
        tail_visible = jnp.take_along_axis(tail, jnp.broadcast_to(col, tail.shape[:2] + (max_len,)), axis=2)
        visible = jnp.where(in_tail, tail_visible, visible)
    return visible


def decode_attention_reference(q, k, v, kv_lengths, *, q_positions, tail_mask=None, window=None, scale=None):
    """Plain-jnp attention, fp32 softmax; the ground truth for the kernel and the XLA path."""
    batch, num_q, num_q_heads, head_dim = q.shape
    _, num_kv_heads, max_len, _ = k.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.reshape(batch, num_q, num_kv_heads, group, head_dim)
    if not on_gpu() and k.dtype != jnp.float32:
        # XLA:CPU has no bf16 x bf16 -> f32 dot for some layouts ("Unsupported element type for
        # DotThunk"); the products are exact in fp32, so upcasting changes nothing but the speed.
        qg, k = qg.astype(jnp.float32), k.astype(jnp.float32)
    scores = jnp.einsum(
        "bqhgd,bhsd->bhgqs", qg, k, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    scores = scores * scale
    visible = visibility_mask(kv_lengths, q_positions, max_len, tail_mask=tail_mask, window=window)
    visible = visible[:, None, None, :, :]
    scores = jnp.where(visible, scores, _MASK_VALUE)
    # Zero the masked probabilities explicitly: a query that sees nothing gets 0, not a mean.
    probs = jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0)
    # Rows past the length may hold NaN/Inf garbage: 0 * NaN is NaN, so zero them too.
    lengths = jnp.minimum(kv_lengths.astype(jnp.int32), max_len)
    v_clean = jnp.where(jnp.arange(max_len)[None, None, :, None] < lengths[:, None, None, None], v, 0)
    probs = probs.astype(v.dtype)
    if not on_gpu() and v.dtype != jnp.float32:
        probs, v_clean = probs.astype(jnp.float32), v_clean.astype(jnp.float32)
    out = jnp.einsum(
        "bhgqs,bhsd->bqhgd",
        probs,
        v_clean,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return out.reshape(batch, num_q, num_q_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def use_pallas(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype) -> bool:
    """The ``impl="auto"`` rule on a GPU (figures: ``benchmarks/README.md``, decode attention and
    draft attention at Gemma 4 shapes).

    The kernel for 16-bit caches (the only ones timed; fp32 goes to the reference) with head_dim
    <= 512, at any number of query rows and any cache size, except head_dim 512 with more than 4 M
    blocks of 16 rows (query rows x GQA group > 64, e.g. Gemma 4 31B verifying 9 rows): each M
    block reads the K/V blocks again from L2, and past 4 of them the reference's one pass over the
    cache is as fast or faster. ``auto`` gives these rows to the wide-head kernel's 64-row M tiles
    instead where :func:`use_wide_kernel` takes them.

    Tiny caches take the kernel too at head_dim <= 128: timed alone, one call of the reference can
    win there, but inside the model the kernel's one launch per layer beats the reference's several
    (GPU time of a decode step and of a verify forward lower or tied at every Llama shape measured,
    the on-device decode loop faster at most). Gemma 4's wider heads (256 / 512) at the same tiny
    caches take it too: the kernel path is faster or tied in every cell measured (full and sliding
    layers, one and several query rows), and so is the decode loop.
    """
    if jnp.dtype(dtype).itemsize != 2 or head_dim > 512:
        return False
    return head_dim <= 256 or num_q * (num_q_heads // num_kv_heads) <= 64


def use_wide_kernel(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, *, tail_mask=None,
                    window=None) -> bool:
    """Where the Pallas path on a GPU takes the Mosaic GPU wide-head kernel (figures:
    ``benchmarks/README.md``, draft attention at Gemma 4 shapes): head_dim 512 (Gemma 4's full
    layers), no window or tail mask, and

    * more than 32 rows (Gemma 4 31B verifying 4 drafts: 40; E4B 8 drafts: 36), where the Triton
      kernel's three or more 16-row slices re-reading each K/V tile reach a clearly smaller
      fraction of copy bandwidth than this kernel from ~1 GB read; or
    * 17..32 rows with 64 or more (sequence, KV head) pairs (E4B verifying 4 drafts at batch 32).

    Past 64 rows (31B verifying 8 drafts: 72) it runs 64-row M tiles, one program per tile, the
    tiles of a KV head one cluster so their K/V reads share L2: well ahead of the reference, where
    the Triton kernel is slower than the reference. Under ``auto`` these rows come here through the
    dispatcher, since :func:`use_pallas` leaves them to the reference.

    All of it only from 8k (sequence x KV head x cache row) triples up: below, the Triton kernel's
    lighter start wins by a few microseconds; from 8k (E4B verifying 8 drafts at batch 1 x 4k) this
    kernel is ahead. With at most 16 rows the Triton kernel is faster; up to 40,
    :func:`use_swapped_kernel`'s kernel comes first."""
    rows = num_q * (num_q_heads // num_kv_heads)
    busy = rows > 32 or (rows > 16 and batch * num_kv_heads >= 64)
    return (head_dim == 512 and busy and batch * num_kv_heads * max_len >= 8192 and tail_mask is None
            and window is None and wide_kernel_supports(num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype))


def use_swapped_kernel(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, *, tail_mask=None,
                       window=None) -> bool:
    """Where the Pallas path on a GPU takes the Mosaic GPU kernel with the query rows on WGMMA's N
    axis (:mod:`pallas_kernels.attention.wide_head_swapped`): head_dim 512 (Gemma 4's full layers), no window
    or tail mask, from 8k (sequence x KV head x cache row) triples up, and query rows x GQA group
    that one CTA takes (at most 40): in GPU time of a call it beats the Triton kernel and the M-axis
    wide kernel at every such shape measured, bar ties at one query row and large reads. 31B's 72
    rows stay with the M-axis kernel, which beats this one in two row groups of 40 and in one N
    (figures: ``benchmarks/README.md``, draft attention at Gemma 4 shapes)."""
    return (head_dim == 512 and tail_mask is None and window is None and batch * num_kv_heads * max_len >= 8192
            and swapped_kernel_supports(num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype)
            and default_row_groups(num_q, num_q_heads, num_kv_heads) == 1)


def wide_head_kernel(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, *, tail_mask=None,
                     window=None) -> str | None:
    """The Mosaic GPU kernel the Pallas path takes on a GPU at these shapes: ``"swapped"``,
    ``"wide"``, or None (the Triton kernel)."""
    shape = (batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype)
    if use_swapped_kernel(*shape, tail_mask=tail_mask, window=window):
        return "swapped"
    return "wide" if use_wide_kernel(*shape, tail_mask=tail_mask, window=window) else None


def decode_attention(q, k, v, kv_lengths, *, q_positions, tail_mask=None, window=None, scale=None, impl="auto"):
    """Dispatcher: see the module docstring for shapes and the visibility rule."""
    impl = check_impl(impl, "decode_attention")
    if q.shape[2] % k.shape[1]:
        raise ValueError(f"num_q_heads {q.shape[2]} is not a multiple of num_kv_heads {k.shape[1]}")
    shape = (*q.shape[:3], *k.shape[1:3], q.shape[3], k.dtype)  # batch, num_q, heads, kv heads, max_len, d
    mosaic = impl in ("auto", "pallas") and on_gpu() and wide_head_kernel(*shape, tail_mask=tail_mask, window=window)
    if impl == "auto":
        impl = "pallas" if on_gpu() and (use_pallas(*shape) or mosaic) else "xla"
    if impl == "invariant":
        return decode_attention_invariant(q, k, v, kv_lengths, q_positions=q_positions, tail_mask=tail_mask,
                                          window=window, scale=scale)
    if mosaic and impl == "pallas":
        kernel = decode_attention_swapped if mosaic == "swapped" else decode_attention_wide
        return kernel(q, k, v, kv_lengths, q_positions=q_positions, scale=scale)
    if impl == "pallas":
        return decode_attention_pallas(
            q, k, v, kv_lengths, q_positions=q_positions, tail_mask=tail_mask, window=window, scale=scale
        )
    return decode_attention_reference(
        q, k, v, kv_lengths, q_positions=q_positions, tail_mask=tail_mask, window=window, scale=scale
    )
