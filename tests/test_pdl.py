"""Programmatic dependent launch: every Pallas Triton kernel lets the next kernel launch at its entry.

XLA holds each kernel it launches on Hopper at ``griddepcontrol.wait`` until the kernel before it has
finished (``pallas_kernels/pdl.py``), so a trigger at entry changes when the next kernel launches,
never what it reads: on the GPU the decode loop's tokens were bit-identical with and without it
(``benchmarks/decode_h100_pdl_trigger.json``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import pdl
from pallas_kernels.norm.add_rms_norm import add_rms_norm_pallas
from pallas_kernels.attention.decode_attention import decode_attention_pallas
from pallas_kernels.norm.gather_rows import gather_rows_pallas
from pallas_kernels.attention.invariant_attention import decode_attention_invariant
from pallas_kernels.rope_write import rope_write_pallas
from pallas_kernels.matmul.skinny_matmul import skinny_matmul_pallas
from pallas_kernels.attention.wide_head_merge import merge_splits
from tests._lowering import lower_for_cuda, triton_kernel_count

_S = jax.ShapeDtypeStruct
_TRIGGER = "griddepcontrol.launch_dependents"


def _lowered_kernels():
    """Lowered text of one call of each Triton kernel module (the attention kernels: two kernels each)."""
    bf16 = jnp.bfloat16
    table, cache = _S((1, 1, 64), bf16), _S((1, 2, 256, 64), bf16)
    yield "skinny_matmul", lower_for_cuda(lambda x, w: skinny_matmul_pallas(x, w, interpret=False),
                                          _S((1, 2048), bf16), _S((2048, 8192), bf16))
    yield "add_rms_norm", lower_for_cuda(lambda x, p, w: add_rms_norm_pallas(x, p, w, 1e-5, interpret=False),
                                         _S((1, 1, 2048), bf16), _S((16, 1, 1, 2048), jnp.float32), _S((2048,), bf16))
    yield "gather_rows", lower_for_cuda(lambda x, r, w: gather_rows_pallas(x, r, norm_weight=w, interpret=False),
                                        _S((2, 17, 2048), bf16), _S((2,), jnp.int32), _S((2048,), bf16))
    yield "rope_write", lower_for_cuda(
        lambda qkv, c, s, k, v, n: rope_write_pallas(qkv, c, s, k, v, n, num_heads=4, num_kv_heads=2, interpret=False),
        _S((1, 1, 8 * 64), bf16), table, table, cache, cache, _S((1,), jnp.int32))
    yield "decode_attention", lower_for_cuda(
        lambda q, k, v, n, p: decode_attention_pallas(q, k, v, n, q_positions=p, interpret=False),
        _S((1, 1, 32, 128), bf16), _S((1, 8, 131072, 128), bf16), _S((1, 8, 131072, 128), bf16),
        _S((1,), jnp.int32), _S((1, 1), jnp.int32))
    yield "invariant_attention", lower_for_cuda(
        lambda q, k, v, n, p: decode_attention_invariant(q, k, v, n, q_positions=p, interpret=False),
        _S((1, 1, 32, 128), bf16), _S((1, 8, 4096, 128), bf16), _S((1, 8, 4096, 128), bf16),
        _S((1,), jnp.int32), _S((1, 1), jnp.int32))
    yield "wide_head_merge", lower_for_cuda(
        lambda o, lse: merge_splits(o, lse, num_q=1, num_kv_heads=2, group=8, dtype=bf16, interpret=False),
        _S((1, 2, 4, 8, 512), jnp.float32), _S((1, 2, 4, 8), jnp.float32))


def test_every_triton_kernel_triggers_its_dependents_on_the_gpu():
    for name, text in _lowered_kernels():
        kernels = triton_kernel_count(text)
        assert kernels >= 1 and text.count(_TRIGGER) == kernels, name


def test_the_interpreter_runs_kernels_without_the_trigger():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    assert pdl.triggering(kernel, interpret=True) is kernel
    call = pdl.pallas_call(kernel, out_shape=_S((8,), jnp.float32), interpret=True)
    np.testing.assert_array_equal(np.asarray(call(jnp.arange(8.0))), np.arange(8.0) + 1)
