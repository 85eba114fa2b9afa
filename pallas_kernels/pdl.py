"""Programmatic dependent launch (PDL) from inside a Pallas kernel: let the next kernel launch early.

On Hopper XLA compiles every kernel, the Pallas (Triton) calls included, with ``griddepcontrol.wait``
at its entry and launches it as a programmatic dependent of the kernel before it (jaxlib's defaults
``xla_gpu_enable_pdl`` / ``xla_gpu_enable_pdl_launch``; turning them off slows the small models'
decode loop). A kernel that never triggers
lets its dependent launch only as its blocks exit. Every Triton kernel here triggers at entry
(:func:`pallas_call`): the next kernel's launch and block scheduling then overlap this kernel's work,
while its wait still holds every read until this kernel has finished and its writes are visible (a
kernel launched without PDL, e.g. cuBLAS, waits in stream order as before). The trigger fires once
every program of the grid has started, so a grid larger than one wave cannot be crowded out by its
dependent.

In the on-device decode loop the trigger speeds up every model shape measured, the small,
launch-bound ones most (figures: ``benchmarks/README.md``, programmatic dependent launch); the
greedy tokens are bit-identical with and without (E4B with XLA's autotuner off, whose picks differ
between compiles).
"""

from __future__ import annotations

import functools

from jax._src import core as jax_core
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering
from jax._src.pallas.triton.primitives import barrier_effect
from jax.experimental import pallas as pl

# jax exposes Triton's inline assembly only as a pure op (dropped when its result is unused), so the
# trigger is a primitive of its own with an effect, lowered to the same op marked impure. It uses jax's
# private Pallas-Triton lowering modules (the same in jax 0.11.2 and 0.12; tests/test_pdl.py lowers
# every kernel with it under both).
launch_dependents_p = jax_core.Primitive("jspec_launch_dependents")
launch_dependents_p.multiple_results = True


@launch_dependents_p.def_effectful_abstract_eval
def _abstract_eval():
    return (), {barrier_effect}


@lowering.register_lowering(launch_dependents_p)
def _lowering(ctx):
    del ctx
    tt_dialect.elementwise_inline_asm([ir.IntegerType.get_signless(32)], "griddepcontrol.launch_dependents;\n\t"
                                      "mov.u32 $0, 0;", constraints="=r", pure=False, packed_element=1, args=[])
    return []


def launch_dependents() -> None:
    """``griddepcontrol.launch_dependents`` in every thread of the program (GPU lowering only)."""
    launch_dependents_p.bind()


def triggering(kernel, *, interpret: bool):
    """``kernel`` with :func:`launch_dependents` first; itself in the interpreter, which has no PDL."""
    if interpret:
        return kernel

    @functools.wraps(kernel)
    def body(*refs):
        launch_dependents()
        return kernel(*refs)

    return body


def pallas_call(kernel, *, interpret: bool, **kwargs):
    """``pl.pallas_call`` of ``kernel`` that triggers its dependents at entry on the GPU."""
    return pl.pallas_call(triggering(kernel, interpret=interpret), interpret=interpret, **kwargs)
