"""Quantized weights (``jspec.quant``): the packed layout, round-to-nearest error per scheme, every
declared weight of every family quantized, a quantized model computing exactly what its dequantized
self computes, bit-exact checkpoints, and bad input named before any compute. Drafters:
tests/test_quantized_drafters.py."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.quant import QuantizedWeight, Scheme, dequantize, quantize_matrix
from tests.tiny import tiny_gemma4, tiny_model


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


def dequantized(tree):
    """``tree`` with every quantized weight replaced by the array it stands for."""
    return jspec.quant.dequantize_tree(tree)


def float_matrices(tree) -> list[str]:
    """The paths of the 2-D float arrays left in ``tree`` (outside quantized weights)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_quantized)
    return [jax.tree_util.keystr(path) for path, leaf in leaves
            if not is_quantized(leaf) and leaf.ndim == 2 and jnp.issubdtype(leaf.dtype, jnp.floating)]


# --- one matrix ------------------------------------------------------------------------------


def test_packed_layout_of_each_format():
    # K = 2, N = 1: one byte of int4, the even k in the low nibble.
    sym = quantize_matrix(jnp.array([[0.0], [7.0]]), Scheme.parse("int4-g2-sym"))
    assert sym.values.dtype == jnp.uint8 and sym.values.tolist() == [[0xF8]]  # codes 0 + 8, 7 + 8
    assert sym.scales.tolist() == [[1.0]] and sym.mins is None
    with_mins = quantize_matrix(jnp.array([[1.0], [16.0]]), Scheme.parse("int4-g2"))
    assert with_mins.values.tolist() == [[0xF0]] and with_mins.mins.tolist() == [[1.0]]  # codes 0, 15
    table = quantize_matrix(jnp.array([[0.0, 7.0]]), Scheme.parse("int4-g2-sym"), transposed=True)
    assert table.values.tolist() == [[0xF8]] and table.shape == (1, 2)
    int8 = quantize_matrix(jnp.array([[-2.0, 1.0], [1.0, 0.5]]), Scheme.parse("int8"))
    assert int8.values.tolist() == [[-127, 127], [64, 64]] and int8.scales.shape == (1, 2)
    fp8 = quantize_matrix(jnp.array([[448.0], [-1.0]]), Scheme.parse("fp8"))
    assert fp8.values.dtype == jnp.float8_e4m3fn and fp8.values.astype(jnp.float32).tolist() == [[448.0], [-1.0]]


SCHEMES = ["int8", "int8-g32", "int8-g32-mins", "fp8", "int4", "int4-g32-sym"]


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_error_is_within_half_a_step(name, transposed, dtype):
    scheme = Scheme.parse(name)
    w = (jax.random.normal(jax.random.key(0), (256, 48)) * jnp.linspace(0.01, 3.0, 48)).astype(dtype)
    w = w.at[:, 0].set(0)  # a channel of zeros
    qw = quantize_matrix(w.T if transposed else w, scheme, transposed=transposed)
    assert qw.scheme == scheme and qw.dtype == dtype and qw.shape == (w.T if transposed else w).shape
    back = dequantize(qw, jnp.float32)
    step = qw.scales.astype(jnp.float32)
    if transposed:
        back, step = back.T, step.T
    step = jnp.repeat(step, 256 // step.shape[0], axis=0)  # [K, N]: each entry's scale
    wf = w.astype(jnp.float32)
    err = jnp.abs(back - wf)
    # The scale is rounded to the weight's dtype before the codes are made: it may fall short of the
    # exact step by that rounding, and the extreme code may clip by as much.
    slack = (2.0 ** -8 if dtype == jnp.bfloat16 else 1e-6) * (1 + 7 * scheme.mins) * 127
    if scheme.format == "fp8":
        bound = jnp.abs(wf) * 2.0 ** -4 + step * 2.0 ** -10 + 1e-6  # half an ulp of 3 mantissa bits; subnormals
    else:
        bound = step * (0.5 + slack) + 1e-6
    assert bool(jnp.all(err <= bound)), float(jnp.max(err - bound))
    assert bool(jnp.all(back[:, 0] == 0))
    rows = jnp.array([[3, 7], [0, 47]])
    if transposed:  # a table's row lookup dequantizes only those rows, to the same values
        np.testing.assert_array_equal(qw[rows], dequantize(qw)[rows])


# --- whole models and drafters ---------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_target():
    return tiny_model(0, tie_word_embeddings=True)


def assert_every_matrix_quantized(tree, quantized):
    """Every matmul weight and table of ``tree`` is quantized in ``quantized``; norms, biases and index
    tables stay arrays."""
    assert float_matrices(tree) and float_matrices(quantized) == []
    kept = [leaf for leaf in jax.tree.leaves(quantized, is_leaf=is_quantized) if not is_quantized(leaf)]
    assert len(kept) == len(jax.tree.leaves(tree)) - len(float_matrices(tree))


def test_a_tied_table_is_quantized_once_for_lookup_and_head(llama_target):
    quantized = jspec.quantize(llama_target, "int8")
    assert quantized.lm_head is None and quantized.embed.transposed and quantized.embed.shape == (97, 64)
    assert quantized.embed.scales.shape == (97, 1)  # one scale per vocabulary row: the head's output channel


def test_matmul_weights_are_stored_k_last(llama_target):
    """Every quantized weight is stored ``[N, K]`` (the kernel streams K-contiguous rows faster); the
    model still reads its sizes and ``dequantize_tree`` gives back the ``[K, N]`` arrays."""
    quantized = jspec.quantize(llama_target, "int4-g32")
    gate_up = quantized.layers[0].gate_up
    k, n = llama_target.layers[0].gate_up.shape
    assert gate_up.transposed and gate_up.values.shape == (n, k // 2) and (gate_up.k, gate_up.n) == (k, n)
    assert (jspec.quant.in_features(gate_up), jspec.quant.out_features(gate_up)) == (k, n)
    assert dequantized(quantized).layers[0].gate_up.shape == (k, n)


@pytest.mark.parametrize("model, scheme", [
    (lambda: tiny_model(0, tie_word_embeddings=True), "int4-g32"),
    (lambda: tiny_model(0, qkv_bias=True, qk_norm=True), "fp8"),
    (lambda: tiny_gemma4(0), "int4-g8-sym"),  # per-layer embeddings: a second table, its projections
], ids=["llama-tied-int4", "qwen-fp8", "gemma4-int4-sym"])
def test_a_quantized_model_computes_what_its_dequantized_self_computes(model, scheme):
    model = model()
    quantized = jspec.quantize(model, scheme)
    assert_every_matrix_quantized(model, quantized)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3]]
    np.testing.assert_allclose(jspec.score(quantized, prompts), jspec.score(dequantized(quantized), prompts),
                               rtol=1e-5, atol=1e-5)


def test_invariant_kernels_take_quantized_weights(llama_target):
    quantized = jspec.quantize(llama_target, "int4-g32")
    prompts = [[1, 2, 3, 4, 5]]
    np.testing.assert_allclose(jspec.score(jspec.with_kernels(quantized, "invariant"), prompts),
                               jspec.score(dequantized(quantized), prompts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme, dtype", [("int4-g32", jnp.float32), ("fp8", jnp.bfloat16)])
def test_save_restore_keeps_quantized_weights_bit_exact(tmp_path, scheme, dtype):
    model = jax.tree.map(lambda x: x.astype(dtype), tiny_model(0, tie_word_embeddings=True))
    model = jspec.quantize(model, scheme)
    jspec.save(model, tmp_path / "m")
    restored = jspec.restore(tmp_path / "m")
    assert jax.tree.structure(restored) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int3", "int4-g0", "int4-g33", "int8-sym", "fp8-sym", "fp8-mins", "INT8", "int4-", 8])
def test_an_unknown_scheme_is_named(llama_target, scheme):
    with pytest.raises(ValueError, match="scheme|group size"):
        jspec.quantize(llama_target, scheme)


def test_a_group_size_that_does_not_divide_k_names_the_weights_and_a_group_that_fits(llama_target):
    with pytest.raises(ValueError, match=r"group size 64 does not divide K = 96 \(\.layers\[0\]\.down, "
                                         r"\.layers\[1\]\.down\); int4-g32 fits every weight"):
        jspec.quantize(llama_target, "int4-g64")
    with pytest.raises(ValueError, match=r"group size 128 does not divide K = 64 \(\.embed, \.layers\[0\]\.qkv, "
                                         r"\.layers\[0\]\.o and 4 more\); group size 128 does not divide K = 96"):
        jspec.quantize(llama_target, "int4")


def test_fp8_on_a_gpu_without_fp8_units_is_refused(llama_target, monkeypatch):
    ampere = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100")
    monkeypatch.setattr(jax, "devices", lambda *args: [ampere])
    with pytest.raises(ValueError, match="fp8 weights need a GPU of compute capability 8.9"):
        jspec.quantize(llama_target, "fp8")
    hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H200")
    jspec.quant.check_platform(Scheme.parse("fp8"), hopper)


def test_quantized_weights_are_not_placed_on_a_mesh(llama_target):
    with pytest.raises(ValueError, match="quantized weights"):
        jspec.shard(jspec.quantize(llama_target, "int8"), jspec.tensor_parallel_mesh())
