"""The flags every subcommand shares (a parent parser placed after the subcommand name) and
what ``--tiny`` does to a subcommand's arguments."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from jspec.cli import IMPL_HELP, impl_choice  # noqa: F401 (re-exported for the subcommands)
from jspec.tree import TreeShape

def ints(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32] ('' -> [])."""
    return [int(t) for t in str(text).split(",") if t]


def int_tuples(text: str) -> list[tuple[int, ...]]:
    """'8x1x4096;32x8192' -> [(8, 1, 4096), (32, 8192)] ('' -> [])."""
    return [tuple(ints(t.replace("x", ","))) for t in text.split(";") if t]


def common(*, out_help: str, out_default=None, out_type=str, out_required: bool = False, repeats: int = 10,
           repeats_help: str | None = None, impl: str | None = None, dtype: str = "bfloat16",
           repeats_aliases: tuple[str, ...] = ()):
    """A parent parser with ``--tiny --out --dtype --seed --repeats`` and, where meaningful,
    ``--impl`` (``impl="one"``: one choice; ``"many"``: one or more to compare)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common flags")
    g.add_argument("--tiny", action="store_true", help="seconds-long CPU smoke run on tiny shapes")
    g.add_argument("--out", default=out_default, type=out_type, required=out_required,
                   help=out_help)
    g.add_argument("--dtype", default=dtype, help=f"parameter / input dtype (default {dtype})")
    g.add_argument("--seed", type=int, default=0, help="random seed of weights and inputs (default 0)")
    g.add_argument("--repeats", *repeats_aliases, type=int, default=repeats,
                   help=repeats_help or f"timed samples; the median and p10 / p90 are reported (default {repeats})")
    g.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="keep every compiled program in DIR (JAX's persistent compilation cache), so that a rerun "
                        "loads the same programs instead of compiling them (a Gemma 4 E4B loop row: minutes)")
    if impl == "one":
        g.add_argument("--impl", default="auto", type=impl_choice, help=IMPL_HELP)
    elif impl == "many":
        g.add_argument("--impl", nargs="+", default=["auto"], type=impl_choice,
                       help=IMPL_HELP + "; several to compare them")
    return p


def subcommand(subparsers, name: str, *, help: str, description: str, run: Callable, parents=(),
               command: str | None = None, tiny: dict | None = None) -> argparse.ArgumentParser:
    """A subparser that runs ``run(args)``, with ``tiny`` applied under ``--tiny``."""
    p = subparsers.add_parser(name, help=help, description=description, parents=list(parents),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(_parser=p, _command=command or name, _run=run, _tiny=tiny or {})
    return p


def apply_tiny(args: argparse.Namespace) -> None:
    """Under ``--tiny``: every flag left at its default takes its tiny value; a callable tiny value
    (e.g. keep only tiny presets) filters the flag's value whether given or not."""
    parser = args._parser
    for dest, value in args._tiny.items():
        if callable(value):
            setattr(args, dest, value(getattr(args, dest)))
        elif getattr(args, dest) == parser.get_default(dest):
            setattr(args, dest, value)


def add_tp(parser) -> None:
    """``--tp N``: tensor parallelism over the first N devices (``jspec.shard``); 1: no mesh."""
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel devices: the target (made already placed) and the drafter on a "
                             "one-axis mesh over the first N devices (default 1: no mesh)")


BF16 = "bf16"


def weights_choice(text: str) -> str:
    """argparse type: ``bf16`` (the weights as made) or a quantization scheme (``jspec.quant.Scheme``)."""
    if text == BF16:
        return text
    from jspec.quant import Scheme

    try:
        return Scheme.parse(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_weights(parser, *, many: bool) -> None:
    """``--weights``: the target's (and drafter's) weight format, ``bf16`` or a scheme of ``jspec.quantize``."""
    what = "formats to compare" if many else "format"
    parser.add_argument("--weights", type=weights_choice, nargs="+" if many else None,
                        default=[BF16] if many else BF16,
                        help=f"weight {what}: bf16 (as --dtype makes them) or a jspec.quantize scheme (int8, fp8, "
                             "int4 = int4-g128 with mins, int4-g128-sym, ...), quantized round to nearest on the "
                             "device, every matmul weight and the tables")


def mesh_of(tp: int, weights=BF16):
    """The mesh ``--tp`` asks for (None for 1); a one-line error when there are fewer devices, or
    when ``weights`` (a format or a list of them) are quantized, which a mesh does not place."""
    import jax

    from jspec.sharding import tensor_parallel_mesh

    if tp == 1:
        return None
    if any(fmt != BF16 for fmt in ([weights] if isinstance(weights, str) else weights)):
        raise SystemExit("error: --weights: quantized weights are not placed on a mesh; use --tp 1")
    if not 1 <= tp <= jax.device_count():
        raise SystemExit(f"error: --tp {tp}: this machine has {jax.device_count()} device(s)")
    return tensor_parallel_mesh(jax.devices()[:tp])


def tree_arg(text: str) -> TreeShape:
    """argparse type: 'TOPK:DEPTH:NODES' -> a ``jspec.tree.TreeShape``."""
    try:
        return TreeShape(*(int(part) for part in text.split(":")))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"expected TOPK:DEPTH:NODES (e.g. 3:6:12), got {text!r}: {exc}") from None
