#!/usr/bin/env python
"""Convert an HF checkpoint directory (config.json + safetensors) to a jspec orbax checkpoint."""

from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", metavar="SRC", help="HF checkpoint directory")
    parser.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="parameter dtype (default: as stored)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it holds a checkpoint")
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    import jspec

    dtype = getattr(jnp, args.dtype) if args.dtype else None
    try:
        model = jspec.load_hf(args.src, dtype=dtype, progress=True)
        jspec.save(model, args.dst, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as e:
        parser.exit(2, f"error: {e}\n")
    c = model.config
    print(f"wrote {c.architecture} ({c.num_layers} layers, vocab {c.vocab_size}, {model.dtype}) to {args.dst}")


if __name__ == "__main__":
    main()
