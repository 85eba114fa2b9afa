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

A model's choice is one :class:`Kernels` value (a default and per-kernel exceptions), parsed once
from the user's string: ``"auto,skinny_matmul=xla"`` runs every kernel on ``auto`` except the
matmul. Each dispatcher takes it (or that string) as ``impl`` and reads its own kernel's mode.
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS = ("auto", "pallas", "xla", "invariant")
KERNELS = ("add_rms_norm", "decode_attention", "gather_rows", "quantized_matmul", "rope_write", "skinny_matmul")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernel choice (static, hashable): ``default`` for every kernel, ``overrides`` as
    ``((kernel, mode), ...)`` in :data:`KERNELS` order. ``Kernels.parse`` reads the string form."""

    default: str = "auto"
    overrides: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.default not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, optionally followed by ',<kernel>=<choice>' "
                             f"overrides, got {str(self)!r}")
        names = [name for name, _ in self.overrides]
        for name, mode in self.overrides:
            if name not in KERNELS or mode not in IMPLS or names.count(name) > 1:
                raise ValueError(f"bad kernel override {name}={mode} in impl {str(self)!r}: expected one "
                                 f"'<kernel>=<choice>' per kernel, kernel in {KERNELS}, choice in {IMPLS}")
        object.__setattr__(self, "overrides", tuple(sorted(self.overrides, key=lambda o: KERNELS.index(o[0]))))

    @classmethod
    def parse(cls, impl: str | Kernels) -> Kernels:
        """``impl`` as a :class:`Kernels`; a string ``"<default>[,<kernel>=<mode>]..."``. Raises
        ``ValueError`` naming what is wrong."""
        if isinstance(impl, Kernels):
            return impl
        if not isinstance(impl, str):
            raise ValueError(f"impl must be a string such as 'auto' or 'auto,skinny_matmul=xla', got {impl!r}")
        default, *items = impl.split(",")
        overrides = []
        for item in items:
            name, sep, mode = item.partition("=")
            if not sep:
                raise ValueError(f"bad kernel override {item!r} in impl {impl!r}: expected '<kernel>=<choice>', "
                                 f"kernel in {KERNELS}, choice in {IMPLS}")
            overrides.append((name, mode))
        return cls(default, tuple(overrides))

    def mode(self, kernel: str) -> str:
        """The mode (one of :data:`IMPLS`) for ``kernel`` (one of :data:`KERNELS`)."""
        return dict(self.overrides).get(kernel, self.default)

    def __str__(self) -> str:
        return ",".join([self.default, *(f"{name}={mode}" for name, mode in self.overrides)])


def check_impl(impl: str | Kernels, kernel: str) -> str:
    """The mode (one of ``IMPLS``) that ``impl`` (a :class:`Kernels` or its string) sets for ``kernel``."""
    return Kernels.parse(impl).mode(kernel)


def on_gpu() -> bool:
    """True when the default backend is a GPU (the kernels' only compiled target)."""
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Pallas kernels run in the HLO interpreter everywhere but on a GPU."""
    return not on_gpu()


_WARMED_UP = False


def warm_up_interpret() -> None:
    """Run one trivial interpret-mode Pallas kernel, once per process.

    The first interpret-mode ``pallas_call`` in a process makes the next jitted call retrace once;
    doing it here, on a tiny kernel, keeps that cost off the kernels under test or benchmark.
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
