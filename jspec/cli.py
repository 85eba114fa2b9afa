"""Command-line pieces the scripts share: a parser whose errors are one line, argument types."""

from __future__ import annotations

import argparse


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


IMPL_HELP = ("kernel choice: auto, pallas, xla or invariant, optionally with per-kernel exceptions, "
             "e.g. 'auto,skinny_matmul=xla'")


def impl_choice(text: str) -> str:
    """argparse type of ``--impl``: a valid ``impl`` string (``jspec.execution.Kernels``)."""
    from jspec.execution import Kernels

    try:
        Kernels.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
