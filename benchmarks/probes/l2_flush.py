"""What the L2 flush before a timed call costs the call: GPU time of the same calls after a flush
that writes its 256 MB buffer (the bench's flush until 2026-11-27) and after one that reads it
(the bench's flush since), interleaved in one trace each. A read-only call of 268 MB, a copy of
it, and Gemma 4 31B full-layer attention at 268 MB (1 and 9 query rows). H100::

    PYTHONPATH=. python benchmarks/probes/l2_flush.py   # writes $OUT/l2_flush_read_vs_write.json
"""

from __future__ import annotations

import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp

from jspec.bench import timing
from jspec.bench.kernel_check import decode_attention_inputs
from pallas_kernels.decode_attention import decode_attention

MB = 268_435_456  # 31B full layers at batch 1 x 32k: K and V, 4 KV heads x 512 columns, bf16


def write_flush(num_bytes):
    buffer = jnp.zeros((num_bytes // 4,), jnp.uint32)
    rewrite = jax.jit(lambda x: x ^ jnp.uint32(0x5A5A5A5A))
    return lambda: rewrite(buffer)


def calls():
    x = jnp.ones((MB // 2,), jnp.bfloat16)
    out = {"read 268 MB (sum)": functools.partial(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x),
           "copy 268 MB": functools.partial(jax.jit(lambda x: x + 1), x)}
    for num_q in (1, 9):
        q, k, v, lengths, positions = decode_attention_inputs(1, num_q, 32, 4, 32768, 512, [32768],
                                                              dtype=jnp.bfloat16)
        attend = jax.jit(functools.partial(decode_attention, impl="pallas", scale=1.0))
        out[f"31B full layer, {num_q} rows, 268 MB"] = functools.partial(attend, q, k, v, lengths,
                                                                          q_positions=positions)
    return out


def main():
    thunks = calls()
    result = {}
    for kind, flush in (("write", write_flush), ("read", timing._l2_flush)):
        timing._l2_flush = flush
        times = timing.interleaved_gpu_times(thunks, repeats=9)
        result[kind] = {name: statistics.median(t) * 1e6 for name, t in times.items()}
        print(kind, json.dumps(result[kind], indent=1), flush=True)
    out = os.path.join(os.environ.get("OUT", "/tmp"), "l2_flush_read_vs_write.json")
    with open(out, "w") as f:
        json.dump(dict(notes="GPU us of one call (median of 9) after each flush kind, bf16", **result), f, indent=1)


if __name__ == "__main__":
    main()
