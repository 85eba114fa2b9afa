"""What one dataflow hop costs inside a persistent Mosaic GPU launch: the floor under a megakernel.

A megakernel that runs a decode step in one launch replaces every kernel boundary by a hop: the
programs that made a phase's output store their slices and signal a counter, the programs of the
next phase wait for the count and load what they need. At batch 1 a small model's phase moves so
few bytes that the hops are what its step costs (SmolLM2-135M: 5 a layer, 153 a step). The
Triton probe (``grid_barrier.py``) measured a grid barrier at 1.4-2.2 us on the H100; this one times
the same hop with Mosaic GPU's own means: each of ``programs`` programs, in each of ``phases``
phases, writes a 128-float slice (a TMA store from shared memory), signals the phase's GMEM
semaphore (GPU scope; a global one, reset to zero at the end), waits until all programs have
signalled it (no decrement: every program waits on the same count), loads its neighbour's slice by
TMA and adds one to it for the next phase. Every slice of row ``i`` must then hold ``i + 1``
(checked). GPU time at 1, 17, 33 and 65 phases gives a hop's cost as the slope (``us_per_link``;
``us_per_hop`` in the H200 file of 2026-11-28). Each grid size runs in a process of its own (a wait
never satisfied would hang the GPU). Without a GPU the probe lowers the kernel for CUDA. H200 / H100::

    PYTHONPATH=. python benchmarks/probes/semaphore_hop.py   # writes $OUT/semaphore_hop.json
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from persistent_chains import per_link_us, probe_main

SLICE = 128  # floats a program writes per phase
PROGRAMS = (1, 8, 66, 132)
PHASES = (1, 17, 33, 65)


def hop_chain(programs: int, phases: int):
    """``[phases, programs * SLICE]`` fp32: row ``i`` as the programs wrote it in phase ``i``."""

    def hops(vec_ref, out_smem, in_smem, loaded, sems):
        pid = lax.axis_index("p")
        neighbour = lax.rem(pid + 1, programs)
        in_smem[...] = jnp.zeros((SLICE,), jnp.float32)

        def phase(i, carry):
            out_smem[...] = in_smem[...] + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, vec_ref.at[i, pl.ds(pid * SLICE, SLICE)])
            plgpu.wait_smem_to_gmem(0)
            plgpu.semaphore_signal(sems.at[i], 1, memory_scope="gpu")
            plgpu.semaphore_wait(sems.at[i], programs, decrement=False, memory_scope="gpu")
            plgpu.copy_gmem_to_smem(vec_ref.at[i, pl.ds(neighbour * SLICE, SLICE)], in_smem, loaded)
            plgpu.barrier_wait(loaded)
            return carry

        lax.fori_loop(0, phases, phase, 0)

    def body(vec_ref, out_smem, in_smem, loaded):
        # Semaphores in scratch_types are one set per program; one set for the whole grid is a
        # global, which outlives the call: program 0 returns it to zero once every program is past
        # its last wait (a ``done`` count).
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((phases + 1,)))
        hops(vec_ref, out_smem, in_smem, loaded, sems)
        done = sems.at[phases]
        plgpu.semaphore_signal(done, 1, memory_scope="gpu")

        @pl.when(lax.axis_index("p") == 0)
        def _reset():
            plgpu.semaphore_wait(done, programs, memory_scope="gpu")  # decrements it back to zero
            for i in range(phases):
                plgpu.semaphore_signal(sems.at[i], -programs, memory_scope="gpu")

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((phases, programs * SLICE), jnp.float32), grid=(programs,),
        grid_names=("p",),
        scratch_types=(plgpu.SMEM((SLICE,), jnp.float32), plgpu.SMEM((SLICE,), jnp.float32),
                       plgpu.Barrier(num_barriers=1)),
    )()


def cell(programs: int) -> dict:
    """One grid size's checks and timings."""
    calls, found = {}, {}
    for phases in PHASES:
        name = f"{phases} phases"
        try:
            call = jax.jit(functools.partial(hop_chain, programs, phases))
            got = np.asarray(call())
        except Exception as e:  # noqa: BLE001 (an API this jax lacks is a result)
            found[name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        want = np.arange(1, phases + 1, dtype=np.float32)[:, None]
        found[f"{name} exact"] = bool((got == want).all())
        calls[name] = call
    if calls:
        found.update(per_link_us(calls))
    return found


def lower_for_cuda():
    """On a machine without a GPU: the kernel lowered for CUDA (the interpreter runs no global semaphores)."""
    for programs, phases in ((1, 1), (132, 65)):
        jax.jit(functools.partial(hop_chain, programs, phases)).trace().lower(lowering_platforms=("cuda",))
        print(f"programs={programs} phases={phases}: lowered for CUDA")


def main():
    probe_main(__file__, PROGRAMS, lambda key: cell(int(key)), lower_for_cuda=lower_for_cuda,
               out_name="semaphore_hop.json", timeout_s=90)


if __name__ == "__main__":
    main()
