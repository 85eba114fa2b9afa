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
CELLS = [(1, 32768, 9), (1, 32768, 5), (1, 4096, 9), (8, 4096, 9)]  # batch, context, rows


def regions(trace_file):
    """``{(pid, tid): {name: (begin us, end us)}}`` from one Perfetto trace."""
    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    open_at, out = {}, collections.defaultdict(dict)
    for e in events:
        key = (e["pid"], e["tid"], e["name"])
        if e["ph"] == "B":
            open_at[key] = e["ts"]
        else:
            out[e["pid"], e["tid"]][e["name"]] = (open_at.pop(key), e["ts"])
    return out


def summary(trace_file):
    per_warpgroup = regions(trace_file)
    t0 = min(b for r in per_warpgroup.values() for b, _ in r.values())
    stats = {}
    for name in ("wait_q", "blocks", "write_out", "stream"):
        spans = [(r[name][0] - t0, r[name][1] - t0) for r in per_warpgroup.values() if name in r]
        if not spans:
            continue
        begins, ends = np.array([b for b, _ in spans]), np.array([e for _, e in spans])
        stats[name] = {"n": len(spans), "begin_kcycles": np.percentile(begins, [0, 50, 100]).round(2).tolist(),
                       "end_kcycles": np.percentile(ends, [0, 50, 100]).round(2).tolist(),
                       "duration_kcycles": np.percentile(ends - begins, [0, 50, 100]).round(2).tolist()}
    return stats


def main():
    out = Path(os.environ.get("OUT", "/tmp"))
    real_params = plgpu.CompilerParams
    result = {}
    for batch, context, num_q in CELLS:
        cell = f"b{batch}x{context}_q{num_q}"
        trace_dir = out / "traces" / cell
        trace_dir.mkdir(parents=True, exist_ok=True)
        plgpu.CompilerParams = functools.partial(real_params, profile_space=16, profile_dir=str(trace_dir))
        try:
            q, k, v, lengths, positions = decode_attention_inputs(
                batch, num_q, NUM_Q_HEADS, NUM_KV_HEADS, context, HEAD_DIM, [context] * batch, seed=0,
                dtype=jax.numpy.bfloat16)
            call = jax.jit(lambda q, k, v, lengths, positions: decode_attention_wide(
                q, k, v, lengths, q_positions=positions, scale=1.0))
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
