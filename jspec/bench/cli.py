"""jspec benchmarks, one CLI: ``python -m jspec.bench <subcommand> [flags]``.

Subcommands:
  decode    ms/token of the on-device greedy decode loop and its HBM roofline fraction
  spec      one speculation round vs one plain decode step (per k, per stage), and end-to-end
            tokens/s against plain decode at controlled acceptance
  compile   compile time of the whole speculative program for several k
  kernels   Pallas kernel benchmarks and GPU correctness checks (actions: copy-bandwidth, check,
            decode-attention, gather-rows, plot, merge, all)
  matmul    the skinny matmul: correctness, tuning sweep, weight TB/s vs XLA and cuBLAS
  quant-matmul  the quantized skinny matmul: correctness, GPU time and TB/s vs XLA and torch's kernels
  catch-up  the EAGLE-3 round vs a decode step, and the draft catch-up with / without dead-row slicing
  accept    acceptance lengths on real model pairs and prompts (fp32), HF assisted generation as the peer
  gguf-quality  a real GGUF file kept packed vs dequantized to fp32 vs llama.cpp: perplexity, parameter
            bytes, CPU decode tokens/s
  frozen-kv the Gemma 4 assistant drafter: round vs a decode step, the seed folded into the draft
            scan vs a separate call, end to end at SGLang's acceptance lengths
  invariant speculative greedy == plain greedy token for token (bf16, random weights at real
            shapes) under impl=invariant, and the drift under auto

Every subcommand takes, after its name, --tiny (a seconds-long CPU smoke run on tiny shapes),
--out, --dtype, --seed, --repeats, --compile-cache and, where meaningful, --impl. Targets are
presets (random weights generated on the device from the real configs) or checkpoint directories.
Every result is one JSON schema (``jspec.bench.report``): the command, the environment and rows.
"""

from __future__ import annotations

import argparse
import os
import sys

from jspec.bench import (accept, catch_up, compile, decode, frozen_kv, gguf_quality, invariant, kernels, matmul,
                         quant_matmul, spec)
from jspec.bench.flags import apply_tiny

SUBCOMMANDS = (decode, spec, compile, kernels, matmul, quant_matmul, catch_up, frozen_kv, accept, gguf_quality,
               invariant)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jspec.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for module in SUBCOMMANDS:
        module.register(sub)
    return p


# JAX preallocates 75% of each GPU's memory by default: on an 80 GB GPU less than a 70B-shaped
# target's share on two of them. Preallocating more would leave torch no room for the copy-bandwidth
# buffers measured next to it, so the memory is taken as needed, up to 90%: at 95% the CUDA contexts,
# NCCL and torch find no memory left beside XLA's pool and a run can hang.
TENSOR_PARALLEL_MEMORY = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def prepare_environment(args: argparse.Namespace) -> None:
    """Settings that must precede the first use of a device: with ``--tp`` > 1, JAX may take
    most of each GPU, as it needs it (:data:`TENSOR_PARALLEL_MEMORY`), unless the user chose;
    with ``--compile-cache DIR``, every program compiled from here on is kept in DIR, however
    briefly it compiled, and loaded from there when a later run compiles it again."""
    if getattr(args, "tp", 1) > 1:
        for name, value in TENSOR_PARALLEL_MEMORY.items():
            os.environ.setdefault(name, value)
    if getattr(args, "compile_cache", None):
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.abspath(args.compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.argv = argv
    prepare_environment(args)
    if getattr(args, "tiny", False):
        import jax

        jax.config.update("jax_platforms", "cpu")
        apply_tiny(args)
    return args._run(args) or 0
