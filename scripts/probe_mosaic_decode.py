"""Does a Mosaic GPU decode-attention kernel beat the Triton one? A probe, not a library kernel.

The issue behind ``pallas_kernels.decode_attention`` allows a Mosaic GPU (MGPU) version "only if
it measurably wins". This script holds the candidate -- TMA loads into a ring of shared-memory
stages, a producer warpgroup and a consumer warpgroup (warp specialization), WGMMA for both
products -- and times it against the Triton kernel and cuDNN, each call cold (after an L2 flush),
interleaved in one profiler trace. It also runs the same MGPU kernel on cuDNN's own [B, S, H, D]
layout, which separates what the kernel costs from what our [B, H, S, D] cache layout costs.

Scope of the candidate: one query row per sequence (``num_q * group <= 64`` rows in general),
visibility by ``kv_lengths`` only, ``max_len`` a multiple of ``block_kv``; rows past a length may
hold anything (NaN included). Needs an H100-class GPU (MGPU has no CPU lowering).

    PYTHONPATH=. python scripts/probe_mosaic_decode.py --out benchmarks/decode_attention_mosaic_h100.json
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROWS = 64  # WGMMA's M tile: the group's query rows, padded


def mosaic_decode_attention(q, k, v, kv_lengths, *, block_kv=64, stages=2, k_splits=1, layout="bnth"):
    """``q [batch, num_q, num_q_heads, head_dim]``, ``k, v [batch, num_kv_heads, max_len, head_dim]``
    (``layout="bshd"``: ``[batch, max_len, num_kv_heads, head_dim]``), ``kv_lengths [batch]`` ->
    ``[batch, num_q, num_q_heads, head_dim]``. Grid: (KV head, split, sequence)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    wgmma_layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
    batch, num_q, num_q_heads, head_dim = q.shape
    num_kv_heads, max_len = (k.shape[1], k.shape[2]) if layout == "bnth" else (k.shape[2], k.shape[1])
    group = num_q_heads // num_kv_heads
    rows = num_q * group
    if rows > ROWS or max_len % block_kv or block_kv % 64:
        raise ValueError(f"needs num_q * group <= {ROWS} and max_len a multiple of block_kv (a multiple of 64)")
    dtype = q.dtype
    q_rows = q.reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_rows = jnp.pad(q_rows.reshape(batch, num_kv_heads, rows, head_dim), ((0, 0), (0, 0), (0, ROWS - rows), (0, 0)))
    blocks_per_split = pl.cdiv(max_len // block_kv, k_splits)
    stages = min(stages, blocks_per_split)
    logit_scale = head_dim**-0.5 * math.log2(math.e)  # softmax in base 2: exp2 is one instruction

    def kernel(q_ref, k_ref, v_ref, lengths_ref, out_ref, lse_ref, scratch):
        b, h, split, wg = (lax.axis_index(n) for n in ("batch", "heads", "split", "wg"))
        (q_smem, k_smem, v_smem, o_smem, lse_smem), (k_ready, v_ready, q_ready), (k_free, v_free) = scratch
        length = lengths_ref[b]
        first = split * blocks_per_split
        end = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_kv))

        def kv_rows(ref, block):
            rows_ = pl.ds(block * block_kv, block_kv)
            return ref.at[b, h, rows_] if layout == "bnth" else ref.at[b, rows_, h]

        @pl.when(wg == 0)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_ready.at[0])
            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout)
            l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), row_layout)
            acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), wgmma_layout)
            plgpu.barrier_wait(q_ready.at[0])
            pl.when(end > first)(lambda: plgpu.barrier_wait(k_ready.at[lax.rem(first, stages)]))

            def step(block, carry):
                acc, m, l = carry
                slot = lax.rem(block, stages)
                start = block * block_kv
                tail = start + block_kv > length

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, block_kv), jnp.float32)) * logit_scale
                plgpu.barrier_arrive(k_free.at[slot])
                cols = lambda: plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=wgmma_layout)
                s = lax.cond(tail, lambda: jnp.where(start + cols() < length, s, -jnp.inf), lambda: s)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p = p.astype(dtype)
                plgpu.barrier_wait(v_ready.at[slot])

                @pl.when(tail)
                def _zero_rows_past_length():  # p is 0 there, but 0 * NaN is not
                    tile = plgpu.load(v_smem.at[slot], layout=wgmma_layout)
                    r = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=wgmma_layout)
                    v_smem.at[slot][...] = jnp.where(start + r < length, tile, jnp.zeros_like(tile))
                    plgpu.commit_smem()

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                    pl.when(block + 1 < end)(lambda: plgpu.barrier_wait(k_ready.at[lax.rem(block + 1, stages)]))

                acc = pl.run_state(values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            acc, m, l = lax.fori_loop(first, end, step, (acc, m, l))
            l_safe = jnp.where(l > 0, l, jnp.ones_like(l))  # an empty split writes zeros
            o_smem[...] = (acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])).astype(o_smem.dtype)
            if k_splits > 1:
                lse_smem[...] = jnp.where(l > 0, m + jnp.log2(l_safe), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], out_ref.at[b, h] if k_splits == 1 else out_ref.at[b, h, split])
            if k_splits > 1:
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, split])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 1)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            for i in range(stages):
                @pl.when(first + i < end)
                def _fill():
                    slot = lax.rem(first + i, stages)
                    plgpu.copy_gmem_to_smem(kv_rows(k_ref, first + i), k_smem.at[slot], k_ready.at[slot])
                    plgpu.copy_gmem_to_smem(kv_rows(v_ref, first + i), v_smem.at[slot], v_ready.at[slot])

            @pl.loop(first, end - stages)
            def _refill(block):
                slot = lax.rem(block, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.copy_gmem_to_smem(kv_rows(k_ref, block + stages), k_smem.at[slot], k_ready.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                plgpu.copy_gmem_to_smem(kv_rows(v_ref, block + stages), v_smem.at[slot], v_ready.at[slot])

    out_dtype = dtype if k_splits == 1 else jnp.float32

    def entry(*refs):
        swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scratch: kernel(*refs, scratch),
            (plgpu.SMEM((ROWS, head_dim), dtype, transforms=swizzled),
             plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled),
             plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=swizzled),
             plgpu.SMEM((ROWS, head_dim), out_dtype),
             plgpu.SMEM((ROWS,), jnp.float32) if k_splits > 1 else None),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=1)),
            (plgpu.Barrier(num_arrivals=1, num_barriers=stages),) * 2,
            collective_axes="wg",
        )

    if k_splits == 1:
        out_type = [jax.ShapeDtypeStruct((batch, num_kv_heads, rows, head_dim), dtype), None]
    else:
        out_type = [jax.ShapeDtypeStruct((batch, num_kv_heads, k_splits, rows, head_dim), jnp.float32),
                    jax.ShapeDtypeStruct((batch, num_kv_heads, k_splits, ROWS), jnp.float32)]
    out, lse = plgpu.kernel(
        entry, out_type=out_type, grid=(num_kv_heads, k_splits, batch), grid_names=("heads", "split", "batch"),
        num_threads=2, thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q_rows, k, v, kv_lengths)
    if k_splits > 1:  # log-sum-exp merge of the splits (base 2)
        lse = lse[..., :rows]
        top = jnp.max(lse, axis=2, keepdims=True)
        weights = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))
        out = jnp.sum(out * weights[..., None], axis=2) / jnp.maximum(jnp.sum(weights, axis=2), 1e-30)[..., None]
    out = out.astype(dtype).reshape(batch, num_kv_heads, num_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, num_q, num_q_heads, head_dim)


def check(cases):
    """Max |MGPU - reference| on ragged batches with NaN past each length."""
    from jspec.benchmarking import decode_attention_inputs
    from pallas_kernels.decode_attention import decode_attention_reference

    results = []
    for batch, max_len, lengths, kw in cases:
        q, k, v, lens, pos = decode_attention_inputs(batch, 1, 32, 8, max_len, 128, lengths, seed=1, poison=True)
        got = jax.jit(functools.partial(mosaic_decode_attention, **kw))(q, k, v, lens).astype(jnp.float32)
        want = decode_attention_reference(q, k, v, lens, q_positions=pos).astype(jnp.float32)
        results.append(dict(batch=batch, max_len=max_len, lengths=lengths, config=kw,
                            max_abs_err=float(jnp.max(jnp.abs(got - want))), any_nan=bool(jnp.any(jnp.isnan(got)))))
    return results


def time_shape(batch, context, configs, repeats, rounds):
    """Median GPU microseconds per cold call of each candidate, uniform lengths."""
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_private

    from jspec.benchmarking import decode_attention_inputs, interleaved_gpu_times
    from pallas_kernels.decode_attention import decode_attention_pallas, decode_attention_reference

    q, k, v, lens, pos = decode_attention_inputs(batch, 1, 32, 8, context, 128, [context] * batch)
    k_bshd, v_bshd = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    public_cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    candidates = {
        "cudnn": (lambda q, k, v, l: public_cudnn(q, k, v, key_value_seq_lengths=l), (q, k_bshd, v_bshd, lens)),
        "cudnn_on_our_cache": (lambda q, k, v, l: public_cudnn(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                                                               key_value_seq_lengths=l), (q, k, v, lens)),
        "cudnn_bnth": (lambda q, k, v: cudnn_private(jnp.swapaxes(q, 1, 2), k, v, scale=q.shape[-1] ** -0.5,
                                                     qkv_layout="BNTH"), (q, k, v)),
        "triton": (lambda q, k, v, l, p: decode_attention_pallas(q, k, v, l, q_positions=p), (q, k, v, lens, pos)),
    }
    for config in configs:
        name = "mosaic_" + "_".join(f"{key}{value}" for key, value in config.items())
        bshd = config.get("layout") == "bshd"
        candidates[name] = (functools.partial(mosaic_decode_attention, **config),
                            (q, k_bshd, v_bshd, lens) if bshd else (q, k, v, lens))
    want = decode_attention_reference(q, k, v, lens, q_positions=pos).astype(jnp.float32)
    calls, max_abs_err = {}, {}
    for name, (fn, args) in candidates.items():
        calls[name] = functools.partial(jax.jit(fn), *args)
        got = jax.block_until_ready(calls[name]()).reshape(want.shape).astype(jnp.float32)
        max_abs_err[name] = float(jnp.max(jnp.abs(got - want)))
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, seconds in interleaved_gpu_times(calls, repeats=repeats).items():
            samples[name] += [s * 1e6 for s in seconds]
    median = {name: float(np.median(s)) for name, s in samples.items()}
    kv_bytes = 2 * k.size * k.dtype.itemsize
    return dict(batch=batch, context=context, kv_bytes=kv_bytes, median_us=median,
                over_cudnn={name: t / median["cudnn"] for name, t in median.items()},
                tb_s={name: kv_bytes / (t * 1e-6) / 1e12 for name, t in median.items()},
                max_abs_err=max_abs_err, us=samples)


def main(argv=None):
    from tqdm import tqdm

    from jspec.benchmarking import environment, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="decode_attention_mosaic.json", help="JSON to write")
    parser.add_argument("--shapes", default="16x16384,8x16384,16x4096,32x4096,32x16384",
                        help="BATCHxCONTEXT, comma separated (one query row, Hq 32 / Hkv 8, head_dim 128, bf16)")
    parser.add_argument("--repeats", type=int, default=5, help="cold calls per candidate per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (one profiler trace each)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        parser.error("needs a Hopper GPU: Mosaic GPU kernels have no CPU lowering")
    configs = [dict(block_kv=64, stages=2), dict(block_kv=128, stages=2), dict(block_kv=64, stages=2, layout="bshd")]
    result = dict(
        environment=environment(jnp.bfloat16, 0),
        method="GPU time of all kernels of one call after a 256 MB L2 flush, candidates interleaved in one "
               "profiler trace per round (jspec.benchmarking.interleaved_gpu_times); random bf16 inputs; "
               "uniform lengths = context; one query row at position length - 1",
        candidates={
            "cudnn": "jax.nn.dot_product_attention(implementation='cudnn') on its own [B, S, H, D] layout, "
                     "transposed outside the timed call",
            "cudnn_on_our_cache": "the same, called on our [B, H, S, D] cache: the transpose is in the call",
            "cudnn_bnth": "the cuDNN kernel called on our layout through jax's private fused_attention_stablehlo "
                          "API (qkv_layout='BNTH'; no lengths, so uniform batches only)",
            "triton": "pallas_kernels.decode_attention_pallas, default tiling (the library's kernel)",
            "mosaic_*": "mosaic_decode_attention in this script: TMA ring of `stages` blocks of `block_kv` rows, "
                        "producer + consumer warpgroups, WGMMA; layoutbshd = run on cuDNN's layout",
        },
        check=check([(2, 1024, [1000, 37], {}), (3, 2048, [2048, 1, 700], dict(k_splits=4)),
                     (4, 1024, [0, 1024, 65, 64], dict(k_splits=3, block_kv=128)),
                     (2, 1024, [1000, 37], dict(layout="bnth", block_kv=128, stages=3))]),
        shapes=[],
    )
    print("check:", [(c["max_abs_err"], c["any_nan"]) for c in result["check"]], flush=True)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    for batch, context in tqdm(shapes, desc="shapes"):
        row = time_shape(batch, context, configs, args.repeats, args.rounds)
        result["shapes"].append(row)
        tqdm.write(f"b{batch} x {context}: " + ", ".join(f"{n} {t:.1f}" for n, t in row["median_us"].items()))
        write_json(args.out, result)


if __name__ == "__main__":
    main()
