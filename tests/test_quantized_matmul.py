"""The quantized skinny matmul: the Pallas kernel (dequantizing in registers) in interpret mode against
the exact reference, for every format; the dispatcher's choices; the kernel lowered for CUDA.

Interpret mode pads float inputs (x, scales, mins) to whole blocks with NaN and starts outputs as
NaN, so a finite result equal to the reference means every output element was written and no padded
entry reached a dot unmasked. Shapes are ragged against the blocks (K, N and the last split).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.quant import Scheme, quantize_matrix
from pallas_kernels.matmul import quantized_kernel as qk
from pallas_kernels.matmul import quantized_matmul as qm
from pallas_kernels.matmul.skinny_tilings import SkinnyConfig
from tests._lowering import lower_for_cuda, triton_kernel_count

# Small K steps (int4 groups of 128 span two of them, groups of 32 two substeps of one), two splits
# of which the last is ragged, N no multiple of the column tile: every mask in play.
CFG = SkinnyConfig(block_n=64, block_k=64, split_k=2, num_warps=4, num_stages=3)
# The reference paths as one program each rather than op by op (each eager op compiles on its own);
# the kernel is jitted already, and its eager calls hit the cache of an earlier call's tiling.
quantized_matmul_reference = jax.jit(qm.quantized_matmul_reference, static_argnames=("w_transposed", "gated"))
jitted_matmul = jax.jit(qm.quantized_matmul, static_argnames=("impl", "w_transposed", "gated"))


def _weight(scheme, k, n, *, transposed=False, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    w = (jax.random.normal(kw, (n, k) if transposed else (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    q = quantize_matrix(w, Scheme.parse(scheme), transposed=transposed)
    return q.values, q.scales, q.mins


def _x(m, k, seed=0, dtype=jnp.bfloat16):
    return jax.random.normal(jax.random.key(seed + 1), (m, k), jnp.float32).astype(dtype)


def _check(out, ref, tol=1e-2):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32, ref32 = (np.asarray(a.astype(jnp.float32)) for a in (out, ref))
    assert np.isfinite(out32).all(), "unwritten (NaN-poisoned) or NaN-contaminated output"
    # The same dequantized weight, fp32 accumulation in both: only the order of the sums differs.
    np.testing.assert_allclose(out32, ref32, rtol=tol, atol=tol)


@pytest.mark.parametrize("scheme,m,k,n,cfg", [
    ("int8", 1, 200, 150, CFG),  # per channel, K ragged against the step
    ("fp8", 1, 200, 150, SkinnyConfig(64, 64, 1, gemv=True)),  # 8-bit one row without a dot (gemv)
    ("fp8", 1, 200, 150, None),  # a small projection's one-row default: 32-column dot tiles, one split
    ("int4-g32", 1, 320, 150, None),  # ... int4's: gemv, 16 columns, one 512-row step over K = 320
    ("int4-g32", 1, 896, 64, None),  # Qwen2.5-0.5B's K: a 512-row step, then a ragged one of 384
    ("int4-g32", 1, 4096, 40, None),  # a long K at one row: gemv with split-K, ragged columns
    ("int4-g32", 2, 320, 150, SkinnyConfig(64, 64, 2, gemv=True)),  # gemv over two rows and two splits
    ("int8", 80, 200, 150, None),  # the kernel's most rows: one 128-row tile
    ("fp8", 3, 200, 150, CFG),
    ("int4-g32-sym", 17, 320, 150, CFG),
    ("int4-g32", 3, 320, 150, None),  # the default over rows: the dot in 128-row steps, four groups each
    ("int4-g64-sym", 1, 320, 150, CFG),
    ("int4-g64", 80, 320, 150, CFG),
    ("int4-g128-sym", 3, 384, 150, CFG),  # a group spans two steps
    ("int4-g128", 1, 384, 150, CFG),
    ("int8-g32-mins", 5, 320, 150, CFG),
])
def test_kernel_matches_reference(scheme, m, k, n, cfg):
    parts = _weight(scheme, k, n, seed=m)
    x = _x(m, k, seed=m)
    out = qk.quantized_matmul_pallas(x, *parts, config=cfg, interpret=True)
    _check(out, quantized_matmul_reference(x, *parts))


def test_kernel_in_fp32_matches_to_fp32_rounding():
    """fp32 activations and weight (fp32 scales): the dequantized entries are the reference's exactly."""
    w = jax.random.normal(jax.random.key(3), (256, 96), jnp.float32) / 16
    q = quantize_matrix(w, Scheme.parse("int4-g64"))
    x = _x(5, 256, dtype=jnp.float32)
    out = qk.quantized_matmul_pallas(x, q.values, q.scales, q.mins, config=CFG, interpret=True)
    _check(out, quantized_matmul_reference(x, q.values, q.scales, q.mins), tol=1e-5)


@pytest.mark.parametrize("scheme,m,cfg", [("int4-g32", 3, CFG), ("int8", 1, CFG),
                                          ("int4-g32", 1, None)])  # a small model's head: gemv by default
def test_kernel_reads_a_table_stored_n_by_k(scheme, m, cfg):
    """A tied LM head: the quantized embedding table [V, H] contracted as stored."""
    parts = _weight(scheme, 320, 150, transposed=True)
    x = _x(m, 320)
    out = qk.quantized_matmul_pallas(x, *parts, config=cfg, interpret=True, w_transposed=True)
    _check(out, quantized_matmul_reference(x, *parts, w_transposed=True))


@pytest.mark.parametrize("scheme,m,cfg", [
    ("int4-g64", 5, SkinnyConfig(block_n=64, block_k=64)),
    ("fp8", 5, SkinnyConfig(block_n=64, block_k=64)),
    ("int4-g32", 1, None),  # a small projection's one-row default: gemv
])
def test_kernel_gates_the_activation(scheme, m, cfg):
    parts = _weight(scheme, 256, 256)
    x = _x(m, 256)
    out = qk.quantized_matmul_pallas(x, *parts, config=cfg, interpret=True, gated="silu")
    assert out.shape == (m, 128)
    _check(out, quantized_matmul_reference(x, *parts, gated="silu"), tol=2e-2)  # the gate's bf16 rounding


def test_parts_sum_to_the_product():
    parts = _weight("int4-g64", 320, 150)
    x = _x(4, 320).reshape(2, 2, 320)
    split = qk.quantized_matmul_pallas_parts(x, *parts, config=CFG, interpret=True)
    assert split.shape == (2, 2, 2, 150) and split.dtype == jnp.float32
    _check(split.sum(axis=0).astype(x.dtype), quantized_matmul_reference(x, *parts))
    # where no kernel runs: [1, ...] holding the product
    product = jax.jit(qm.quantized_matmul_parts, static_argnames="impl")(x, *parts, impl="xla")
    np.testing.assert_array_equal(np.asarray(product), np.asarray(quantized_matmul_reference(x, *parts))[None])


def test_dispatcher_choices_on_cpu():
    """auto / xla: the reference, bitwise (no GPU); pallas: the kernel up to MAX_M rows, the reference
    beyond and for groups too short for a 16-bit dot; a gate whose halves are no whole column tiles
    composed beside the kernel's product."""
    parts = _weight("int4-g64", 256, 176)
    x = _x(4, 256)
    ref = quantized_matmul_reference(x, *parts)
    for impl in ("auto", "xla"):
        np.testing.assert_array_equal(np.asarray(jitted_matmul(x, *parts, impl=impl)), np.asarray(ref))
    _check(qm.quantized_matmul(x.reshape(2, 2, 256), *parts, impl="pallas").reshape(4, 176), ref)
    # N / 2 = 88: no whole gated tiles, so the same kernel's product, then the gate
    gate, up = jnp.split(ref, 2, axis=-1)
    _check(qm.quantized_matmul(x, *parts, impl="pallas", gated="silu"), jax.nn.silu(gate) * up, tol=2e-2)
    many = _x(qk.MAX_M + 1, 256)
    np.testing.assert_array_equal(np.asarray(jitted_matmul(many, *parts, impl="pallas")),
                                  np.asarray(quantized_matmul_reference(many, *parts)))
    short = _weight("int4-g16", 256, 176)  # 8 K rows a nibble half: no kernel
    with pytest.raises(ValueError, match="16-bit dot"):
        qk.quantized_matmul_pallas(x, *short, interpret=True)
    np.testing.assert_array_equal(np.asarray(jitted_matmul(x, *short, impl="pallas")),
                                  np.asarray(quantized_matmul_reference(x, *short)))


def test_auto_on_a_gpu_runs_the_gate_beside_the_kernels_unfused_product(monkeypatch):
    """As measured (``AUTO_FUSES_GATE``): the kernel computes gate|up with its split-K tiling, the gate
    follows; ``pallas`` keeps the fused epilogue."""
    calls = []

    def kernel(x, values, scales, mins=None, *, gated=None, **kwargs):
        calls.append(gated)
        return quantized_matmul_reference(x, values, scales, mins, gated=gated)

    monkeypatch.setattr(qm, "on_gpu", lambda: True)
    monkeypatch.setattr(qm, "quantized_matmul_pallas", kernel)
    parts = _weight("int8", 256, 256)
    x = _x(1, 256)
    gate, up = jnp.split(quantized_matmul_reference(x, *parts), 2, axis=-1)
    _check(qm.quantized_matmul(x, *parts, impl="auto", gated="silu"), jax.nn.silu(gate) * up, tol=2e-2)
    qm.quantized_matmul(x, *parts, impl="pallas", gated="silu")
    assert calls == [None, "silu"]


@pytest.mark.parametrize("k, n, transposed, kernel", [
    (4096, 14336, True, True),  # a Llama-3.1-8B projection stored K last: the kernel
    (896, 1152, False, True),  # a small projection stored [K, N]: the kernel (its short-K tiling)
    (896, 1152, True, False),  # stored K last, as jspec stores it: XLA's dequantize + dot is faster
    (896, 9728, True, True),  # Qwen2.5-0.5B's gate|up: 8.7 M entries, the kernel again
    (576, 49152, True, True),  # a tied LM head
])
def test_auto_on_a_gpu_takes_xla_for_small_projections_stored_k_last(k, n, transposed, kernel):
    loader = qk.quantized_loader(*_abstract_weight("int4-g32", k, n, transposed), w_transposed=transposed)[0]
    assert qm._auto_uses_kernel(1, k, n, transposed) == kernel
    assert qk.kernel_takes(1, loader, k, n, w_transposed=transposed)


def test_bad_shapes_are_named():
    values, scales, mins = _weight("int4-g64", 256, 96)
    x = _x(2, 256)
    with pytest.raises(ValueError, match="scales"):
        qm.quantized_matmul(x, values, scales[:, :64], mins, impl="pallas")
    with pytest.raises(ValueError, match="mins"):
        qm.quantized_matmul(x, values, scales, mins[:2], impl="xla")
    with pytest.raises(ValueError, match="K = 256"):
        qm.quantized_matmul(_x(2, 128), values, scales, mins, impl="pallas")
    with pytest.raises(ValueError, match="quantized values"):
        qk.quantized_matmul_pallas(x, values.astype(jnp.int16), scales, mins, interpret=True)
    with pytest.raises(ValueError, match="scales"):  # 3 groups do not divide K = 256
        qm.quantized_matmul(x, values, scales[:3], mins[:3], impl="pallas")
    with pytest.raises(ValueError, match="rows"):
        qk.quantized_matmul_pallas(_x(qk.MAX_M + 1, 256), values, scales, mins, interpret=True)


# --- lowered for CUDA (abstract H100; Pallas-level GPU errors, not the Triton compiler) ------------

_S = jax.ShapeDtypeStruct
_VALUES = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _abstract_weight(scheme, k, n, transposed):
    s = Scheme.parse(scheme)
    shape = (lambda a, b: (b, a)) if transposed else (lambda a, b: (a, b))
    values = _S(shape(k // 2 if s.format == "int4" else k, n), _VALUES[s.format])
    scales = _S(shape(k // (s.group_size or k), n), jnp.bfloat16)
    return values, scales, scales if s.mins else None


@pytest.mark.parametrize("scheme,m,k,n,transposed,gated", [
    ("int4-g128", 1, 4096, 28672, True, None),  # Llama-3.1-8B gate|up stored K last (jspec's storage)
    ("int4-g128", 16, 4096, 28672, True, None),  # ... verify rows: 32-column tiles on 2 warps
    ("int8", 16, 14336, 4096, True, None),  # its down, verify rows
    ("fp8", 5, 4096, 6144, True, None),  # its qkv
    ("int4-g128-sym", 1, 4096, 4096, True, None),  # its o
    ("int4-g128", 1, 4096, 6144, False, None),  # Llama-3.1-8B qkv stored [K, N], decode: split-K
    ("int4-g32-sym", 5, 14336, 4096, False, None),  # down, verify rows: 8 substeps a step
    ("int4-g64", 1, 4096, 28672, False, "silu"),  # gate | up with the gate fused
    ("int4-g128", 80, 4096, 4096, False, None),  # o at 80 rows: one 128-row tile
    ("int4-g128", 1, 4096, 128256, True, None),  # a tied LM head read as stored
    ("int8", 16, 4096, 4096, False, None),
    ("int8-g32-mins", 3, 1000 - 1000 % 32, 777, False, None),  # ragged N and K steps
    ("fp8", 1, 4096, 128256, True, None),
    ("int4-g32", 1, 576, 3072, False, None),  # SmolLM2-135M's gate | up: short K, gemv
    ("int8-g32", 1, 1536, 576, False, None),  # its down: 64-column tiles, split-K
    ("int4-g32", 1, 576, 49152, True, None),  # its tied LM head
    ("int4-g32", 1, 896, 1152, False, None),  # Qwen2.5-0.5B's qkv: 512-row steps, ragged K
    ("int4-g32", 1, 896, 9728, False, "silu"),  # its gate | up, the gate fused
    ("int4-g32", 1, 4864, 896, False, None),  # its down: gemv with split-K
])
def test_kernel_lowers_for_cuda(scheme, m, k, n, transposed, gated):
    """bf16 scales: the packed widening (``pallas_kernels.matmul.widen``) in every format."""
    values, scales, mins = _abstract_weight(scheme, k, n, transposed)
    extra = () if mins is None else (mins,)

    def fn(x, values, scales, *mins):
        return qk.quantized_matmul_pallas(x, values, scales, *mins, interpret=False, w_transposed=transposed,
                                          gated=gated)

    text = lower_for_cuda(fn, _S((m, k), jnp.bfloat16), values, scales, *extra)
    assert triton_kernel_count(text) == 1


# --- the benchmark (python -m jspec.bench quant-matmul; its --tiny run takes ~10 s, so not run here) ---

def test_bench_subcommand_parses_and_its_sweep_tilings_fit_the_kernel():
    from jspec.bench import cli, quant_matmul, quant_matmul_sweep
    from jspec.bench.flags import apply_tiny

    args = cli.parser().parse_args(["quant-matmul", "--tiny", "--out", "x", "--formats", "int4-g32,fp8"])
    apply_tiny(args)
    assert (args.formats, args.shapes, args.skip_torch) == ("int4-g32,fp8", "256x96t", True)
    assert quant_matmul.parse_shapes("4096x6144,4096x128256t") == [(4096, 6144, False), (4096, 128256, True)]
    for fmt in ("int4-g32", "int4-g128", "int8", "fp8"):
        loader = qk.quantized_loader(*quant_matmul_sweep.abstract_parts(fmt, 4096, 6144))[0]
        tilings = quant_matmul_sweep.candidates(fmt, 1, 4096, 6144)
        assert len(tilings) >= 6
        for tiling in tilings + quant_matmul_sweep.refined(tilings, 4096):
            loader.check(tiling.block_k)


def test_the_sweep_compiles_its_tilings_in_threads_and_sets_aside_those_that_fail():
    from jspec.bench import quant_matmul

    fns = {"xla": jax.jit(lambda x: x + 1), "kernel": jax.jit(lambda x: x * 2),
           "kernel bad": jax.jit(lambda x: x.reshape(7))}  # a tiling that cannot lower
    ok, failed = quant_matmul.compiled(fns, jnp.ones(4), (), threads=2)
    assert set(ok) == {"xla", "kernel"} and set(failed) == {"kernel bad"}
    assert isinstance(failed["kernel bad"], TypeError)
    np.testing.assert_array_equal(ok["kernel"](jnp.ones(4)), 2)
