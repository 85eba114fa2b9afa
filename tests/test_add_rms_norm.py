"""The residual add + RMSNorm from a projection's split-K partials: the Pallas kernel (interpret
mode on CPU) against the reference, and the matmul's partials it reads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import skinny_matmul
from pallas_kernels.dispatch import warm_up_interpret
from pallas_kernels.norm.add_rms_norm import add_rms_norm, add_rms_norm_reference
from pallas_kernels.matmul.skinny_tilings import SkinnyConfig
from pallas_kernels.matmul.skinny_matmul import skinny_matmul_pallas, skinny_matmul_pallas_parts, skinny_matmul_parts


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    warm_up_interpret()


@functools.partial(jax.jit, static_argnames=("impl",))
def _run(x, parts, w, *, impl):
    return add_rms_norm(x, parts, w, 1e-5, impl=impl)


@pytest.mark.parametrize(
    "lead,hidden,splits,dtype,parts_dtype",
    [
        ((1, 1), 576, 16, jnp.bfloat16, jnp.float32),  # SmolLM2's hidden, 16 split-K partials
        ((2, 3), 96, 1, jnp.float32, jnp.float32),  # a finished product (no split-K), verify rows
        ((3, 1), 5000, 4, jnp.bfloat16, jnp.float32),  # two chunks, the last one partial
        ((1, 2), 64, 1, jnp.bfloat16, jnp.bfloat16),  # the product in x's dtype
    ],
)
def test_kernel_matches_reference(lead, hidden, splits, dtype, parts_dtype):
    rng = np.random.default_rng(hidden + splits)
    x = jnp.asarray(3 * rng.standard_normal((*lead, hidden)), dtype)
    parts = jnp.asarray(rng.standard_normal((splits, *lead, hidden)), parts_dtype)
    w = jnp.asarray(1 + rng.standard_normal(hidden), dtype)
    (x_new, normed), (x_ref, normed_ref) = _run(x, parts, w, impl="pallas"), _run(x, parts, w, impl="xla")
    assert x_new.shape == normed.shape == x.shape and x_new.dtype == normed.dtype == dtype
    # The sum over splits runs in another order in XLA: equal up to fp32 rounding before the cast.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=4e-2, rtol=1e-2)
    for got, want in ((x_new, x_ref), (normed, normed_ref)):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    if splits == 1:  # one term: no order to differ in, the same bits (the norm of a bf16 row may
        # still differ by an ulp: jitted XLA can skip the row's rounding to bf16 before the norm)
        np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))


@pytest.mark.parametrize("splits,dtype", [(8, jnp.bfloat16), (1, jnp.float32), (3, jnp.float32)])
def test_gemma4_form_matches_reference(splits, dtype):
    """Gemma 4: the product post-normed (``y_weight``) before the add, norms scaled in fp32."""
    rng = np.random.default_rng(splits)
    x = jnp.asarray(3 * rng.standard_normal((1, 2, 320)), dtype)
    parts = jnp.asarray(rng.standard_normal((splits, 1, 2, 320)), jnp.float32)
    w, y_w = (jnp.asarray(1 + 0.1 * rng.standard_normal(320), dtype) for _ in range(2))
    run = jax.jit(lambda x, p, w, y_w, impl: add_rms_norm(x, p, w, 1e-6, y_weight=y_w, norm="fp32_scale", impl=impl),
                  static_argnames="impl")
    got, want = run(x, parts, w, y_w, "pallas"), run(x, parts, w, y_w, "xla")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=4e-2, rtol=1e-2)
    for g, r in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), **tol)


def test_the_add_alone_without_a_weight():
    """``weight=None``: the (post-normed) product added to x, no norm after it."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((1, 1, 200)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((4, 1, 1, 200)), jnp.float32)
    y_w = jnp.asarray(1 + 0.1 * rng.standard_normal(200), jnp.float32)
    for impl in ("pallas", "xla"):
        x_new, normed = add_rms_norm(x, parts, None, 1e-6, y_weight=y_w, norm="fp32_scale", impl=impl)
        assert normed is None
        y = parts.sum(0)
        want = x + y * jax.lax.rsqrt(jnp.mean(y**2, axis=-1, keepdims=True) + 1e-6) * y_w
        np.testing.assert_allclose(np.asarray(x_new), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_weight", [True, False])
def test_a_scale_on_the_sum_before_the_norm(with_weight):
    """``scale [1]`` (Gemma 4's ``layer_scalar``): ``(x + y) * scale`` in x's dtype, then the norm
    (the next layer's input norm) of that."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(3 * rng.standard_normal((1, 1, 320)), jnp.bfloat16)
    parts = jnp.asarray(rng.standard_normal((1, 1, 1, 320)), jnp.bfloat16)  # a finished product
    w, y_w = (jnp.asarray(1 + 0.1 * rng.standard_normal(320), jnp.bfloat16) for _ in range(2))
    scale = jnp.asarray([0.37], jnp.bfloat16)
    weight = w if with_weight else None
    run = jax.jit(lambda x, p, s, impl: add_rms_norm(x, p, weight, 1e-6, y_weight=y_w, norm="fp32_scale", scale=s,
                                                     impl=impl), static_argnames="impl")
    (x_new, normed), (x_ref, normed_ref) = run(x, parts, scale, "pallas"), run(x, parts, scale, "xla")
    unscaled, _ = add_rms_norm_reference(x, parts, None, 1e-6, y_weight=y_w, norm="fp32_scale")
    np.testing.assert_array_equal(np.asarray(x_ref), np.asarray(unscaled * scale))
    np.testing.assert_array_equal(np.asarray(x_new), np.asarray(x_ref))  # one part: the same bits
    if with_weight:
        np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(normed_ref, np.float32),
                                   atol=4e-2, rtol=1e-2)
    else:
        assert normed is None and normed_ref is None


def test_reference_is_the_residual_add_then_the_norm():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 1, 8)), jnp.float32)
    parts = jnp.asarray(rng.standard_normal((3, 2, 1, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(8), jnp.float32)
    x_new, normed = add_rms_norm_reference(x, parts, w, 1e-6)
    want = x + parts.sum(0)
    np.testing.assert_allclose(np.asarray(x_new), np.asarray(want), rtol=1e-6)
    rms = jnp.sqrt(jnp.mean(want**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(normed), np.asarray(w * want / rms), rtol=1e-5)


@pytest.mark.parametrize("bad", ["parts_rank", "parts_shape", "weight", "scale"])
def test_mismatched_shapes_are_named(bad):
    x, parts, w = jnp.zeros((2, 1, 8)), jnp.zeros((3, 2, 1, 8)), jnp.zeros(8)
    parts = {"parts_rank": jnp.zeros((2, 1, 8)), "parts_shape": jnp.zeros((3, 2, 1, 9))}.get(bad, parts)
    w = jnp.zeros(9) if bad == "weight" else w
    scale = jnp.ones(8) if bad == "scale" else None
    with pytest.raises(ValueError, match="parts \\[splits, \\*x.shape\\], weight \\[hidden\\]"):
        add_rms_norm(x, parts, w, 1e-6, scale=scale, impl="pallas")
    with pytest.raises(ValueError, match="norm must be None"):
        add_rms_norm(jnp.zeros((2, 1, 8)), jnp.zeros((3, 2, 1, 8)), jnp.zeros(8), 1e-6, norm="gemma", impl="pallas")


@pytest.mark.parametrize("split_k", [1, 4])
def test_matmul_parts_sum_to_the_product(split_k):
    """``skinny_matmul_pallas_parts``: the kernel's split-K partials as they are; their sum, rounded
    to x's dtype, is what the matmul returns. Where no kernel runs the product is the one part."""
    rng = np.random.default_rng(split_k)
    x = jnp.asarray(rng.standard_normal((1, 2, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((256, 96)), jnp.float32)
    config = SkinnyConfig(block_n=32, block_k=32, split_k=split_k, num_warps=4, num_stages=2)
    parts = skinny_matmul_pallas_parts(x, w, config=config)
    assert parts.shape == (split_k, 1, 2, 96)
    assert parts.dtype == jnp.float32
    product = skinny_matmul_pallas(x, w, config=config)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(product), rtol=1e-6, atol=1e-5)
    reference = skinny_matmul_parts(x, w, impl="xla")  # no kernel: the product as one part
    np.testing.assert_array_equal(np.asarray(reference[0]), np.asarray(skinny_matmul(x, w, impl="xla")))
    assert reference.shape == (1, 1, 2, 96)


def test_auto_takes_the_kernel_for_partials_one_gather_holds():
    """On a GPU ``auto`` fuses where one program's gather holds a row's partials: any row at decode up
    to 32768 fp32 (Llama-3.2-1B's 16 x 2048, a tie there), half that at several rows, where 1B's
    16 x 2048 measured slower than XLA (benchmarks/add_rms_norm_kernel_h100.json)."""
    from pallas_kernels.norm.add_rms_norm import use_pallas

    assert use_pallas(1, 1, 576) and use_pallas(5, 4, 896) and use_pallas(1, 16, 2048) and use_pallas(1, 8, 2560)
    assert use_pallas(9, 8, 2048) and use_pallas(1, 4, 4096)
    assert not use_pallas(5, 16, 2048) and not use_pallas(1, 16, 4096) and not use_pallas(65, 1, 576)
