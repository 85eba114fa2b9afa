"""The memory roofline: device copy bandwidth, and the bytes one decode step must read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.bench.timing import Timing, cuda_event_times, time_fn
from jspec.drafters import DFlash, DraftModel, Eagle3, NGram
from jspec.models import AnyModel as Model
from jspec.models import gemma4
from jspec.models.llama import LlamaConfig


def torch_copy_timing(num_bytes: int, *, repeats: int = 10) -> Timing:
    """GPU time (CUDA events) of one torch ``copy_`` of ``num_bytes`` (needs torch with CUDA)."""
    import torch

    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    timing = cuda_event_times(functools.partial(dst.copy_, src), warmup=3, repeats=repeats)
    del src, dst
    torch.cuda.empty_cache()
    return timing


def copy_bandwidth(num_bytes: int = 2 << 30, *, repeats: int = 10) -> dict:
    """Device copy bandwidth (bytes read + written per second), best of the methods available.

    torch's ``copy_`` reads closer to the hardware limit than a JAX elementwise op, so it
    is preferred when torch with CUDA is importable (GPU machine); JAX is the fallback.
    Returns ``bytes_per_s``, ``tb_s``, ``method``, ``bytes``, and per method its bandwidth and timing.
    """
    timings = {}
    x = jnp.ones((num_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    timings["jax_elementwise"] = time_fn(functools.partial(copy, x), warmup=2, repeats=repeats)
    del x
    try:
        import torch

        if torch.cuda.is_available():
            timings["torch_copy"] = torch_copy_timing(num_bytes, repeats=repeats)
    except ImportError:
        pass
    rates = {name: 2 * num_bytes / t.median_s for name, t in timings.items()}
    best = max(rates, key=rates.get)
    return {"bytes_per_s": rates[best], "tb_s": rates[best] / 1e12, "method": best, "bytes": num_bytes,
            "all_methods": rates, "timings": {name: t.as_dict() for name, t in timings.items()}}


def _nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def weight_bytes_per_step(model: Model) -> int:
    """Parameter bytes one decode step must read: everything but the embedding tables,
    of which only the looked-up rows are touched (unless one doubles as the LM head).
    Gemma 4's per-layer-embedding table is such a lookup table too."""
    total = _nbytes(model)
    if model.lm_head is not None:
        total -= _nbytes(model.embed)
    if isinstance(model, gemma4.Model) and model.ple is not None:
        total -= _nbytes(model.ple.embed)
    return total


def kv_bytes_per_step(model: Model, batch: int, context: int) -> int:
    """K and V bytes one decode step reads at ``context`` valid rows per sequence, all layers.

    Gemma 4: each layer reads its own shape (sliding and full layers differ), a sliding layer
    only its last ``sliding_window`` rows, and a KV-shared layer reads its source layer's
    cache again (it owns none, but the read is real traffic).
    """
    c = model.config
    itemsize = jnp.dtype(model.dtype).itemsize
    if isinstance(c, LlamaConfig):
        return int(2 * c.num_layers * batch * c.num_kv_heads * context * c.head_dim * itemsize)
    total = 0
    for i in range(c.num_layers):
        kv_heads, head_dim = c.attention_shape(i)
        rows = min(context, c.window(i) or context)
        total += 2 * batch * kv_heads * rows * head_dim * itemsize
    return int(total)


def draft_bytes_per_round(drafter, num_draft_tokens: int) -> int | None:
    """Parameter bytes a drafter must read in one chain round of ``num_draft_tokens`` drafts
    (propose and commit), or None for a drafter this does not model (MTP, the Gemma 4 assistant).

    * n-gram: none;
    * draft model: one forward per draft (the first over two rows), each reading its weights;
    * EAGLE-3 head: per draft one LM head (over the draft vocabulary) and one decoder layer (k - 1
      layers in the propose scan, one in the commit's catch-up), and ``fc`` once, in the commit;
    * DFlash: every draft weight once (the block's one forward) and the target's LM head once (the
      block's rows), whatever k -- the published bound. jspec's commit also reads ``fc`` and each
      layer's ``q|k|v`` again for the accepted rows' context K/V (:func:`dflash_commit_extra_bytes`).
    """
    if isinstance(drafter, NGram):
        return 0
    if isinstance(drafter, DraftModel):
        return num_draft_tokens * weight_bytes_per_step(drafter.model)
    if isinstance(drafter, Eagle3):
        head = drafter.head
        per_draft = _nbytes((head.layer, head.norm, head.hidden_norm, head.lm_head))
        return num_draft_tokens * per_draft + _nbytes((head.fc, head.fc_bias, head.fc_norm))
    if isinstance(drafter, DFlash):
        return _nbytes(drafter.head) + _nbytes(drafter.target.lm_head if drafter.target.lm_head is not None
                                               else drafter.target.embed)
    return None


def dflash_commit_extra_bytes(drafter) -> int:
    """What jspec's DFlash commit reads beyond the published bound: ``fc`` and every layer's
    ``q|k|v`` a second time (the context K/V of the accepted rows, written apart from the block)."""
    return _nbytes((drafter.head.fc, *(layer.qkv for layer in drafter.head.layers)))


def propose_bytes(drafter, num_draft_tokens: int) -> int | None:
    """Parameter bytes a drafter's propose of ``num_draft_tokens`` drafts reads (the round's commit
    not included), or None for a drafter this does not model:

    * n-gram: none;
    * draft model: one forward per draft;
    * EAGLE-3 head: the draft LM head (and its norm) per draft and one decoder layer per draft but
      the last (the first draft comes from the hidden state the commit's catch-up left).
    """
    if isinstance(drafter, (NGram, DraftModel)):
        return draft_bytes_per_round(drafter, num_draft_tokens)
    if isinstance(drafter, DFlash):  # the block's forward and LM head: all but the commit's fc
        return draft_bytes_per_round(drafter, num_draft_tokens) - _nbytes(drafter.head.fc)
    if isinstance(drafter, Eagle3):
        head = drafter.head
        return (num_draft_tokens * _nbytes((head.norm, head.lm_head))
                + (num_draft_tokens - 1) * _nbytes((head.layer, head.hidden_norm)))
    return None


def round_roofline_ratio(target: Model, drafter, num_draft_tokens: int, batch: int, context: int) -> float | None:
    """The least a chain round can cost against a plain decode step when both stream their bytes at
    the same bandwidth: (step bytes + the drafter's bytes) / step bytes, the step's bytes being
    the target's weights and KV (a verify forward of k + 1 rows reads the same). None where the
    drafter is not modelled (:func:`draft_bytes_per_round`)."""
    draft = draft_bytes_per_round(drafter, num_draft_tokens)
    if draft is None:
        return None
    step = weight_bytes_per_step(target) + kv_bytes_per_step(target, batch, context)
    return (step + draft) / step
