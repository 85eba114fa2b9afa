"""The wide-head kernel's timeline per CTA from the Mosaic GPU profiler (named regions ``wait_q``,
``blocks``, ``write_out`` per consumer warpgroup, ``stream`` for the producer): when each CTA
starts, waits for q, streams and writes, in thousands of SM clock cycles from the first CTA's
first event (the profiler's clock), of the first call (the profiler writes one trace per program). Gemma 4 31B full
layers, bf16. H100: ``PYTHONPATH=. python benchmarks/probes/wide_head_timeline.py`` writes
``$OUT/timeline.json`` (and the raw Perfetto traces under ``$OUT/traces``).
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

from jspec.bench.kernel_check import decode_attention_inputs
from pallas_kernels.wide_head_decode import decode_attention_wide

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 512
# batch, context, rows, K/V ring slots (one chunk fewer than the default at 32-row blocks: the
# profiler's buffer takes shared memory)
CELLS = [(1, 8192, 9, 7), (1, 8192, 5, 7)]
PROFILE_SPACE = {None: 16}  # events per warpgroup: the per-block regions need room where the ring leaves it


def regions(trace_file):
    """``{(pid, tid): {name: [(begin, end), ...]}}`` from one Perfetto trace (a region inside the
    block loop occurs once per block)."""
    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    open_at, out = {}, collections.defaultdict(lambda: collections.defaultdict(list))
    for e in events:
        key = (e["pid"], e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"]
        else:
            out[e["pid"], e["tid"]][e["name"]].append((open_at.pop(key), e["ts"]))
    return out


def summary(trace_file):
    """Per region, over warpgroups [min, median, max]: its first begin and last end from the first
    event of the call, its time summed over occurrences, and its occurrences."""
    per_warpgroup = regions(trace_file)
    t0 = min(b for r in per_warpgroup.values() for spans in r.values() for b, _ in spans)
    names = sorted({name for r in per_warpgroup.values() for name in r})
    stats = {}
    for name in names:
        spans = [r[name] for r in per_warpgroup.values() if name in r]
        pct = lambda x: np.percentile(np.array(x), [0, 50, 100]).round(2).tolist()  # noqa: E731
        stats[name] = {"warpgroups": len(spans), "occurrences": pct([len(s) for s in spans]),
                       "begin_kcycles": pct([s[0][0] - t0 for s in spans]),
                       "end_kcycles": pct([s[-1][1] - t0 for s in spans]),
                       "total_kcycles": pct([sum(e - b for b, e in s) for s in spans])}
    return stats


def main():
    out = Path(os.environ.get("OUT", "/tmp"))
    real_params = plgpu.CompilerParams
    result = {}
    for batch, context, num_q, slots in CELLS:
        cell = f"b{batch}x{context}_q{num_q}" + (f"_slots{slots}" if slots else "")
        trace_dir = out / "traces" / cell
        trace_dir.mkdir(parents=True, exist_ok=True)
        space = PROFILE_SPACE.get(slots, 256)
        plgpu.CompilerParams = functools.partial(real_params, profile_space=space, profile_dir=str(trace_dir),
                                                 profile_bounds_check=True)
        try:
            q, k, v, lengths, positions = decode_attention_inputs(
                batch, num_q, NUM_Q_HEADS, NUM_KV_HEADS, context, HEAD_DIM, [context] * batch, seed=0,
                dtype=jax.numpy.bfloat16)
            call = jax.jit(lambda q, k, v, lengths, positions: decode_attention_wide(
                q, k, v, lengths, q_positions=positions, scale=1.0, slots=slots))
            for _ in range(4):
                jax.block_until_ready(call(q, k, v, lengths, positions))
        finally:
            plgpu.CompilerParams = real_params
        traces = sorted(trace_dir.rglob("*.json"), key=os.path.getmtime)
        result[cell] = summary(traces[-1]) if traces else "no trace written"
        print(cell, json.dumps(result[cell]), flush=True)
    (out / "timeline.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
