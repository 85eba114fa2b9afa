"""One decode step of a model under several ``impl`` choices, one process, one set of weights: GPU
time of the step's kernels (interleaved, each call after an L2 flush), their count, the wall time
of the jitted step, and a warm call's kernels by name (count, GPU us; with an XLA dump,
``hlo_kernels.py`` names the source lines fused into each XLA kernel). The step programs compile
in parallel (a loop row of Gemma 4 E4B takes ~250 s to compile; its step alone, less). Batch 1,
bf16 random weights, a cache of ``--context`` rows. H100::

    PYTHONPATH=. python benchmarks/probes/step_impls.py gemma-4-e4b --impls auto auto,decode_attention=pallas
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp

from jspec import forward
from jspec.bench.decode import kernel_profile
from jspec.bench.presets import load_target
from jspec.bench.timing import compile_all, interleaved_gpu_times, time_fn
from jspec.engine import cache_length


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--impls", nargs="+", default=["auto", "auto,decode_attention=pallas"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    model = load_target(args.target, jnp.bfloat16)
    kv = model.init_cache(1, cache_length(args.context, args.context + 64)).advance(args.context)
    token = jnp.ones((1, 1), jnp.int32)
    lowered = {impl: jax.jit(functools.partial(forward, impl=impl)).lower(model, token, kv) for impl in args.impls}
    compiled = compile_all(lowered)
    calls = {impl: functools.partial(step, model, token, kv) for impl, step in compiled.items()}
    gpu = interleaved_gpu_times(calls, repeats=args.repeats)
    rows = {}
    for impl, call in calls.items():
        profile = kernel_profile(call, top=10**6)  # every kernel name of a warm call, as the decode benchmark's
        rows[impl] = dict(gpu_us=round(statistics.median(gpu[impl]) * 1e6, 1) if gpu[impl] else None,
                          kernels=profile and profile["kernels"],
                          wall_ms=round(time_fn(call, repeats=4 * args.repeats).median_s * 1e3, 4),
                          step_profile=profile)
        print(impl, {k: v for k, v in rows[impl].items() if k != "step_profile"}, flush=True)
    result = dict(device=jax.devices()[0].device_kind, target=args.target, context=args.context,
                  weights="random bf16", repeats=args.repeats, rows=rows)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "step_impls.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
