"""The memory roofline: device copy bandwidth, and the bytes one decode step must read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jspec.bench.timing import Timing, cuda_event_times, time_fn
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


def weight_bytes_per_step(model: Model) -> int:
    """Parameter bytes one decode step must read: everything but the embedding tables,
    of which only the looked-up rows are touched (unless one doubles as the LM head).
    Gemma 4's per-layer-embedding table is such a lookup table too."""
    leaves = jax.tree.leaves(model)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    if model.lm_head is not None:
        total -= model.embed.size * model.embed.dtype.itemsize
    if isinstance(model, gemma4.Model) and model.ple is not None:
        total -= model.ple.embed.size * model.ple.embed.dtype.itemsize
    return int(total)


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
