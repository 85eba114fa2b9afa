"""The EAGLE-3-shaped propose at 8B (k = 4, batch 1, context 512, bf16 random weights): its time
inside an on-device loop of proposes, with and without the loop's own iteration
(``jspec.bench.rounds.time_proposes_in_loop``, twice), those times' fractions of the copy bandwidth
for the bytes it reads, the kernels of one dispatched propose (the profiler's summary) and, with
``TIMELINE=1``, every kernel of a loop of four proposes in launch order (own GPU time,
``jspec.bench.timing.own_times``) beside the optimized HLO of one. ``COPIED=1``: the proposes run in
the eleventh session's loop instead (:func:`copied_loop`), which copies the draft cache every
iteration. Run from the tree to measure::

    PYTHONPATH=. TAG=main python benchmarks/probes/propose_in_loop.py   # writes $OUT/propose_in_loop_<TAG>.json
    PYTHONPATH=. TAG=copied COPIED=1 python benchmarks/probes/propose_in_loop.py

``ROLLED=1``: the head's draft scan rolled (the library unrolls it; ``scan_unroll.py``).
``DRAFTER``: ``mtp`` for the MTP head (no byte model: no fractions of copy). ``TARGET``: another
preset (``tiny`` to try the probe on a CPU; no profile there). The target keeps
``TARGET_LAYERS`` of its layers (default 2: the propose reads only its embedding table, and the
captured layers it was prefilled with come from those; fewer layers make and compile faster).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp

import jspec
from jspec.bench import decode
from jspec.bench.presets import GREEDY, PRESETS, confident
from jspec.bench.roofline import copy_bandwidth, propose_bytes
from jspec.bench.rounds import spec_state, stage_calls, time_proposes_in_loop
from jspec.bench.spec import make_drafter
from jspec.bench.timing import time_fn, timeline
from jspec.compile_options import LOOP_COMPILER_OPTIONS
from jspec.drafters import hidden_state
from jspec.drafters.base import RoundContext
from scan_unroll import force_scan_unroll

K, CONTEXT, CAPACITY = 4, 512, 1024
TIMELINE_PROPOSES = 4


def copied_loop(propose):
    """The eleventh session's loop of proposes (``propose`` returns the drafts): every iteration reads
    the draft state as a loop-invariant input through the barrier, so XLA copies the draft cache
    before the propose writes its rows into it, a copy generation never makes."""

    def run(drafter, draft_state, ctx, n):
        def body(i, total):
            state_i, ctx_i, _ = jax.lax.optimization_barrier((draft_state, ctx, i))
            return total + jnp.sum(propose(drafter, state_i, ctx_i))

        return jax.lax.fori_loop(0, n, body, jnp.int32(0))

    return jax.jit(run, compiler_options=LOOP_COMPILER_OPTIONS)


def main():
    out, tag = os.environ.get("OUT", "."), os.environ.get("TAG", "tree")
    if os.environ.get("ROLLED"):
        force_scan_unroll(hidden_state, 1)
    config = dataclasses.replace(PRESETS[os.environ.get("TARGET", "llama-3.1-8b")],
                                 num_layers=int(os.environ.get("TARGET_LAYERS", 2)))
    target = confident(jax.jit(jspec.init_params, static_argnums=(0, 2))(config, jax.random.key(0), jnp.bfloat16), 0)
    drafter = make_drafter(os.environ.get("DRAFTER", "eagle3"), target, draft=None, dtype=jnp.bfloat16, seed=0, impl="auto")
    state = spec_state(target, drafter, 1, CONTEXT, CAPACITY, "auto")
    calls, loops = stage_calls(target, drafter, state, K, impl="auto")
    if os.environ.get("COPIED"):
        ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
        copied = copied_loop(lambda d, ds, c: d.propose(ds, c, num_draft_tokens=K, params=GREEDY,
                                                            key=jax.random.key(0))[0])
        loops["propose"] = lambda n: copied(drafter, state.draft_state, ctx, jnp.int32(n))
    copy = copy_bandwidth(2 << 30)
    read = propose_bytes(drafter, K)
    runs = []
    for _ in range(2):
        seconds, _ = time_proposes_in_loop(loops, repeats=10)
        runs.append({name.removesuffix("_s") + "_ms": value * 1e3 for name, value in seconds.items()}
                    | dict(fraction_of_copy=read and read / seconds["propose_net_s"] / copy["bytes_per_s"],
                           fraction_of_copy_with_loop=read and read / seconds["propose_in_loop_s"] / copy["bytes_per_s"]))
    result = dict(tag=tag, k=K, context=CONTEXT, copy_tb_s=copy["tb_s"], propose_bytes=read, runs=runs,
                  propose_dispatched_ms=time_fn(calls["propose"], repeats=10).median_s * 1e3,
                  profile=decode.kernel_profile(calls["propose"]))
    if os.environ.get("TIMELINE"):
        result["timeline"] = timeline([lambda: loops["propose"](TIMELINE_PROPOSES)])
        ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
        propose = jax.jit(lambda d, ds, c: d.propose(ds, c, num_draft_tokens=K, params=GREEDY, key=jax.random.key(0)))
        with open(f"{out}/propose_hlo_{tag}.txt", "w") as f:
            f.write(propose.lower(drafter, state.draft_state, ctx).compile().as_text())
    with open(f"{out}/propose_in_loop_{tag}.json", "w") as f:
        json.dump(result, f, indent=1)
    print(tag, runs, result["profile"] and (result["profile"]["gpu_ms"], result["profile"]["kernels"]))


if __name__ == "__main__":
    main()
