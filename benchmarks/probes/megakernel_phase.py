"""What one phase of a decode-step megakernel costs at SmolLM2's width: a dataflow hop plus a product.

``semaphore_hop.py`` times the bare hop (a slice stored, a semaphore signalled and waited on, a slice
loaded). A megakernel's phase also loads the whole input row and multiplies it by its weight tile
before it stores and signals. Here ``programs`` programs of one persistent Mosaic GPU launch chain
``phases`` products ``x_{i+1} = x_i @ W`` of SmolLM2-135M's hidden width (576 -> 576, an output
projection's shape): program ``p`` holds W's columns ``[64 p, 64 p + 64)`` in shared memory (loaded
once, as a megakernel would have streamed them in while it waited), and in each phase waits until
every program has stored its part of ``x_i``, loads the row by TMA (rows padded to 8, nine 64-wide
chunks), multiplies it on the tensor cores (WGMMA, an M tile of 64 rows), stores its 64 outputs by
TMA and signals. W is a permutation, so every phase's row is exact in bf16 and the chain is checked
against XLA's. GPU time at 1, 17, 33 and 65 phases gives a phase's cost as the slope (``us_per_link``); ``sync=False``
(one program 128 wide, no semaphores) is the product alone. Each form runs in a process of its own
(a wait never satisfied would hang the GPU: the synchronized form did not finish in its first run, on
an H200, undiagnosed). Without a GPU the probe lowers both for CUDA.
H200 / H100::

    PYTHONPATH=. python benchmarks/probes/megakernel_phase.py   # writes $OUT/megakernel_phase.json
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

HIDDEN = 576  # SmolLM2-135M
BLOCK = 64  # a program's output columns, and the K chunk of a swizzled tile (128 bytes of bf16)
ROWS = 8  # the decode row and its padding, as the x tile's TMA box
M_TILE = 64  # WGMMA's M
PHASES = (1, 17, 33, 65)


def phase_chain(x0, w, phases: int, *, sync: bool = True):
    """``[phases, ROWS, hidden]`` bf16: row ``i`` is ``x_{i+1} = x_i @ w`` from ``x0 [ROWS, hidden]``, with
    ``hidden // BLOCK`` programs (``sync``) or one program computing every column tile itself (a
    narrow ``hidden``: its weights must fit its shared memory)."""
    hidden = x0.shape[1]
    chunks = hidden // BLOCK
    programs = chunks if sync else 1
    tiles_each = chunks // programs
    swizzled = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))

    def kernel(x0_ref, w_ref, out_ref, x_smem, w_smem, o_smem, w_ready, x_ready, sems):
        pid = lax.axis_index("p")
        for t in range(tiles_each):  # the weights first: they never wait on anything
            cols = pl.ds((pid * tiles_each + t) * BLOCK, BLOCK)
            for c in range(chunks):
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(c * BLOCK, BLOCK), cols], w_smem.at[t, c],
                                        w_ready.at[t * chunks + c])
        for i in range(tiles_each * chunks):
            plgpu.barrier_wait(w_ready.at[i])

        def phase(i, src):
            for c in range(chunks):
                plgpu.copy_gmem_to_smem(src.at[:, pl.ds(c * BLOCK, BLOCK)], x_smem.at[c, pl.ds(0, ROWS)],
                                        x_ready.at[c])
            for c in range(chunks):
                plgpu.barrier_wait(x_ready.at[c])
            for t in range(tiles_each):
                def product(acc_ref, t=t):
                    for c in range(chunks):
                        plgpu.wgmma(acc_ref, x_smem.at[c], w_smem.at[t, c])

                acc = pl.run_state(product)(plgpu.ACC.init(
                    plgpu.layout_cast(jnp.zeros((M_TILE, BLOCK), jnp.float32), plgpu.Layout.WGMMA)))
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                cols = pl.ds((pid * tiles_each + t) * BLOCK, BLOCK)
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, ROWS)], out_ref.at[i, :, cols])
                plgpu.wait_smem_to_gmem(0)
            if sync:
                plgpu.semaphore_signal(sems.at[i], 1, memory_scope="gpu")
                plgpu.semaphore_wait(sems.at[i], programs, decrement=False, memory_scope="gpu")

        phase(0, x0_ref)

        @pl.loop(1, phases)
        def _(i):
            phase(i, out_ref.at[i - 1])

        if sync:  # the global semaphores back to zero once every program is past its last wait
            done = sems.at[phases]
            plgpu.semaphore_signal(done, 1, memory_scope="gpu")

            @pl.when(pid == 0)
            def _reset():
                plgpu.semaphore_wait(done, programs, memory_scope="gpu")
                for i in range(phases):
                    plgpu.semaphore_signal(sems.at[i], -programs, memory_scope="gpu")

    def body(x0_ref, w_ref, out_ref, *scratch):
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((phases + 1,))) if sync else None
        kernel(x0_ref, w_ref, out_ref, *scratch, sems)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((phases, ROWS, hidden), jnp.bfloat16), grid=(programs,),
        grid_names=("p",),
        scratch_types=(plgpu.SMEM((chunks, M_TILE, BLOCK), jnp.bfloat16, transforms=swizzled),
                       plgpu.SMEM((tiles_each, chunks, BLOCK, BLOCK), jnp.bfloat16, transforms=swizzled),
                       plgpu.SMEM((M_TILE, BLOCK), jnp.bfloat16),
                       plgpu.Barrier(num_barriers=tiles_each * chunks), plgpu.Barrier(num_barriers=chunks)),
    )(x0, w)


def inputs(hidden: int = HIDDEN, seed: int = 0):
    """x0 ``[ROWS, hidden]`` (row 0 random, the padding zero) and a permutation matrix W: exact chains."""
    x0 = jnp.zeros((ROWS, hidden), jnp.bfloat16).at[0].set(
        jax.random.normal(jax.random.key(seed), (hidden,), jnp.bfloat16))
    perm = (5 * np.arange(hidden) + 1) % hidden  # 5 is prime to 576 and 128
    w = jnp.asarray(np.eye(hidden, dtype=np.float32)[:, perm], jnp.bfloat16)
    return x0, w


def reference(x0, w, phases: int):
    def step(x, _):
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
        return x, x

    return lax.scan(step, x0, None, length=phases)[1]


def lower_for_cuda():
    """On a machine without a GPU: both forms lowered for CUDA (the interpreter runs neither the
    accumulating WGMMA nor global semaphores)."""
    for sync, hidden in ((False, 2 * BLOCK), (True, HIDDEN)):
        x0, w = inputs(hidden)
        for phases in (1, 65):
            jax.jit(functools.partial(phase_chain, phases=phases, sync=sync)).trace(x0, w).lower(
                lowering_platforms=("cuda",))
            print(f"sync={sync} hidden={hidden} phases={phases}: lowered for CUDA")


CELLS = {"product": (False, 2 * BLOCK), "phase": (True, HIDDEN)}


def cell(sync: bool, hidden: int) -> dict:
    """One form's checks and timings."""
    x0, w = inputs(hidden)
    calls, found = {}, {}
    for phases in PHASES:
        name = f"{phases} phases"
        try:
            call = jax.jit(functools.partial(phase_chain, phases=phases, sync=sync))
            got = call(x0, w)
            found[f"{name} exact"] = bool(jnp.array_equal(got, reference(x0, w, phases)))
        except Exception as e:  # noqa: BLE001 (an API this jax lacks is a result)
            found[name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        calls[name] = functools.partial(call, x0, w)
    if calls:
        found.update(per_link_us(calls))
    return found


def main():
    probe_main(__file__, CELLS, lambda key: cell(*CELLS[key]), lower_for_cuda=lower_for_cuda,
               out_name="megakernel_phase.json", timeout_s=150)


if __name__ == "__main__":
    main()
