"""Few rows times a big weight matrix (decode / verify projections).

Shapes: x [M, K] (small M), w [K, N] -> [M, N] in x's dtype, fp32 accumulation.
Leading batch dims of x are flattened into M.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels._dispatch import check_impl


def skinny_matmul_reference(x, w):
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def skinny_matmul(x, w, *, impl="auto"):
    """Dispatcher: ``x @ w`` for x [..., K], w [K, N] -> [..., N]."""
    impl = check_impl(impl)
    if impl == "pallas":
        raise NotImplementedError("the Pallas skinny-matmul kernel is not implemented yet")
    return skinny_matmul_reference(x, w)
