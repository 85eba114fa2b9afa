"""Skinny matmul (few rows x big weights): the Pallas kernel in interpret mode vs the reference.

Interpret mode pads inputs to whole blocks with NaN and starts outputs as NaN, so a finite
result equal to the reference means every output element was written and no padded input
reached the dot unmasked.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import skinny_matmul, skinny_matmul_reference

sm = importlib.import_module("pallas_kernels.matmul.skinny_matmul")  # the module (the package exports the fn)
SkinnyConfig = sm.SkinnyConfig

# K, N are not multiples of the blocks; split-K leaves a ragged last split.
K, N = 200, 150
CFG = SkinnyConfig(block_n=64, block_k=64, split_k=2, num_warps=4, num_stages=3)


def _inputs(m, k, n, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    return x, w


def _check(out, x, w):
    ref = skinny_matmul_reference(x, w)
    assert out.shape == ref.shape and out.dtype == x.dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all(), "unwritten (NaN-poisoned) or NaN-contaminated output"
    if x.dtype == jnp.bfloat16:
        # fp32 accumulation in both; only the summation order differs -> <= 1 bf16 ulp
        np.testing.assert_allclose(out32, np.asarray(ref.astype(jnp.float32)), rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_allclose(out32, np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m", [1, 3, 5, 8, 17, 64])
def test_kernel_matches_reference(m, dtype):
    x, w = _inputs(m, K, N, dtype, seed=m)
    _check(sm.skinny_matmul_pallas(x, w, config=CFG, interpret=True), x, w)


@pytest.mark.parametrize(
    "m,k,n,cfg",
    [
        (4, 256, 128, SkinnyConfig(block_n=64, block_k=64, split_k=4)),  # aligned: no masks at all
        (1, 300, 40, SkinnyConfig(block_n=64, block_k=128, split_k=8)),  # splits beyond K dropped
        (16, 70, 33, None),  # default config: no split, blocks bigger than K and N
    ],
)
def test_kernel_tilings(m, k, n, cfg):
    x, w = _inputs(m, k, n, jnp.bfloat16, seed=k)
    _check(sm.skinny_matmul_pallas(x, w, config=cfg, interpret=True), x, w)


@pytest.mark.parametrize("m,k,n,cfg", [(1, 256, 128, SkinnyConfig(block_n=64, block_k=64, split_k=2)),
                                       (5, 300, 40, None)])  # aligned; masks on K and N
def test_kernel_reads_a_weight_stored_n_by_k(m, k, n, cfg):
    x, w = _inputs(m, k, n, jnp.bfloat16, seed=k)
    _check(sm.skinny_matmul_pallas(x, w.T, config=cfg, interpret=True, w_transposed=True), x, w)
    np.testing.assert_array_equal(np.asarray(skinny_matmul(x, w.T, impl="xla", w_transposed=True)),
                                  np.asarray(skinny_matmul(x, w, impl="xla")))


def test_dispatcher_pallas_flattens_leading_dims():
    x, w = _inputs(6, K, N, jnp.bfloat16)
    x3 = x.reshape(2, 3, K)
    out = skinny_matmul(x3, w, impl="pallas")  # interpret mode off-GPU
    assert out.shape == (2, 3, N)
    _check(out.reshape(6, N), x, w)


def test_dispatcher_pallas_leaves_a_prefill_to_the_reference():
    """More rows than the kernel takes (a whole model's prefill under impl="pallas") are no skinny
    product: the reference, bitwise, instead of an error half-way through a forward."""
    x, w = _inputs(sm.MAX_M + 36, K, N, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(skinny_matmul(x, w, impl="pallas")),
                                  np.asarray(skinny_matmul_reference(x, w)))


def test_dispatcher_auto_and_xla_are_the_reference_on_cpu():
    x, w = _inputs(4, K, N, jnp.bfloat16)
    ref = skinny_matmul_reference(x, w)
    for impl in ("auto", "xla"):
        np.testing.assert_array_equal(np.asarray(skinny_matmul(x, w, impl=impl)), np.asarray(ref))
    big = jnp.ones((100, K), jnp.bfloat16)  # prefill-sized M: auto is the reference
    assert skinny_matmul(big, w).shape == (100, N)
    with pytest.raises(ValueError):
        skinny_matmul(x, w, impl="triton")


def test_auto_rule():
    bf = jnp.bfloat16
    # Swept shapes follow the recorded sweep per M bucket ...
    assert sm._auto_uses_pallas(1, 4096, 14336, bf, bf)
    assert sm._auto_uses_pallas(2, 4096, 28672, bf, bf)
    assert not sm._auto_uses_pallas(5, 4096, 28672, bf, bf)  # the 8B gate_up at k = 4 verify: XLA
    assert sm._auto_uses_pallas(16, 2048, 3072, bf, bf)
    assert not sm._auto_uses_pallas(1, 4096, 128256, bf, bf)  # 8B LM head: a tie, keep XLA
    assert not sm._auto_uses_pallas(32, 4096, 14336, bf, bf)
    # ... other shapes use the kernel for one row only (not the LM head).
    assert sm._auto_uses_pallas(1, 5120, 8192, bf, bf)
    assert not sm._auto_uses_pallas(2, 5120, 8192, bf, bf)
    assert not sm._auto_uses_pallas(1, 5120, 152064, bf, bf)
    assert not sm._auto_uses_pallas(1, 4096, 4096, jnp.float32, jnp.float32)
    # Small models' projections at one row, K or N under 1024 (SmolLM2-135M, Qwen2.5-0.5B, the Gemma 4
    # assistant's hidden size 256), from 256 x 256 up.
    assert sm._auto_uses_pallas(1, 576, 960, bf, bf)
    assert sm._auto_uses_pallas(1, 1536, 576, bf, bf)
    assert sm._auto_uses_pallas(1, 896, 2 * 4864, bf, bf)
    assert not sm._auto_uses_pallas(5, 576, 960, bf, bf)
    assert sm._auto_uses_pallas(1, 256, 256, bf, bf) and sm._auto_uses_pallas(1, 256, 2 * 2048, bf, bf)
    assert sm._auto_uses_pallas(1, 2048, 256, bf, bf) and sm._auto_uses_pallas(1, 5120, 256, bf, bf)
    assert not sm._auto_uses_pallas(1, 128, 256, bf, bf) and not sm._auto_uses_pallas(1, 256, 192, bf, bf)
    # Gemma 4 E4B's per-layer-input gate and projection: measured, so the kernel at one row, XLA beyond
    assert sm._auto_uses_pallas(1, 2560, 256, bf, bf) and sm._auto_uses_pallas(1, 256, 2560, bf, bf)
    assert not sm._auto_uses_pallas(5, 2560, 256, bf, bf)
    assert not sm._auto_uses_pallas(128, 4096, 4096, bf, bf)


def test_tuned_tilings_are_valid():
    for (k, n), buckets in sm._TUNED.items():
        for bucket, (tiling, _) in buckets.items():
            c = sm.default_config(bucket, k, n)
            assert c == sm.SkinnyConfig(*tiling)
            assert -(-k // c.split_k) >= c.block_k


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("k,n", [(4096, 4096), (4096, 14336), (2048, 3072), (8192, 2048), (4096, 128256), (5120, 8192)])
def test_default_config_is_valid(m, k, n):
    c = sm.default_config(m, k, n)
    for b in (c.block_n, c.block_k):
        assert b >= 16 and b & (b - 1) == 0
    assert c.split_k >= 1 and -(-k // c.split_k) >= c.block_k  # every split has >= 1 K step


def test_one_row_over_a_short_k_takes_one_split_of_narrow_tiles():
    """No split-K sum (a launch of its own) where the whole matmul takes a few microseconds."""
    assert sm.default_config(1, 576, 960) == sm.SkinnyConfig(block_n=32, block_k=128, split_k=1)
    assert sm.default_config(5, 576, 960).split_k > 1  # verify rows: the rule, as XLA's dot runs them under auto
    assert sm.default_config(1, 576, 960, itemsize=4).split_k > 1
    assert sm.default_config(1, 2048, 2048) == sm.SkinnyConfig(*sm._TUNED[(2048, 2048)][1][0])


# ragged K steps; N not a multiple of 32; the Gemma 4 assistant's o (1024 -> 256) and pre-projection (5120 -> 256)
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (2, 896, 130), (1, 1024, 256), (1, 5120, 256)])
def test_kernel_default_tilings_of_small_one_row_projections(m, k, n):
    x, w = _inputs(m, k, n, jnp.bfloat16, seed=k)
    _check(sm.skinny_matmul_pallas(x, w, interpret=True), x, w)


# --- the gated epilogue ----------------------------------------------------------------------

def _check_gated(out, x, w, gated="silu"):
    ref = skinny_matmul_reference(x, w, gated=gated)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32, ref32 = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
    assert np.isfinite(out32).all(), "unwritten (NaN-poisoned) or NaN-contaminated output"
    # bf16: the gate's rounding may differ by one ulp of the output
    tol = 2e-2 if x.dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out32, ref32, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m,k,n,gated", [(1, 200, 256, "silu"), (5, 256, 128, "silu"), (17, 300, 192, "silu"),
                                         (1, 200, 256, "gelu_tanh"), (5, 256, 128, "gelu_tanh"),
                                         (1, 256, 4096, "gelu_tanh")])  # 96: 32-wide tiles; the assistant's gate/up
def test_kernel_gates_the_activation_of_gate_times_up(m, k, n, gated, dtype):
    """w = [gate | up] -> act(x @ gate) * (x @ up) [m, n / 2] (SiLU: Llama / Qwen; tanh GELU: Gemma 4):
    each program holds one column tile of each half, so the MLP's activation costs no launch of its
    own (ragged K, padded rows)."""
    x, w = _inputs(m, k, n, dtype, seed=k)
    out = sm.skinny_matmul_pallas(x, w, interpret=True, gated=gated)
    assert out.shape == (m, n // 2)
    _check_gated(out, x, w, gated)


@pytest.mark.parametrize("n_half,block_n", [(1536, 16), (4864, 64), (8192, 64)])
def test_gated_tiles_stay_wide_where_programs_are_many(n_half, block_n):
    """Half the plain tile (16 from the short-K rule's 32), widened up to 64 columns while that leaves
    at least _GATED_PROGRAMS programs: SmolLM2-135M's gate/up keeps 16-column tiles, Qwen2.5-0.5B's 64."""
    plain = sm.default_config(1, 576, 2 * n_half)
    assert sm.gated_config(plain, 2 * n_half).block_n == block_n
    assert sm.gated_config(sm.default_config(1, 4096, 28672), 28672).block_n == 128  # tuned tiles: halved only


def test_dispatcher_fuses_under_pallas_and_composes_elsewhere():
    x, w = _inputs(4, K, 2 * 88, jnp.bfloat16)
    ref = skinny_matmul_reference(x, w, gated="silu")
    for impl in ("auto", "xla"):  # CPU: the reference, bitwise
        np.testing.assert_array_equal(np.asarray(skinny_matmul(x, w, impl=impl, gated="silu")), np.asarray(ref))
    # N / 2 = 88 is no multiple of any gated tile (>= 16): the kernel's product, then the gate beside it
    _check_gated(skinny_matmul(x, w, impl="pallas", gated="silu"), x, w)
    x, w = _inputs(4, K, 2 * 64, jnp.bfloat16)
    _check_gated(skinny_matmul(x, w, impl="pallas", gated="silu"), x, w)
    with pytest.raises(ValueError, match="invariant"):
        skinny_matmul(x, w, impl="invariant", gated="silu")
    with pytest.raises(ValueError, match="gated"):
        skinny_matmul(x, w, impl="pallas", gated="relu")
    with pytest.raises(ValueError, match="gated"):  # a tiling that splits K cannot gate
        sm.skinny_matmul_pallas(x, w, config=CFG, interpret=True, gated="silu")


def test_layers_fuse_the_gate_without_changing_the_unfused_result():
    """jspec.layers hands the MLP's gate (SiLU, tanh GELU) to the matmul's dispatcher on one device;
    where no kernel runs (CPU, "xla") the result is bitwise the unfused composition, and "invariant"
    composes it; on the kernel ("pallas") it agrees within bf16 rounding. The MLP is a branch: its
    output the down projection's partial sums, whose sum is the product."""
    from jspec.execution import Execution, Kernels
    from jspec.layers import ACTIVATIONS, gated_mlp as gated_mlp_parts, linear
    from pallas_kernels.norm.add_rms_norm import sum_parts

    def gated_mlp(x, *args):
        return sum_parts(gated_mlp_parts(x, *args), x.dtype)

    x, gate_up = _inputs(3, 128, 2 * 64, jnp.bfloat16, seed=1)
    down = _inputs(1, 64, 128, jnp.bfloat16, seed=2)[1]

    def on(impl):
        return Execution(Kernels.parse(impl))

    for activation in ("silu", "gelu_tanh"):
        def composed(impl):
            gate, up = jnp.split(linear(x, gate_up, None, on(impl)), 2, axis=-1)
            return linear(ACTIVATIONS[activation](gate) * up, down, None, on(impl))

        for impl in ("auto", "xla", "invariant"):
            np.testing.assert_array_equal(np.asarray(gated_mlp(x, gate_up, down, activation, on(impl))),
                                          np.asarray(composed(impl)))
        fused = np.asarray(gated_mlp(x, gate_up, down, activation, on("pallas")), np.float32)
        np.testing.assert_allclose(fused, np.asarray(composed("xla"), np.float32), rtol=3e-2, atol=3e-2)
    assert on("pallas").fuses and not on("invariant").fuses
    assert not on("auto,gather_rows=invariant").fuses
    assert Execution(Kernels(), placement=object()).fuses  # a placed model runs the fused kernels per device
    with pytest.raises(ValueError, match="activation"):
        gated_mlp(x, gate_up, down, "relu")
