#!/usr/bin/env python
"""jspec benchmarks: ``python scripts/bench.py <subcommand> ...`` = ``python -m jspec.bench <subcommand> ...``."""

import sys

from jspec.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
