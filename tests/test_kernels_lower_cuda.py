"""Lowering of the Pallas Triton kernels for CUDA on the CPU machine (abstract H100, notes §4.3).

Catches GPU-only Pallas errors in CPU CI: non-power-of-two block operations, primitives the
Triton lowering lacks, out-of-bounds ref slices (strict in jax 0.12). It does not run the Triton
compiler or ptxas.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.norm.add_rms_norm import add_rms_norm_pallas
from pallas_kernels.attention.decode_attention import decode_attention_pallas
from pallas_kernels.norm.gather_rows import gather_rows_pallas
from tests._lowering import lower_for_cuda, triton_kernel_count

_S = jax.ShapeDtypeStruct


@pytest.mark.parametrize(
    "batch,num_q,num_q_heads,num_kv_heads,max_len,head_dim,dtype,tree,window",
    [
        (1, 1, 32, 8, 131072, 128, jnp.bfloat16, False, None),  # decode: 32 splits, combine kernel
        (4, 5, 32, 8, 4000, 128, jnp.bfloat16, True, 1024),  # verify, tree + window, odd max_len
        (2, 3, 16, 2, 1024, 256, jnp.float32, False, None),  # head_dim 256, fp32
        (2, 64, 8, 2, 512, 64, jnp.bfloat16, False, None),  # prefill-sized num_q: several M blocks
        (8, 1, 32, 8, 8192, 128, jnp.bfloat16, False, None),  # two splits: the last program merges (atomics)
        (32, 1, 32, 8, 8192, 128, jnp.bfloat16, False, None),  # one split per sequence, balanced
        (1, 5, 9, 3, 512, 64, jnp.bfloat16, False, None),  # SmolLM2: one block per program, one wave
        # Gemma 4: 16-row M blocks at head_dim 512 (block_k 32, 2 stages) and 256, window-sized splits
        (1, 9, 32, 4, 131072, 512, jnp.bfloat16, False, None),  # 31B full, 9 rows: 5 M blocks, 16 splits
        (8, 5, 8, 2, 32768, 512, jnp.bfloat16, False, None),  # E4B full, 5 rows: 2 M blocks
        (8, 5, 32, 4, 32768, 512, jnp.bfloat16, False, None),  # 31B full, 5 rows: one 64-row M block
        (32, 9, 32, 16, 32768, 256, jnp.bfloat16, False, 1024),  # 31B sliding, one split per sequence
        (1, 3, 8, 2, 131072, 256, jnp.bfloat16, True, 512),  # E4B sliding, a tree, 16 window splits
    ],
)
def test_decode_attention_lowers_for_cuda(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, tree, window):
    args = [
        _S((batch, num_q, num_q_heads, head_dim), dtype),
        _S((batch, num_kv_heads, max_len, head_dim), dtype),
        _S((batch, num_kv_heads, max_len, head_dim), dtype),
        _S((batch,), jnp.int32),
        _S((batch, num_q), jnp.int32),
        _S((batch, num_q, num_q), jnp.bool_) if tree else None,
    ]

    def fn(q, k, v, lengths, positions, tail_mask):
        return decode_attention_pallas(
            q, k, v, lengths, q_positions=positions, tail_mask=tail_mask, window=window, interpret=False
        )

    text = lower_for_cuda(fn, *args)
    assert triton_kernel_count(text) >= 1


@pytest.mark.parametrize("hidden,n,norm", [(3072, None, True), (4096, 4, True), (5000, 2, False)])
def test_gather_rows_lowers_for_cuda(hidden, n, norm):
    rows = _S((2,) if n is None else (2, n), jnp.int32)
    weight = _S((hidden,), jnp.bfloat16) if norm else None

    def fn(x, rows, weight):
        return gather_rows_pallas(x, rows, norm_weight=weight, interpret=False)

    text = lower_for_cuda(fn, _S((2, 17, hidden), jnp.bfloat16), rows, weight)
    assert triton_kernel_count(text) >= 1


@pytest.mark.parametrize("rows,hidden,splits,gemma4", [(1, 2048, 16, False), (5, 576, 1, False), (1, 5000, 4, False),
                                                     (1, 2560, 4, True)])
def test_add_rms_norm_lowers_for_cuda(rows, hidden, splits, gemma4):
    gemma4_form = dict(norm="fp32_scale") if gemma4 else {}

    def fn(x, parts, weight):
        return add_rms_norm_pallas(x, parts, weight, 1e-5, y_weight=weight if gemma4 else None, interpret=False,
                                   **gemma4_form)

    parts_dtype = jnp.float32 if splits > 1 else jnp.bfloat16
    text = lower_for_cuda(fn, _S((1, rows, hidden), jnp.bfloat16), _S((splits, 1, rows, hidden), parts_dtype),
                          _S((hidden,), jnp.bfloat16))
    assert triton_kernel_count(text) == 1


def test_add_rms_norm_without_a_norm_lowers_for_cuda():
    def fn(x, parts, weight):
        return add_rms_norm_pallas(x, parts, None, 1e-6, y_weight=weight, norm="fp32_scale", interpret=False)[0]

    text = lower_for_cuda(fn, _S((1, 1, 2560), jnp.bfloat16), _S((16, 1, 1, 2560), jnp.float32),
                          _S((2560,), jnp.bfloat16))
    assert triton_kernel_count(text) == 1


def test_add_rms_norm_with_a_scale_lowers_for_cuda():
    """Gemma 4's layer end: the PLE branch's product post-normed, added, times ``layer_scalar``, then
    the next layer's input norm."""
    def fn(x, parts, weight, scale):
        return add_rms_norm_pallas(x, parts, weight, 1e-6, y_weight=weight, norm="fp32_scale", scale=scale,
                                   interpret=False)

    text = lower_for_cuda(fn, _S((1, 1, 2560), jnp.bfloat16), _S((1, 1, 1, 2560), jnp.bfloat16),
                          _S((2560,), jnp.bfloat16), _S((1,), jnp.bfloat16))
    assert triton_kernel_count(text) == 1


# --- skinny matmul (pallas_kernels/matmul/skinny_matmul.py) ---------------------------------------

@pytest.mark.parametrize(
    "m,k,n,dtype,cfg",
    [
        (1, 4096, 14336, jnp.bfloat16, None),  # decode, swept config
        (5, 2048, 3072, jnp.bfloat16, None),  # verify rows, heuristic config with split-K
        (1, 576, 960, jnp.bfloat16, None),  # a small model's qkv: one split of 32-column tiles, ragged K
        (1, 2560, 256, jnp.bfloat16, None),  # Gemma 4 E4B's per-layer-input gate (tuned: 4 splits)
        (1, 256, 2560, jnp.bfloat16, None),  # ... and its projection (tuned: one split)
        (1, 256, 1024, jnp.bfloat16, None),  # the Gemma 4 assistant's q (hidden 256): one split
        (1, 2048, 256, jnp.bfloat16, None),  # ... its down: the rule's split-K
        (64, 4096, 128256, jnp.bfloat16, None),  # LM head, M = 64
        (3, 1000, 777, jnp.bfloat16, (64, 256, 3, 4, 4)),  # ragged K, N and split
        (17, 300, 200, jnp.float32, (32, 64, 2, 8, 3)),  # fp32, masks everywhere
    ],
)
def test_skinny_matmul_lowers_for_cuda(m, k, n, dtype, cfg):
    import importlib

    sm = importlib.import_module("pallas_kernels.matmul.skinny_matmul")
    config = None if cfg is None else sm.SkinnyConfig(*cfg)

    def fn(x, w):
        return sm.skinny_matmul_pallas(x, w, config=config, interpret=False)

    text = lower_for_cuda(fn, _S((m, k), dtype), _S((k, n), dtype))
    assert triton_kernel_count(text) >= 1


@pytest.mark.parametrize("m,k,n,gated", [(5, 2048, 16384, "silu"), (3, 576, 3072, "silu"), (1, 576, 3072, "silu"),
                                         (1, 2560, 20480, "gelu_tanh"), (1, 256, 4096, "gelu_tanh")])
def test_skinny_matmul_with_gate_lowers_for_cuda(m, k, n, gated):
    import importlib

    sm = importlib.import_module("pallas_kernels.matmul.skinny_matmul")

    def fn(x, w):
        return sm.skinny_matmul_pallas(x, w, gated=gated, interpret=False)

    text = lower_for_cuda(fn, _S((m, k), jnp.bfloat16), _S((k, n), jnp.bfloat16))
    assert triton_kernel_count(text) == 1  # the gate lives inside the one kernel


# --- rope + cache write (pallas_kernels/rope_write.py) ----------------------------------------

@pytest.mark.parametrize("rows,qk_norm", [(1, False), (5, True), (100, False)])
def test_rope_write_lowers_for_cuda(rows, qk_norm):
    from pallas_kernels.rope_write import rope_write_pallas

    heads, kv_heads, d, batch = 32, 8, 128, 2
    norms = (_S((d,), jnp.bfloat16),) * 2 if qk_norm else ()

    def fn(qkv, cos, sin, k_buf, v_buf, lengths, *norm):
        return rope_write_pallas(qkv, cos, sin, k_buf, v_buf, lengths, *norm, num_heads=heads, num_kv_heads=kv_heads,
                                 interpret=False)

    table = _S((batch, rows, d), jnp.bfloat16)
    cache = _S((batch, kv_heads, 1024, d), jnp.bfloat16)
    text = lower_for_cuda(fn, _S((batch, rows, (heads + 2 * kv_heads) * d), jnp.bfloat16), table, table, cache, cache,
                          _S((batch,), jnp.int32), *norms)
    assert triton_kernel_count(text) == 1


def test_rope_write_lowers_for_cuda_at_gemma4_full_layers():
    """head_dim 512, fp32-scaled q / k norms, v normed without a weight, V the raw K (``k_eq_v``)."""
    from pallas_kernels.rope_write import rope_write_pallas

    heads, kv_heads, d, batch, rows = 32, 4, 512, 1, 5

    def fn(qkv, cos, sin, k_buf, v_buf, lengths, q_norm, k_norm):
        return rope_write_pallas(qkv, cos, sin, k_buf, v_buf, lengths, q_norm, k_norm, num_heads=heads,
                                 num_kv_heads=kv_heads, norm="fp32_scale", v_norm=True, k_eq_v=True, interpret=False)

    table = _S((batch, rows, d), jnp.bfloat16)
    cache = _S((batch, kv_heads, 1024, d), jnp.bfloat16)
    text = lower_for_cuda(fn, _S((batch, rows, (heads + kv_heads) * d), jnp.bfloat16), table, table, cache, cache,
                          _S((batch,), jnp.int32), _S((d,), jnp.bfloat16), _S((d,), jnp.bfloat16))
    assert triton_kernel_count(text) == 1
