"""Where the wide-head kernel's time goes near 256 MB read (Gemma 4 31B full layers, bf16).

For each cell: each kernel of one cold call (median of 7), the default call against split-count
and block-size variants with a second copy of the default as control (interleaved in one trace),
and XLA reading (a sum) and copying the same bytes. H100:
``PYTHONPATH=. python benchmarks/probes/wide_head_breakdown.py`` writes ``$OUT/probe_wide.json``.
"""

from __future__ import annotations

import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp

from jspec.bench.kernel_check import decode_attention_inputs
from jspec.bench.timing import gpu_kernel_times, interleaved_gpu_times
from pallas_kernels.wide_head_decode import decode_attention_wide
from pallas_kernels.wide_head_tiling import default_block_kv, default_splits, m_tiles

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 512
CELLS = [(1, 32768, 5), (1, 32768, 9), (8, 4096, 9), (1, 131072, 9), (1, 4096, 9), (1, 131072, 5)]  # batch, context, rows


def kernel_breakdown(fn, repeats=7):
    """``[(kernel name, median us)]`` of one cold call."""
    traces = [gpu_kernel_times(fn, warmup=2 if i == 0 else 0, flush_l2_bytes=256 << 20) for i in range(repeats)]
    return [(name[:60], statistics.median(trace[j][1] for trace in traces) * 1e6)
            for j, (name, _) in enumerate(traces[0])]


def wide(inputs, **kernel_kw):
    q, k, v, lengths, positions = inputs
    call = jax.jit(lambda q, k, v, lengths, positions: decode_attention_wide(
        q, k, v, lengths, q_positions=positions, scale=1.0, **kernel_kw))
    return functools.partial(call, q, k, v, lengths, positions)


def main():
    result = {"breakdown": {}, "variants": {}, "controls": {}}
    for batch, context, num_q in CELLS:
        inputs = decode_attention_inputs(batch, num_q, NUM_Q_HEADS, NUM_KV_HEADS, context, HEAD_DIM, [context] * batch,
                                         seed=0, dtype=jnp.bfloat16)
        cell = f"b{batch}x{context}_q{num_q}"
        result["breakdown"][cell] = kernel_breakdown(wide(inputs))
        block_kv = default_block_kv(num_q, NUM_Q_HEADS, NUM_KV_HEADS)
        splits = default_splits(batch, NUM_KV_HEADS, context, block_kv, m_tiles(num_q, NUM_Q_HEADS, NUM_KV_HEADS))
        calls = {"default": wide(inputs), "default2": wide(inputs)}
        for n in sorted({max(1, splits // 2), 2 * splits, 4 * splits}):
            calls[f"splits{n}"] = wide(inputs, k_splits=n)
        other = 64 if block_kv == 32 else 32
        calls[f"block{other}"] = wide(inputs, block_kv=other)
        times = interleaved_gpu_times(calls, repeats=7)
        result["variants"][cell] = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        result["variants"][cell]["default_splits"] = splits
        _, k, v, _, _ = inputs
        read = jax.jit(lambda k, v: jnp.sum(k, axis=2, dtype=jnp.float32) + jnp.sum(v, axis=2, dtype=jnp.float32))
        copy = jax.jit(lambda k: k + jnp.bfloat16(1))
        times = interleaved_gpu_times({"xla_read_sum": functools.partial(read, k, v),
                                       "xla_copy_k": functools.partial(copy, k)}, repeats=7)
        result["controls"][cell] = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        result["controls"][cell]["kv_bytes"] = 2 * k.nbytes
        print(cell, result["breakdown"][cell], result["variants"][cell], result["controls"][cell], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_wide.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
