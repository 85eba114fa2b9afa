"""What a grid-wide barrier costs inside one Pallas (Triton) launch: the building block of a
persistent kernel that runs a whole decoder layer in one launch (issue 21: a layer's phases, norm,
q/k/v + RoPE, attention, o + residual, gate/up, down, separated by barriers instead of launches).

Each of ``programs`` programs runs ``barriers`` phases. In phase i it writes a value into its own
slot of that phase's parity, arrives at an atomic counter (acquire-release, GPU scope) and spins until every program has
arrived ``i + 1`` times, then reads its neighbour's slot (volatile: past L1) and checks it saw the
neighbour's phase-i value. The spin is bounded, so programs that are not all resident at once
(more than a wave) fail the check instead of hanging. GPU time for 1, 33 and 65 barriers at each
grid size gives the cost of one barrier (the slope). (The H100 run in
``benchmarks/grid_barrier_h100.json`` had one slot a program, so a neighbour already past the
barrier could overwrite its value before it was read: its misses at 8+ programs are that race.) H100::

    PYTHONPATH=. python benchmarks/probes/grid_barrier.py   # writes $OUT/grid_barrier.json
"""

from __future__ import annotations

import functools
import json
import os
import statistics

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jspec.bench.timing import interleaved_gpu_times

_MAX_SPINS = 1 << 20  # ~ms of spinning: a barrier that never completes gives up instead of hanging


def _kernel(counter_in, slots_ref, seen_ref, counter_ref, *, barriers, programs, max_spins, interpret):
    del counter_in  # aliased to counter_ref: zero on entry
    pid = pl.program_id(0)
    neighbour = lax.rem(pid + 1, programs)

    def phase(i, good):
        # Two slots a program, by phase parity: a neighbour past this barrier may write its next
        # phase's value before this program reads, but cannot pass the next barrier without it.
        slot = lax.rem(i, 2) * programs
        plgpu.store(slots_ref.at[slot + pid], i * programs + pid)
        if not interpret:  # every thread's stores are issued before the count goes up
            plgpu.debug_barrier()
        zero = i * 0  # the counter's index and a no-op add, carried: the interpreter takes no loop constants
        plgpu.atomic_add(counter_ref, zero, zero + 1)

        def waiting(state):
            count, spins, target, _ = state
            return (count < target) & (spins < max_spins)

        def spin(state):
            _, spins, target, zero = state
            return plgpu.atomic_add(counter_ref, zero, zero), spins + 1, target, zero

        lax.while_loop(waiting, spin, (zero, zero, (i + 1) * programs, zero))
        seen = plgpu.load(slots_ref.at[slot + neighbour], volatile=True)
        return good + (seen == i * programs + neighbour).astype(jnp.int32)

    plgpu.store(seen_ref.at[pid], lax.fori_loop(0, barriers, phase, jnp.int32(0)))


@functools.partial(jax.jit, static_argnames=("barriers", "programs", "max_spins", "interpret"))
def phases(*, barriers: int, programs: int, max_spins: int = _MAX_SPINS, interpret: bool = False):
    """``[programs]`` int32: how many of its ``barriers`` phases each program saw its neighbour's
    write of that phase (all of them where the barrier holds)."""
    kernel = functools.partial(_kernel, barriers=barriers, programs=programs, max_spins=max_spins,
                               interpret=interpret)
    # The neighbour's slot is re-read past L1 each phase; the slots output is scratch.
    _, seen, _ = pl.pallas_call(
        kernel,
        grid=(programs,),
        in_specs=[pl.BlockSpec((1,), lambda p: (0,))],
        out_specs=[pl.BlockSpec((2 * programs,), lambda p: (0,)), pl.BlockSpec((programs,), lambda p: (0,)),
                   pl.BlockSpec((1,), lambda p: (0,))],
        out_shape=[jax.ShapeDtypeStruct((2 * programs,), jnp.int32), jax.ShapeDtypeStruct((programs,), jnp.int32),
                   jax.ShapeDtypeStruct((1,), jnp.int32)],
        input_output_aliases={0: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="grid_barrier",
    )(jnp.zeros((1,), jnp.int32))
    return seen


def main():
    result = {}
    for programs in (1, 8, 66, 132, 264):
        counts = (1, 33, 65)
        calls = {b: functools.partial(phases, barriers=b, programs=programs) for b in counts}
        seen = {b: int(jnp.sum(calls[b]() == b)) for b in counts}
        times = interleaved_gpu_times(calls, repeats=9)
        us = {b: statistics.median(times[b]) * 1e6 for b in counts}
        per_barrier = (us[65] - us[1]) / 64
        result[programs] = dict(us=us, us_per_barrier=round(per_barrier, 3),
                                programs_that_saw_every_phase=seen)
        print(programs, result[programs], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "grid_barrier.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
