"""The wide-head kernel of an earlier commit against the current one, interleaved in one trace
with a second copy of each as a control (Gemma 4 31B full layers, bf16, GPU time after an L2
flush). H100, with the earlier module next to this script::

    git show 09a1e71:pallas_kernels/wide_head_decode.py > benchmarks/probes/old_wide.py
    PYTHONPATH=. python benchmarks/probes/wide_head_old_vs_new.py   # writes $OUT/old_vs_new.json
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from jspec.bench.kernel_check import decode_attention_inputs
from jspec.bench.timing import interleaved_gpu_times
from pallas_kernels.decode_attention import decode_attention_reference
from pallas_kernels.wide_head_decode import decode_attention_wide

CELLS = [(32, 131072, 9), (1, 32768, 9), (32, 32768, 9), (1, 32768, 5)]  # batch, context, rows


def main():
    sys.path.insert(0, os.path.dirname(__file__))
    import old_wide

    result = {}
    for batch, context, num_q in CELLS:
        inputs = decode_attention_inputs(batch, num_q, 32, 4, context, 512, [context] * batch, seed=0,
                                         dtype=jnp.bfloat16)

        def timed(kernel, **kernel_kw):
            call = jax.jit(lambda q, k, v, lengths, positions: kernel(q, k, v, lengths, q_positions=positions,
                                                                      scale=1.0, **kernel_kw))
            return functools.partial(call, *inputs)

        calls = {"new": timed(decode_attention_wide), "old": timed(old_wide.decode_attention_wide),
                 "new2": timed(decode_attention_wide), "old2": timed(old_wide.decode_attention_wide),
                 "new_no_share": timed(decode_attention_wide, share_scores=False)}
        times = interleaved_gpu_times(calls, repeats=5 if batch * context > 1 << 22 else 9)
        cell = result[f"b{batch}x{context}_q{num_q}"] = {name: round(statistics.median(t) * 1e6, 1)
                                                         for name, t in times.items()}
        if batch * context <= 1 << 20:  # the reference's fp32 intermediates fit
            q, k, v, lengths, positions = inputs
            want = decode_attention_reference(q, k, v, lengths, q_positions=positions, scale=1.0).astype(jnp.float32)
            for name in ("new", "old"):
                got = calls[name]().astype(jnp.float32)
                cell[f"{name}_max_abs_err"] = float(jnp.max(jnp.abs(got - want)))
                cell[f"{name}_finite"] = bool(jnp.isfinite(got).all())
        print(result, flush=True)
        del inputs
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "old_vs_new.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
