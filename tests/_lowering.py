"""Lower a jitted function for CUDA on a CPU-only machine, against an abstract GPU device.

Runs the whole Pallas -> Triton-MLIR lowering against an abstract H100, so Pallas-level GPU
errors (power-of-two sizes, unsupported primitives, out-of-bounds ref slices) surface in CPU CI.
It does not run the Triton compiler or ptxas.
"""

from __future__ import annotations

import jax

H100_KIND = "NVIDIA H100 80GB HBM3"


def lower_for_cuda(fn, *args, device_kind: str = H100_KIND, num_cores: int = 132, **kwargs) -> str:
    """StableHLO text of ``jax.jit(fn)(*args, **kwargs)`` lowered for the ``cuda`` platform."""
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn, static_argnames=tuple(kwargs)).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def triton_kernel_count(text: str) -> int:
    """How many Pallas Triton custom calls the lowered module holds."""
    return text.count("__gpu$xla.gpu.triton")
