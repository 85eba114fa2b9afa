"""The tilings ``quant-matmul --sweep`` tries (``jspec.bench.quant_matmul``): a grid of column tiles, K
steps and split-K, then (``--sweep-refine``) the best two again with other warps, stages and longer
K steps."""

from __future__ import annotations

import dataclasses


def candidates(fmt, m, k, n):
    """Tilings the sweep tries: column tiles 32..256, K steps of 64..256 bytes a column, split-K to
    about two waves of programs; over a short K (under 1024: SmolLM2's 576, Qwen2.5-0.5B's 896) one
    split of 16..64-column tiles instead, as the bf16 kernel's short-K tiling has it; for up to
    ``GEMV_MAX_M`` rows the same without a dot (``gemv``). The default tiling is timed as ``kernel``
    anyway."""
    from jax.experimental import pallas as pl

    from pallas_kernels.matmul import quantized_kernel as qk
    from pallas_kernels.matmul.skinny_tilings import GEMV_MAX_M, SHORT_K, SkinnyConfig

    per_byte = 2 if fmt.startswith("int4") else 1 if fmt != "bf16" else 0.5
    loader = None if fmt == "bf16" else qk.quantized_loader(*abstract_parts(fmt, k, n))[0]
    short_k = k < SHORT_K
    out = []
    for gemv in (False, True) if m <= GEMV_MAX_M else (False,):
        for block_n in (16, 32, 64) if short_k else (32, 64, 128, 256):
            for step_bytes in (64, 128, 256):
                block_k = int(step_bytes * per_byte)
                if block_k > k or (loader and loader.substep(block_k) < qk._MIN_SUBSTEP[loader.format]):
                    continue
                split = 1
                while not short_k and pl.cdiv(n, block_n) * split < 2 * 132 and pl.cdiv(k, 2 * split) >= 2 * block_k:
                    split *= 2
                warps = 8 if block_n * block_k >= 256 * 256 else 4
                out.append(SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=warps,
                                        num_stages=4, gemv=gemv))
    return list(dict.fromkeys(out))


def tiling(config) -> str:
    """A tiling in a few characters: ``n32 k256 s1 w4 st4 gemv``."""
    return (f"n{config.block_n} k{config.block_k} s{config.split_k} w{config.num_warps} st{config.num_stages}"
            + (" gemv" if config.gemv else ""))


def abstract_parts(fmt, k, n):
    import jax
    import jax.numpy as jnp

    from jspec.quant import Scheme

    s = Scheme.parse(fmt)
    groups = k // (s.group_size or k)
    dtype = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[s.format]
    values = jax.ShapeDtypeStruct((k // 2 if s.format == "int4" else k, n), dtype)
    return values, jax.ShapeDtypeStruct((groups, n), jnp.bfloat16), None


def refined(ranked, k):
    """More tilings around the two best of ``ranked`` (fastest first): 2 / 4 / 8 warps x 2 / 3 / 5
    stages, and K steps two and four times as long at 4 and 8 warps."""
    out = []
    for config in ranked[:2]:
        out += [dataclasses.replace(config, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3, 5)]
        out += [dataclasses.replace(config, num_warps=w, block_k=config.block_k * f) for w in (4, 8) for f in (2, 4)
                if config.block_k * f * config.split_k <= k]
    return [c for c in dict.fromkeys(out) if c not in ranked]
