"""How a model runs: which kernels compute it and where its arrays live, one static value.

A model carries its :class:`Execution` as a static field (``model.execution``): the kernel choice
(:class:`pallas_kernels.dispatch.Kernels`, parsed once from the user's ``impl=`` string at the front
doors) and, for a model placed on a device mesh by ``jspec.shard``, its tensor-parallel placement.
Every function below the front doors reads it from the model; a drafter takes the target's kernels
in ``bind``, so one ``impl="invariant"`` makes target and drafter invariant.
"""

from __future__ import annotations

import dataclasses

from jspec.parallel import TensorParallel
from pallas_kernels.dispatch import Kernels

__all__ = ["Execution", "Kernels", "with_kernels"]


@dataclasses.dataclass(frozen=True)
class Execution:
    """The kernel choice and the placement of one model (static, hashable)."""

    kernels: Kernels = Kernels()
    placement: TensorParallel | None = None  # set by jspec.shard

    def mode(self, kernel: str) -> str:
        """The mode ``kernels`` sets for ``kernel`` (``pallas_kernels.dispatch.KERNELS``)."""
        return self.kernels.mode(kernel)

    @property
    def fuses(self) -> bool:
        """Whether the work around a kernel (the MLP's gate, RoPE and the cache write, the residual add
        before a norm) goes to that kernel's dispatcher, which fuses it where the kernel runs: a kernel
        mode that fuses (not ``invariant``, which keeps every op in its pinned form). A placed model runs
        the fused kernels per device (``jspec.parallel``)."""
        return self.mode("skinny_matmul") in ("auto", "pallas", "xla") and self.mode("gather_rows") != "invariant"

    def with_kernels(self, impl: str | Kernels) -> Execution:
        return dataclasses.replace(self, kernels=Kernels.parse(impl))


DEFAULT = Execution()


def with_placement(model, placement):
    """``model`` (anything with an ``execution`` field) computing under ``placement`` (a
    ``jspec.parallel.TensorParallel``, or None: one device); its kernels unchanged."""
    return dataclasses.replace(model, execution=dataclasses.replace(model.execution, placement=placement))


def with_kernels(model, impl: str | Kernels | None):
    """``model`` (anything with an ``execution`` field: a target, a draft model) running the kernels
    ``impl`` names; itself for None. Raises ``ValueError`` for a bad ``impl`` string."""
    if impl is None:
        return model
    return dataclasses.replace(model, execution=model.execution.with_kernels(impl))
