"""The add + RMSNorm kernel against XLA's composition (the reference under jit) at decode shapes,
interleaved in one trace (bf16, GPU time of one call's kernels after an L2 flush), with the gather
size and warps of ``VARIANTS`` beside the default and a control copy of it. With an earlier
version of the module beside this script (``old_add_rms_norm.py``) it is timed too. H100::

    git show ecd6422:pallas_kernels/add_rms_norm.py > benchmarks/probes/old_add_rms_norm.py   # optional
    PYTHONPATH=. python benchmarks/probes/add_rms_norm_kernel.py   # writes $OUT/add_rms_norm_kernel.json
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.timing import interleaved_gpu_times
from pallas_kernels.add_rms_norm import add_rms_norm_pallas, add_rms_norm_reference

# name: (rows, splits, hidden, Gemma 4 form): the output projections' split-K counts at batch 1
CELLS = {"smollm2 o": (1, 1, 576, False), "smollm2 down": (1, 4, 576, False), "1b o": (1, 16, 2048, False),
         "1b down": (1, 8, 2048, False), "8b o": (1, 1, 4096, False), "1b o, 5 rows": (5, 16, 2048, False),
         "e4b o": (1, 8, 2560, True), "e4b down, add only": (1, 16, 2560, True), "8b down": (1, 4, 4096, False),
         "e4b o full": (1, 16, 2560, True), "e4b layer end": (1, 1, 2560, True)}
# "add only": no norm after the add (weight=None); "layer end": Gemma 4's PLE branch product (bf16,
# one part) post-normed, added, times layer_scalar, then the next layer's input norm
# (tile, num_warps) beside the default (32768 fp32 a gather, warps by its size)
VARIANTS = ((8192, 16), (16384, 16), (32768, 16), (32768, 32), (65536, 32))


def _old_module():
    path = os.path.join(os.path.dirname(__file__), "old_add_rms_norm.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("old_add_rms_norm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    old = _old_module()
    rng = np.random.default_rng(0)
    result = {}
    only = os.environ.get("CELLS")  # comma-separated cell names, e.g. CELLS="e4b o full,e4b down, add only" is two
    cells = {n: c for n, c in CELLS.items() if only is None or n in only}
    for name, (rows, splits, hidden, gemma4) in cells.items():
        x = jnp.asarray(rng.standard_normal((1, rows, hidden)), jnp.bfloat16)
        layer_end = name.endswith("layer end")
        parts = jnp.asarray(rng.standard_normal((splits, 1, rows, hidden)), jnp.bfloat16 if layer_end else jnp.float32)
        w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.bfloat16)
        form = dict(y_weight=w, norm="fp32_scale") if gemma4 else {}
        if layer_end:
            form["scale"] = jnp.asarray([0.5], jnp.bfloat16)
        calls = {"kernel": jax.jit(functools.partial(add_rms_norm_pallas, eps=1e-6, **form)),
                 "xla": jax.jit(functools.partial(add_rms_norm_reference, eps=1e-6, **form))}
        if old is not None and not gemma4:
            calls["old_kernel"] = jax.jit(functools.partial(old.add_rms_norm_pallas, eps=1e-6))
        for tile, warps in VARIANTS:
            calls[f"kernel_t{tile}_w{warps}"] = jax.jit(functools.partial(add_rms_norm_pallas, eps=1e-6, tile=tile,
                                                                          num_warps=warps, **form))
        calls["kernel2"] = calls["kernel"]  # a control
        weight = None if name.endswith("add only") else w
        thunks = {n: functools.partial(f, x, parts, weight) for n, f in calls.items()}
        times = interleaved_gpu_times(thunks, repeats=9)
        cell = result[name] = {n: round(statistics.median(t) * 1e6, 2) if t else None for n, t in times.items()}
        got, want = thunks["kernel"](), thunks["xla"]()
        cell["max_abs_err"] = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
                                  for g, r in zip(got, want) if g is not None)
        print(name, cell, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "add_rms_norm_kernel.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
