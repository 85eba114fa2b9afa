"""Shared pieces of the benchmark scripts: preset shapes, timing, bandwidth, roofline.

Timing rule: warm up (compile + first runs), then time many repeats and report the median
and spread; every timed region ends with ``block_until_ready`` on its outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.models import AnyModel as Model, gemma4
from jspec.models.gemma4 import FULL, SLIDING, Gemma4Config
from jspec.models.llama import LlamaConfig, RopeScaling

PRESETS: dict[str, LlamaConfig | Gemma4Config] = {
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=4096,
    ),
    "tiny-draft": LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, max_position_embeddings=4096,
    ),
    # Every Gemma 4 feature at toy size (two attention geometries, k_eq_v, a window, per-layer
    # embeddings, KV-shared layers, softcap), for the scripts' CPU smoke runs.
    "tiny-gemma4": Gemma4Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=16, num_global_kv_heads=1, global_head_dim=32, layer_types=(SLIDING, FULL, SLIDING, FULL),
        sliding_window=16, max_position_embeddings=4096, attention_k_eq_v=True, final_logit_softcapping=30.0,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512, num_kv_shared_layers=2,
    ),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
    ),
    "qwen3-8b": LlamaConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        architecture="Qwen3ForCausalLM",
    ),
    # Dense text decoder of Gemma-4-31B, shapes as specified for this project (REFERENCE §1.5);
    # RoPE 1e4 default (sliding) / 1e6 proportional 0.25 (full) are the Gemma4Config defaults.
    # max_position_embeddings = 262144 (the advertised 256K context) is not from a config file.
    "gemma-4-31b": Gemma4Config(
        vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_layers=60, num_heads=32,
        num_kv_heads=16, head_dim=256, num_global_kv_heads=4, global_head_dim=512,
        layer_types=((SLIDING,) * 5 + (FULL,)) * 10, sliding_window=1024, max_position_embeddings=262144,
        attention_k_eq_v=True, final_logit_softcapping=30.0,
    ),
    # Gemma-4-E4B text decoder: text_config values as given by public code that reads the released
    # config (rasbt/LLMs-from-scratch ch05/17_gemma4 get_gemma4_dense_config("E4B"), and an MLX Go
    # test TestParseTextConfigE4B; both agree): 42 layers, 8 heads, 2 KV heads, head_dim 256 /
    # global 512 (no k_eq_v), intermediate 10240, PLE 256 over a 262144 vocab, last 18 layers KV-shared.
    "gemma-4-e4b": Gemma4Config(
        vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_layers=42, num_heads=8,
        num_kv_heads=2, head_dim=256, num_global_kv_heads=2, global_head_dim=512,
        layer_types=((SLIDING,) * 5 + (FULL,)) * 7, sliding_window=512, max_position_embeddings=131072,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
        num_kv_shared_layers=18,
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def load_target(name_or_path: str, dtype, seed: int = 0) -> Model:
    """A preset (random weights made on the device) or a checkpoint directory (HF or jspec)."""
    import jspec

    if name_or_path in PRESETS:
        init = jax.jit(jspec.init_params, static_argnums=(0, 2))
        return init(PRESETS[name_or_path], jax.random.key(seed), dtype)
    path = Path(name_or_path)
    if (path / "jspec_config.json").exists():
        return jax.tree.map(lambda x: x.astype(dtype), jspec.restore(path))
    return jspec.load_hf(path, dtype=dtype)


def confident(model: Model, seed: int = 0, residual_scale: float = 1e-2) -> Model:
    """Random weights whose greedy continuation survives bf16 rounding.

    Plain random weights give near-tied logits, so a verify forward over k+1 rows (different
    rounding than a one-row decode step) often picks another argmax and no oracle can predict
    it. Here the LM head is a permutation of the embedding table and the attention / MLP
    outputs are scaled down, so the residual stream stays close to the input embedding and
    token ``t`` is followed by ``perm[t]`` with a wide margin. Shapes, bytes and FLOPs are
    those of the original model.
    """
    import dataclasses as dc

    perm = jax.random.permutation(jax.random.key(seed), model.config.vocab_size)
    if isinstance(model, gemma4.Model):
        # Gemma 4 norms each branch output before the residual add, undoing a scaled o / down:
        # scale those post-norm weights instead.
        def scaled(w):
            return None if w is None else w * residual_scale

        layers = tuple(
            dc.replace(layer, post_attn_norm=scaled(layer.post_attn_norm), post_mlp_norm=scaled(layer.post_mlp_norm),
                       ple_norm=scaled(layer.ple_norm))
            for layer in model.layers
        )
    else:
        layers = tuple(
            dc.replace(layer, o=layer.o * residual_scale, down=layer.down * residual_scale) for layer in model.layers
        )
    head = None if model.lm_head is None else jnp.asarray(model.embed[perm].T)
    return dc.replace(model, layers=layers, lm_head=head)


@dataclasses.dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int

    def as_dict(self, scale: float = 1.0, unit: str = "ms") -> dict:
        f = 1e3 if unit == "ms" else 1.0
        return {
            f"median_{unit}": self.median_s * f / scale,
            f"p10_{unit}": self.p10_s * f / scale,
            f"p90_{unit}": self.p90_s * f / scale,
            "repeats": self.repeats,
        }


def time_fn(fn: Callable[[], object], *, warmup: int = 2, repeats: int = 10) -> Timing:
    """Median wall time of ``fn()`` (which must return device arrays) after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    q = np.quantile(samples, [0.1, 0.9])
    return Timing(statistics.median(samples), float(q[0]), float(q[1]), repeats)


def time_steps(step: Callable, state, *, warmup: int = 3, repeats: int = 10, calls: int = 1):
    """Median time per call of a donated ``state -> state`` step dispatched back to back.

    Each sample times ``calls`` consecutive calls ending in one ``block_until_ready``.
    Returns ``(Timing, final state)``.
    """
    for _ in range(warmup):
        state = step(state)
    jax.block_until_ready(state)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            state = step(state)
        jax.block_until_ready(state)
        samples.append((time.perf_counter() - start) / calls)
    q = np.quantile(samples, [0.1, 0.9])
    return Timing(statistics.median(samples), float(q[0]), float(q[1]), repeats), state


def _traced_kernels(thunks: list[Callable[[], object]]) -> list[tuple[str, float]]:
    """``(kernel name, seconds)`` of every GPU kernel the thunks run, in launch order, from one
    profiler trace (CUPTI): each kernel's own time on the GPU, without host dispatch or gaps."""
    import tempfile

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for thunk in thunks:
                jax.block_until_ready(thunk())
        data = jax.profiler.ProfileData.from_file(str(next(Path(trace_dir).rglob("*.xplane.pb"))))
    kernels = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # "XLA Ops" / "XLA Modules" repeat the kernels
                continue
            kernels += [(event.start_ns, event.name, event.duration_ns * 1e-9) for event in line.events
                        if not event.name.startswith(("Memcpy", "Memset"))]
    return [(name, seconds) for _, name, seconds in sorted(kernels)]


def _l2_flush(num_bytes: int) -> Callable[[], object]:
    """A thunk that rewrites ``num_bytes``; an integer xor, so that its kernel's name is unlikely to
    be any timed call's (:func:`interleaved_gpu_times` splits a trace at it)."""
    buffer = jnp.zeros((num_bytes // 4,), jnp.uint32)
    rewrite = jax.jit(lambda x: x ^ jnp.uint32(0x5A5A5A5A))
    return lambda: rewrite(buffer)


def gpu_kernel_times(fn: Callable[[], object], *, warmup: int = 2,
                     flush_l2_bytes: int = 0) -> list[tuple[str, float]]:
    """``(kernel name, seconds)`` of every GPU kernel that one call of ``fn()`` runs.

    The times come from the profiler (CUPTI): each kernel's own time on the GPU, without host
    dispatch or the gaps between kernels, the same quantity torch's profiler and Nsight report, so
    a kernel can be compared with a peer's kernel regardless of how either framework launches it.
    ``flush_l2_bytes``: rewrite a buffer that large just before the traced call, so that inputs the
    warm-up left in the L2 cache are read from memory again (a cold call). Empty off a GPU.
    """
    if jax.default_backend() != "gpu":  # no GPU kernels to time: skip the warm-up and the trace
        return []
    for _ in range(warmup):
        jax.block_until_ready(fn())
    if flush_l2_bytes:
        jax.block_until_ready(_l2_flush(flush_l2_bytes)())
    return _traced_kernels([fn])


def interleaved_gpu_times(calls: dict[str, Callable[[], object]], *, repeats: int = 5,
                          flush_l2_bytes: int = 256 << 20) -> dict[str, list[float]]:
    """GPU seconds per call (all its kernels) of each named thunk, ``repeats`` cold calls each.

    The calls are interleaved (a, b, c, a, b, c, ...) inside one profiler trace, each after its own
    L2 flush, so that slow drifts of the GPU (clocks, temperature) touch every candidate alike.
    The flush kernels, recognised by name from a trace of the flush alone, separate the calls.
    Empty lists off a GPU.
    """
    if jax.default_backend() != "gpu":
        return {name: [] for name in calls}
    flush = _l2_flush(flush_l2_bytes)
    for thunk in (flush, *calls.values()):  # compile and warm up
        jax.block_until_ready(thunk())
    flush_names = {name for name, _ in _traced_kernels([flush])}
    order = [name for _ in range(repeats) for name in calls]
    kernels = _traced_kernels([thunk for name in order for thunk in (flush, calls[name])])
    if sum(name in flush_names for name, _ in kernels) != len(order):
        raise RuntimeError(f"the L2 flush kernel {sorted(flush_names)} is not a unique call separator")
    times = {name: [] for name in calls}
    call = -1
    for name, seconds in kernels:
        if name in flush_names:
            call += 1
            times[order[call]].append(0.0)
        else:
            times[order[call]][-1] += seconds
    return times


def decode_attention_inputs(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, lengths, *,
                            seed=0, poison=False):
    """Random bf16 ``q [batch, num_q, num_q_heads, head_dim]`` and caches ``k, v [batch, num_kv_heads,
    max_len, head_dim]``, ``kv_lengths`` from ``lengths`` and ``q_positions`` = the last ``num_q``
    rows of each length. ``poison``: NaN in every cache row past each length (nothing may read it)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, num_q, num_q_heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, num_kv_heads, max_len, head_dim), jnp.bfloat16) for key in keys[1:])
    kv_lengths = jnp.asarray(lengths, jnp.int32)
    if poison:
        past = jnp.arange(max_len)[None, None, :, None] >= kv_lengths[:, None, None, None]
        k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
    q_positions = kv_lengths[:, None] - num_q + jnp.arange(num_q, dtype=jnp.int32)[None, :]
    return q, k, v, kv_lengths, q_positions


def copy_bandwidth(num_bytes: int = 2 << 30) -> dict:
    """Device copy bandwidth (bytes read + written per second), best of the methods available.

    torch's ``copy_`` reads closer to the hardware limit than a JAX elementwise op, so it
    is preferred when torch with CUDA is importable (GPU machine); JAX is the fallback.
    """
    results = {}
    n = num_bytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = time_fn(functools.partial(copy, x), warmup=2, repeats=10)
    results["jax_elementwise"] = 2 * num_bytes / t.median_s
    del x
    try:
        import torch

        if torch.cuda.is_available():
            src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            for _ in range(3):
                dst.copy_(src)
            torch.cuda.synchronize()
            samples = []
            for _ in range(10):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            results["torch_copy"] = 2 * num_bytes / statistics.median(samples)
            del src, dst
            torch.cuda.empty_cache()
    except ImportError:
        pass
    best = max(results, key=results.get)
    return {"bytes_per_s": results[best], "method": best, "all_methods": results}


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


def environment(dtype, seed: int) -> dict:
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax_version": jax.__version__,
        "python": platform.python_version(),
        "dtype": jnp.dtype(dtype).name,
        "seed": seed,
        "weights": "random (generated on the device)",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float))
