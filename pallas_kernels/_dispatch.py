"""Choosing between a Pallas kernel and its XLA reference.

Every kernel module exposes one public dispatcher taking ``impl``:

* ``"xla"``    -- the plain-jnp reference (the ground truth in tests);
* ``"pallas"`` -- the Pallas kernel; on a machine without a GPU it runs with
  ``interpret=True`` so that CPU tests exercise the kernel body;
* ``"auto"``   -- the kernel on a GPU for the shapes where a recorded benchmark
  (``benchmarks/README.md``) shows it faster, the reference everywhere else;
* ``"invariant"`` -- row-invariant results: each row's output bitwise independent of the other
  rows and sequences computed with it (kernels with a pinned reduction order, for any number of
  rows; exact operations such as gathers take the reference). Like ``"pallas"``, interpreted on a
  machine without a GPU.

One ``impl`` string is threaded through the whole model, so a choice can also name
per-kernel exceptions after the default: ``"auto,skinny_matmul=xla"`` runs every kernel on
``auto`` except the matmul (how the benchmarks time a model with and without one kernel).
"""

from __future__ import annotations

import jax

IMPLS = ("auto", "pallas", "xla", "invariant")
KERNELS = ("add_rms_norm", "decode_attention", "gather_rows", "rope_write", "skinny_matmul")


def check_impl(impl: str, kernel: str) -> str:
    """The choice (one of ``IMPLS``) that ``impl`` makes for ``kernel`` (one of ``KERNELS``)."""
    default, *overrides = impl.split(",") if isinstance(impl, str) else [impl]
    choices = {}
    for item in overrides:
        name, _, choice = item.partition("=")
        if name not in KERNELS or choice not in IMPLS or name in choices:
            raise ValueError(f"bad kernel override {item!r} in impl {impl!r}: expected one "
                             f"'<kernel>=<choice>' per kernel, kernel in {KERNELS}, choice in {IMPLS}")
        choices[name] = choice
    if default not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, optionally followed by ',<kernel>=<choice>' "
                         f"overrides, got {impl!r}")
    return choices.get(kernel, default)


def on_gpu() -> bool:
    """True when the default backend is a GPU (the kernels' only compiled target)."""
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in the HLO interpreter everywhere but on a GPU."""
    return not on_gpu()


_WARMED_UP = False


def warm_up_interpret() -> None:
    """Run one trivial interpret-mode Pallas kernel, once per process.

    The first interpret-mode ``pallas_call`` in a process makes the next jitted call retrace once
    (JAX_PALLAS_NOTES.md §4.2); doing it here, on a tiny kernel, keeps that cost off the kernels
    under test or benchmark.
    """
    global _WARMED_UP
    if _WARMED_UP:
        return
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    fn = jax.jit(lambda x: pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x))
    for _ in range(2):
        fn(jnp.zeros((16,), jnp.float32)).block_until_ready()
    _WARMED_UP = True
