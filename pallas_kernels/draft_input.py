"""A greedy draft step's token and the next layer's input, from the head's logits, in one launch.

Shapes:
  logits        [batch, draft_vocab]   the head's logits (fp32)
  hidden        [batch, hidden]        the hidden state the next row recycles
  embed         [vocab, hidden]        the embedding table the token is looked up in
  embed_norm    [hidden]               the RMSNorm weight on the embedding row
  hidden_norm   [hidden]               the RMSNorm weight on ``hidden``
  d2t           [draft_vocab] or None  int32 offsets of the draft vocabulary: target id = i + d2t[i]
  out           (tokens [batch] int32 target ids,
                 layer_input [batch, 2 * hidden] = concat(rms_norm(embed[tokens] as embed_norm's
                 dtype, embed_norm), rms_norm(hidden, hidden_norm)))

This is what an EAGLE-3 head does between its LM head and its next draft layer (REFERENCE §2.2):
``argmax``, the draft-to-target map, the embedding row, two Llama RMSNorms and the concatenation.
XLA runs it as three or four launches on a draft step's critical path (H100, 8B head: ~7.6 us from
the LM head's end to the next layer's q/k/v projection, ``benchmarks/loop_diag_h100.json``). The
Pallas kernel (Triton backend) runs one program per sequence: the argmax over chunks of the logits
(the first index of the maximum, as ``jnp.argmax``; ``-inf`` everywhere gives 0), the offset, the
embedding row through a pointer window over the flat table, and both norms (rounded as
:func:`pallas_kernels.gather_rows.rms_norm`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pdl
from pallas_kernels._dispatch import check_impl, interpret_mode, on_gpu
from pallas_kernels.gather_rows import llama_scaled, rms_norm
from pallas_kernels.split_kv import _next_pow2

_LOGITS_CHUNK = 4096  # fp32 logits one load reads (16 a thread at 8 warps)
_ROW_CHUNK = 4096
_MAX_FLAT = 2**31 - 1  # the table is addressed with int32 offsets


def _check(logits, hidden, embed, embed_norm, hidden_norm, d2t):
    batch, width = hidden.shape[0], embed.shape[1]
    if (logits.ndim != 2 or hidden.ndim != 2 or embed.ndim != 2 or logits.shape[0] != batch
            or hidden.shape[1] != width or embed_norm.shape != (width,) or hidden_norm.shape != (width,)
            or (d2t is not None and d2t.shape != logits.shape[1:])):
        raise ValueError(
            "draft_input needs logits [batch, draft_vocab], hidden [batch, H], embed [vocab, H], embed_norm "
            f"and hidden_norm [H], d2t [draft_vocab] or None; got logits {logits.shape}, hidden {hidden.shape}, "
            f"embed {embed.shape}, embed_norm {embed_norm.shape}, hidden_norm {hidden_norm.shape}, "
            f"d2t {None if d2t is None else d2t.shape}")


def draft_input_reference(logits, hidden, embed, embed_norm, hidden_norm, eps, *, d2t=None):
    """The composition the kernel fuses (see the module docstring)."""
    _check(logits, hidden, embed, embed_norm, hidden_norm, d2t)
    ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = ids if d2t is None else ids + d2t[ids]
    e = embed[tokens].astype(embed_norm.dtype)
    return tokens, jnp.concatenate([rms_norm(e, embed_norm, eps), rms_norm(hidden, hidden_norm, eps)], axis=-1)


def _argmax(logits_ref, size):
    """First index of the maximum of the ``size`` logits (``-inf`` everywhere: 0)."""
    best_value, best_index = jnp.float32(-jnp.inf), jnp.int32(0)
    chunk = min(_next_pow2(size), _LOGITS_CHUNK)
    for start in range(0, size, chunk):
        offsets = start + jnp.arange(chunk, dtype=jnp.int32)
        values = plgpu.load(logits_ref.at[offsets], mask=offsets < size, other=-jnp.inf).astype(jnp.float32)
        chunk_max = jnp.max(values)
        chunk_index = jnp.min(jnp.where(values == chunk_max, offsets, jnp.int32(size)))
        better = chunk_max > best_value  # strictly: an earlier chunk keeps a tie
        best_index = jnp.where(better, chunk_index, best_index)
        best_value = jnp.where(better, chunk_max, best_value)
    return best_index


def _norm_row(load, store, width, eps, dtype):
    """Llama RMSNorm of one row read chunk by chunk: ``load(offsets, mask)`` -> values,
    ``store(offsets, values, mask)``; the row is cast to ``dtype`` first."""
    chunk = min(_next_pow2(width), _ROW_CHUNK)
    offsets = [start + jnp.arange(chunk, dtype=jnp.int32) for start in range(0, width, chunk)]
    masks = [off < width for off in offsets]
    rows = [load(off, msk).astype(dtype) for off, msk in zip(offsets, masks)]
    inv = jax.lax.rsqrt(sum(jnp.sum(r.astype(jnp.float32) ** 2) for r in rows) / width + eps)
    for off, msk, r in zip(offsets, masks, rows):
        store(off, r, inv, msk)


def _kernel(logits_ref, hidden_ref, embed_ref, embed_norm_ref, hidden_norm_ref, *refs, draft_vocab, width, eps,
            has_d2t):
    if has_d2t:
        d2t_ref, tokens_ref, out_ref = refs
    else:
        tokens_ref, out_ref = refs
    index = _argmax(logits_ref, draft_vocab)
    token = index + plgpu.load(d2t_ref.at[index]) if has_d2t else index
    tokens_ref[()] = token
    base = token * width

    def store_at(shift, weight_ref):
        def store(off, r, inv, msk):
            w = plgpu.load(weight_ref.at[off], mask=msk, other=0)
            plgpu.store(out_ref.at[shift + off], llama_scaled(r, inv, w).astype(out_ref.dtype), mask=msk)
        return store

    _norm_row(lambda off, msk: plgpu.load(embed_ref.at[base + off], mask=msk, other=0), store_at(0, embed_norm_ref),
              width, eps, embed_norm_ref.dtype)
    _norm_row(lambda off, msk: plgpu.load(hidden_ref.at[off], mask=msk, other=0), store_at(width, hidden_norm_ref),
              width, eps, hidden_ref.dtype)


def draft_input_pallas(logits, hidden, embed, embed_norm, hidden_norm, eps, *, d2t=None, num_warps=8,
                       interpret=None):
    """The kernel: one program per sequence."""
    _check(logits, hidden, embed, embed_norm, hidden_norm, d2t)
    if embed.size > _MAX_FLAT:
        raise ValueError(f"draft_input's kernel addresses the embedding table with int32 offsets: {embed.shape} "
                         f"has {embed.size} > {_MAX_FLAT} elements (use impl='xla')")
    batch, draft_vocab = logits.shape
    vocab, width = embed.shape
    out_dtype = jnp.promote_types(embed_norm.dtype, jnp.promote_types(hidden.dtype, hidden_norm.dtype))
    kernel = functools.partial(_kernel, draft_vocab=draft_vocab, width=width, eps=float(eps), has_d2t=d2t is not None)

    def whole(size):
        return pl.BlockSpec((size,), lambda b: (0,))

    in_specs = [pl.BlockSpec((None, draft_vocab), lambda b: (b, 0)), pl.BlockSpec((None, width), lambda b: (b, 0)),
                whole(vocab * width), whole(width), whole(width)]  # the table: a pointer window over all of it
    args = [logits, hidden, embed.reshape(vocab * width), embed_norm, hidden_norm]
    if d2t is not None:
        in_specs.append(whole(draft_vocab))
        args.append(d2t.astype(jnp.int32))
    tokens, layer_input = pdl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None,), lambda b: (b,)), pl.BlockSpec((None, 2 * width), lambda b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch, 2 * width), out_dtype)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret_mode() if interpret is None else interpret,
        name="jspec_draft_input",
    )(*args)
    return tokens, layer_input


def use_pallas(batch: int, draft_vocab: int, width: int) -> bool:
    """The ``impl="auto"`` rule on a GPU: decode batches (the kernel runs one program a sequence)."""
    return batch <= 64 and draft_vocab <= 262144 and width <= 16384


def draft_input(logits, hidden, embed, embed_norm, hidden_norm, eps, *, d2t=None, impl="auto"):
    """Dispatcher: ``(tokens, layer_input)`` (see the module docstring). ``impl="invariant"`` takes the
    kernel (each row's norms sum in one fixed order; the argmax and the gather are exact)."""
    impl = check_impl(impl, "draft_input")
    if impl == "auto":
        use = (on_gpu() and embed.size <= _MAX_FLAT
               and use_pallas(logits.shape[0], logits.shape[-1], embed.shape[1]))
        impl = "pallas" if use else "xla"
    if impl in ("pallas", "invariant"):
        return draft_input_pallas(logits, hidden, embed, embed_norm, hidden_norm, eps, d2t=d2t)
    return draft_input_reference(logits, hidden, embed, embed_norm, hidden_norm, eps, d2t=d2t)
