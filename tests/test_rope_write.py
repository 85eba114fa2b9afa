"""RoPE + cache write after the q/k/v projection: the kernel in interpret mode vs the reference.

The caches start NaN-poisoned past each sequence's length and filled before it: the kernel must
write exactly rows ``[length, length + T)`` of each KV head and leave every other row as it was.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rope_write import rope_write, rope_write_pallas, rope_write_reference

H, HKV, D, L = 4, 2, 16, 128  # lengths + rows stay within L, as callers guarantee


def _inputs(rows, dtype, lengths=(5, 40), head_dim=D, seed=0, k_eq_v=False):
    ks = jax.random.split(jax.random.key(seed), 3)
    batch = len(lengths)
    qkv = jax.random.normal(ks[0], (batch, rows, (H + (1 if k_eq_v else 2) * HKV) * head_dim)).astype(dtype)
    angles = jax.random.uniform(ks[1], (batch, rows, head_dim // 2), maxval=6.0)
    angles = jnp.concatenate([angles, angles], axis=-1)
    filled = jnp.arange(L)[None, None, :, None] < jnp.asarray(lengths)[:, None, None, None]
    caches = [jnp.where(filled, value, jnp.nan).astype(dtype) * jnp.ones((batch, HKV, L, head_dim), dtype)
              for value in (1.0, 2.0)]
    return qkv, jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype), *caches, jnp.asarray(lengths)


def _norms(dtype, head_dim=D):
    ks = jax.random.split(jax.random.key(7))
    return [(1 + 0.1 * jax.random.normal(k, (head_dim,))).astype(dtype) for k in ks]


def _check(got, want, dtype):
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-6
    for name, a, b in zip(("q", "k_buf", "v_buf"), got, want, strict=True):
        a32, b32 = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.isnan(a32), np.isnan(b32), err_msg=f"{name}: rows written where they must not be")
        np.testing.assert_allclose(np.nan_to_num(a32), np.nan_to_num(b32), rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 5, 70])  # decode, verify, a prefill of two T tiles
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qk-norm"])
def test_kernel_matches_reference_and_writes_only_the_new_rows(rows, norm, dtype):
    args = _inputs(rows, dtype)
    q_norm, k_norm = _norms(dtype) if norm else (None, None)
    kw = dict(num_heads=H, num_kv_heads=HKV, eps=1e-6)
    got = rope_write_pallas(*args, q_norm, k_norm, interpret=True, **kw)
    want = rope_write_reference(*args, q_norm=q_norm, k_norm=k_norm, **kw)
    _check(got, want, dtype)
    np.testing.assert_array_equal(np.asarray(got[2], np.float32), np.asarray(want[2], np.float32))  # v: copied


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows,head_dim", [(1, 16), (5, 512), (70, 32)])  # 512: Gemma 4's full layers, 16-row tiles
@pytest.mark.parametrize("k_eq_v", [False, True], ids=["v", "k_eq_v"])
def test_gemma4_norms_v_norm_and_k_eq_v(rows, head_dim, k_eq_v, dtype):
    """Gemma 4: q / k norms scaled in fp32 and cast last, v normed without a weight, and on full layers
    (``k_eq_v``) no v columns: V is the raw K, normed as v. Same rows written, nothing else."""
    args = _inputs(rows, dtype, head_dim=head_dim, k_eq_v=k_eq_v)
    q_norm, k_norm = _norms(dtype, head_dim)
    kw = dict(num_heads=H, num_kv_heads=HKV, eps=1e-6, norm="fp32_scale", v_norm=True, k_eq_v=k_eq_v)
    got = rope_write_pallas(*args, q_norm, k_norm, interpret=True, **kw)
    want = rope_write_reference(*args, q_norm=q_norm, k_norm=k_norm, **kw)
    _check(got, want, dtype)
    new_v = np.asarray(want[2][0, :, 5:5 + rows], np.float32)  # sequence 0's new rows: unit RMS over head_dim
    np.testing.assert_allclose(np.sqrt(np.mean(new_v ** 2, axis=-1)), 1.0, rtol=2e-2)


def test_options_are_checked():
    args = _inputs(2, jnp.float32)
    for bad, message in ((dict(norm="layer"), "norm must be"), (dict(v_norm=True), "v_norm")):
        for call in (lambda: rope_write_pallas(*args, num_heads=H, num_kv_heads=HKV, interpret=True, **bad),
                     lambda: rope_write(*args, num_heads=H, num_kv_heads=HKV, impl="xla", **bad)):
            with pytest.raises(ValueError, match=message):
                call()


def test_dispatcher():
    args = _inputs(3, jnp.bfloat16)
    kw = dict(num_heads=H, num_kv_heads=HKV)
    want = rope_write_reference(*args, **kw)
    for impl in ("auto", "xla", "invariant"):  # the reference, bitwise (auto: off a GPU)
        for a, b in zip(rope_write(*args, impl=impl, **kw), want, strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    q, _, _ = rope_write(*args, impl="pallas", **kw)
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(want[0], np.float32), rtol=2e-2, atol=2e-2)
    odd = _inputs(2, jnp.float32, head_dim=12)  # head_dim / 2 = 6: not a kernel shape, the reference
    for a, b in zip(rope_write(*odd, impl="pallas", **kw), rope_write_reference(*odd, **kw), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="head_dim"):
        rope_write_pallas(*odd, num_heads=H, num_kv_heads=HKV, interpret=True)
