"""Force the ``unroll`` of every ``jax.lax.scan`` one library module traces, to time a drafter's
draft scan rolled and unrolled from the same tree: the module alone sees a ``jax`` whose
``lax.scan`` overrides ``unroll``; every other module keeps the real one."""

from __future__ import annotations

import jax


def force_scan_unroll(module, unroll: bool | int) -> None:
    """Make ``module.jax.lax.scan`` pass ``unroll=unroll`` (``module`` must ``import jax``)."""

    class Lax:
        def __getattr__(self, name):
            return getattr(jax.lax, name)

        @staticmethod
        def scan(f, init, xs=None, length=None, **kwargs):
            return jax.lax.scan(f, init, xs, length, **(kwargs | dict(unroll=unroll)))

    class Jax:
        lax = Lax()

        def __getattr__(self, name):
            return getattr(jax, name)

    module.jax = Jax()
