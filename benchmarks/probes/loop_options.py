"""The on-device decode loop under other XLA compiler options, one process, one set of weights:
ms/token of ``engine.generate_on_device`` compiled with the library's options plus each variant's
(e.g. ``{"xla_gpu_enable_pdl": true}``: programmatic dependent launch, which lets a kernel start
while the one before it drains). Batch 1, bf16 random weights. H100::

    PYTHONPATH=. python benchmarks/probes/loop_options.py gemma-4-e4b llama-3.2-1b \\
        --variants '[{}, {"xla_gpu_enable_pdl": true}]'   # writes $OUT/loop_options.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from jspec import engine
from jspec.bench.decode import measure_decode_loop
from jspec.bench.presets import load_target
from jspec.compile_options import LOOP_COMPILER_OPTIONS

LIBRARY_LOOP = engine.generate_on_device


def loop_with(options: dict):
    """``generate_on_device`` compiled with the library's options updated by ``options``."""
    return jax.jit(LIBRARY_LOOP.__wrapped__, static_argnames=("params", "eos_ids", "output_width", "max_len", "impl"),
                   compiler_options={**LOOP_COMPILER_OPTIONS, **options})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("targets", nargs="+")
    parser.add_argument("--variants", default='[{}, {"xla_gpu_enable_pdl": true}]')
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    variants = json.loads(args.variants)
    out = os.path.join(os.environ.get("OUT", "/tmp"), "loop_options.json")
    rows = []
    for target in args.targets:
        model = load_target(target, jnp.bfloat16, 0, None)
        for options in variants:
            engine.generate_on_device = loop_with(options)
            try:
                per_token, _, _ = measure_decode_loop(model, 1, args.context, steps=args.steps, impl="auto",
                                                      repeats=args.repeats)
                row = dict(target=target, options=options, ms_per_token=per_token * 1e3)
            except Exception as exc:  # noqa: BLE001 - an option XLA refuses: recorded, the next one runs
                row = dict(target=target, options=options, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            finally:
                engine.generate_on_device = LIBRARY_LOOP
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(out, "w") as f:
                json.dump(dict(notes="ms/token of the on-device decode loop, batch 1, bf16 random weights, "
                                     f"context {args.context}, {args.steps} steps", rows=rows), f, indent=1)
        del model


if __name__ == "__main__":
    main()
