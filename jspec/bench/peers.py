"""Peer kernels from tokamax (``pip install tokamax``), the maintained JAX kernel library, at our
kernels' shapes: its attention (``tokamax.dot_product_attention``, Mosaic GPU and Triton) beside
the decode-attention kernel, its grouped matmul (``tokamax.ragged_dot`` with one group: a plain
``x @ w``) beside the skinny matmul.

tokamax is optional: without it (or off a GPU, where it would run its XLA fallback) no peer is
offered and the benchmarks say so in their rows. Each peer gets its own layout, made outside the
timed region, as cuDNN does: attention takes ``[batch, seq, heads, head_dim]`` for q, K and V.
"""

from __future__ import annotations

import functools

ATTENTION = ("tokamax_mosaic", "tokamax_triton")
MATMUL = ("tokamax_triton", "tokamax_mosaic")


@functools.cache
def tokamax():
    """The tokamax module on a GPU, else None (not installed, or no GPU to run its kernels)."""
    import jax

    if jax.default_backend() != "gpu":
        return None
    try:
        import tokamax as module
    except ImportError:
        return None
    return module


def available(names) -> list[str]:
    """Those of ``names`` (:data:`ATTENTION` or :data:`MATMUL`) that tokamax runs here: none without
    tokamax or a GPU. tokamax registers a matmul implementation only where its own imports succeed
    (the Triton one needs ``jax_triton``, which needs Triton >= 3.7), which a tiny first call tells."""
    if tokamax() is None:
        return []
    return [name for name in names if _matmul_runs(name)] if tuple(names) == MATMUL else list(names)


@functools.cache
def _matmul_runs(name: str) -> bool:
    import jax
    import jax.numpy as jnp

    try:
        jax.block_until_ready(matmul(name)(jnp.ones((8, 128), jnp.bfloat16), jnp.ones((128, 128), jnp.bfloat16)))
    except Exception:  # noqa: BLE001 - not registered here ("Unknown implementation"), or e.g. jax_triton
        return False  # failing on an older Triton than it needs: either way no peer to time
    return True


def version() -> str | None:
    """tokamax's version (for a benchmark's environment block), None when it is not importable."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("tokamax")
    except PackageNotFoundError:
        return None


def attention(name: str):
    """``attend(q [B, T, N, H], k [B, S, K, H], v [B, S, K, H], kv_lengths [B]) -> [B, T, N, H]``:
    non-causal attention over each sequence's first ``kv_lengths`` rows (for T > 1 this skips the
    causal rule among the last T rows, as the cuDNN peer does; it reads the same bytes)."""
    implementation = name.removeprefix("tokamax_")

    def attend(q, k, v, kv_lengths):
        return tokamax().dot_product_attention(q, k, v, key_value_seq_lengths=kv_lengths,
                                               implementation=implementation)

    return attend


def matmul(name: str):
    """``x [M, K] @ w [K, N]`` as tokamax's grouped matmul with one group of all M rows."""
    import jax.numpy as jnp

    implementation = name.removeprefix("tokamax_")

    def product(x, w):
        group_sizes = jnp.array([x.shape[0]], jnp.int32)
        return tokamax().ragged_dot(x, w[None], group_sizes, implementation=implementation)

    return product
