"""The flash-decoding kernel at small models' decode shapes: the one-wave tiling (one 64-row block
per program, ``pallas_kernels.decode_tiling._one_wave``) against the tiling before it, with a second
copy of the default as a control, the split merge in the kernel and in a second kernel, and
cuDNN beside them, interleaved in one trace (bf16, batch 1,
GPU time of one call's kernels after an L2 flush). H100::

    PYTHONPATH=. python benchmarks/probes/decode_attention_small.py   # writes $OUT/decode_attention_small.json

``LOOP_CACHE=1`` times the decode loop's own shape instead (a 640-row cache, 544 rows valid: the
middle of a 64-step loop from 512; one query row) with fewer, longer programs: one per KV head
(``k_splits=1``) reading 64-256-row blocks, or 2-4 splits merged in the kernel, none of which needs
the combine launch (writes ``$OUT/decode_attention_loop_cache.json``).
"""

from __future__ import annotations

import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp

from jspec.bench.kernel_check import decode_attention_inputs
from jspec.bench.timing import interleaved_gpu_times
from pallas_kernels import decode_tiling
from pallas_kernels.decode_attention import decode_attention_pallas, decode_attention_reference

HEADS = {"smollm2-135m": (9, 3, 64), "llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}
CELLS = [("smollm2-135m", c, q) for c in (512, 1024, 2048, 4096) for q in (1, 5)]
CELLS += [(name, c, 1) for name in ("llama-3.2-1b", "llama-3.1-8b") for c in (512, 1024, 2048)]
KNOBS = ("block_m", "block_k", "k_splits", "merge_in_kernel", "num_warps", "num_stages")


def tiling_before(num_q, hq, hkv, context, head_dim):
    """The tiling of the rule without the one-wave case."""
    saved, decode_tiling._ONE_WAVE_PROGRAMS = decode_tiling._ONE_WAVE_PROGRAMS, 0
    try:
        return {k: v for k, v in decode_tiling.tiling(1, num_q, hq, hkv, context, head_dim).items() if k in KNOBS}
    finally:
        decode_tiling._ONE_WAVE_PROGRAMS = saved


# (name, knobs) of the LOOP_CACHE variants; a tiling that fails to launch is recorded as such.
LOOP_VARIANTS = [("default", {}), ("default2", {})]
LOOP_VARIANTS += [(f"k1_b{bk}_s{st}_w{w}", dict(k_splits=1, block_k=bk, num_stages=st, num_warps=w))
                  for bk in (64, 128, 256) for st in (2, 3) for w in (4, 8)]
LOOP_VARIANTS += [(f"k{ks}_b{bk}_merged", dict(k_splits=ks, block_k=bk, merge_in_kernel=True))
                  for ks in (2, 4) for bk in (64, 128)]


LOOP_LENGTH = 544  # the middle of a 64-step loop from 512, in its 640-row cache


def pallas_call(inputs, **knobs):
    """A jitted flash-decoding call with these knobs, bound to ``inputs`` (q, k, v, lengths, positions)."""
    call = jax.jit(lambda q, k, v, n, p: decode_attention_pallas(q, k, v, n, q_positions=p, **knobs))
    return functools.partial(call, *inputs)


def loop_cache():
    result = {}
    for name, (hq, hkv, head_dim) in HEADS.items():
        inputs = decode_attention_inputs(1, 1, hq, hkv, 640, head_dim, [LOOP_LENGTH], seed=0, dtype=jnp.bfloat16)
        q, k, v, lengths, positions = inputs
        want = decode_attention_reference(q, k, v, lengths, q_positions=positions).astype(jnp.float32)
        calls, cell = {}, {"errors": {}}  # per variant: max abs error, or why it did not launch
        for variant, knobs in LOOP_VARIANTS:
            call = pallas_call(inputs, **knobs)
            try:
                got = call().astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 (a tiling that does not launch is a result)
                cell["errors"][variant] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            cell["errors"][variant] = float(jnp.max(jnp.abs(got - want)))
            calls[variant] = call
        times = interleaved_gpu_times(calls, repeats=9)
        cell.update({n: round(statistics.median(t) * 1e6, 2) for n, t in times.items()})
        cell["default_tiling"] = {k: v for k, v in decode_tiling.tiling(1, 1, hq, hkv, 640, head_dim).items()
                                  if k in KNOBS}
        result[f"{name} q1 x 640 ({LOOP_LENGTH} valid)"] = cell
        print(name, {n: cell[n] for n in times}, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_attention_loop_cache.json"), "w") as f:
        json.dump(result, f, indent=1)


def main():
    if os.environ.get("LOOP_CACHE"):
        return loop_cache()
    result = {}
    for name, context, num_q in CELLS:
        hq, hkv, head_dim = HEADS[name]
        inputs = decode_attention_inputs(1, num_q, hq, hkv, context, head_dim, [context], seed=0, dtype=jnp.bfloat16)
        q, k, v, lengths, positions = inputs
        pallas = functools.partial(pallas_call, inputs)

        before = tiling_before(num_q, hq, hkv, context, head_dim)
        cudnn = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=n,
                                                                        implementation="cudnn"))
        calls = {"default": pallas(), "before": pallas(**before), "default2": pallas(),
                 "merge_in_kernel": pallas(merge_in_kernel=True), "combine_kernel": pallas(merge_in_kernel=False),
                 "cudnn": functools.partial(cudnn, q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths)}
        times = interleaved_gpu_times(calls, repeats=9)
        cell = {n: round(statistics.median(t) * 1e6, 2) for n, t in times.items()}
        cell["tiling"] = {k: v for k, v in decode_tiling.tiling(1, num_q, hq, hkv, context, head_dim).items()
                          if k in KNOBS}
        cell["tiling_before"] = before
        want = decode_attention_reference(q, k, v, lengths, q_positions=positions).astype(jnp.float32)
        cell["max_abs_err"] = float(jnp.max(jnp.abs(calls["default"]().astype(jnp.float32) - want)))
        result[f"{name} q{num_q} x {context}"] = cell
        print(f"{name} q{num_q} x {context}", cell, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_attention_small.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
