"""Last-position slicing (+ fused RMSNorm): the Pallas kernel (interpret mode on CPU) vs the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gather_rows, gather_rows_reference
from pallas_kernels.dispatch import warm_up_interpret


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    warm_up_interpret()


@functools.partial(jax.jit, static_argnames=("impl",))
def _run(x, rows, w, *, impl):
    return gather_rows(x, rows, norm_weight=w, eps=1e-5, impl=impl)


@pytest.mark.parametrize(
    "batch,seq_len,hidden,n,dtype,norm",
    [
        (2, 7, 96, None, jnp.float32, True),  # rows [batch], hidden not a power of two
        (3, 5, 64, 2, jnp.bfloat16, True),  # rows [batch, n]
        (2, 9, 5000, 3, jnp.bfloat16, False),  # two chunks, the last one partial; plain gather
        (1, 4, 4096, None, jnp.bfloat16, True),
    ],
)
def test_kernel_matches_reference(batch, seq_len, hidden, n, dtype, norm):
    rng = np.random.default_rng(hidden + seq_len)
    x = jnp.asarray(3 * rng.standard_normal((batch, seq_len, hidden)), dtype)
    shape = (batch,) if n is None else (batch, n)
    rows = jnp.asarray(rng.integers(-seq_len, seq_len, size=shape), jnp.int32)
    rows = rows.at[0].set(seq_len - 1)  # the last row, its chunk tail at the very end of x
    w = jnp.asarray(1 + rng.standard_normal(hidden), dtype) if norm else None
    out = _run(x, rows, w, impl="pallas")
    ref = _run(x, rows, w, impl="xla")
    assert out.shape == shape + (hidden,) and out.dtype == dtype
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    if not norm:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_reference_semantics():
    x = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
    out = gather_rows_reference(x, jnp.array([-1, 1]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.stack([x[0, 3], x[1, 1]])))
    w = jnp.full((3,), 2.0)
    normed = gather_rows(x, jnp.array([[0, 3], [2, 2]]), norm_weight=w)  # auto -> reference on CPU
    row = x[0, 3]
    np.testing.assert_allclose(np.asarray(normed[0, 1]), np.asarray(2 * row / jnp.sqrt(jnp.mean(row**2) + 1e-6)), rtol=1e-6)
