"""Choosing between a Pallas kernel and its XLA reference.

Every kernel module exposes one public dispatcher taking ``impl``:

* ``"xla"``    -- the plain-jnp reference (the ground truth in tests);
* ``"pallas"`` -- the Pallas kernel; on a machine without a GPU it runs with
  ``interpret=True`` so that CPU tests exercise the kernel body;
* ``"auto"``   -- the kernel on a GPU for the shapes where a recorded benchmark
  (``benchmarks/``) shows it faster, the reference everywhere else.
"""

from __future__ import annotations

import jax

IMPLS = ("auto", "pallas", "xla")


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def on_gpu() -> bool:
    """True when the default backend is a GPU (the kernels' only compiled target)."""
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in the HLO interpreter everywhere but on a GPU."""
    return not on_gpu()
