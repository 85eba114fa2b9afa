"""compile: trace + lower and compile time of the whole speculative program for several k.

``speculative_on_device`` (prefill + a while loop of rounds, the draft steps a ``lax.scan``) of
a preset target and draft model, compiled from abstract shapes (no weights made). k = 1 is
compiled first as a warm-up for one-time compiler set-up (its row says ``warm_up``). Each k is
traced, lowered and compiled ``--repeats`` times (default once), each time from empty JAX caches.

  python -m jspec.bench compile --out benchmarks/compile_time_cpu.json
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jspec import engine, speculative
from jspec.bench import report
from jspec.bench.flags import common, subcommand
from jspec.bench.presets import GREEDY, abstract_target, is_tiny, preset_names
from jspec.bench.timing import Timing
from jspec.drafters import DraftModel
from jspec.execution import with_kernels


def compile_seconds(target, drafter, context, k, impl) -> tuple[float, float]:
    """(trace + lower seconds, trace + lower + compile seconds) of one fresh compile."""
    jax.clear_caches()  # nothing traced, lowered or compiled before is reused
    tokens = jax.ShapeDtypeStruct((1, context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    capacity = engine.cache_length(context, context + 256)
    target = with_kernels(target, impl)
    drafter = drafter.bind(target)
    start = time.perf_counter()
    traced = speculative.speculative_on_device.trace(
        target, drafter, tokens, lengths, jax.random.key(0), jnp.int32(128),
        loop=speculative.Loop(GREEDY, (), k, capacity, capacity),
    )
    lowered = traced.lower()
    lower_s = time.perf_counter() - start
    lowered.compile()
    return lower_s, time.perf_counter() - start


def run(args):
    dtype = jnp.dtype(args.dtype)
    target = abstract_target(args.target, dtype)
    drafter = DraftModel(abstract_target(args.draft, dtype))
    env = report.environment(dtype, args.seed, weights="none (abstract shapes)")
    rows = []
    for k in tqdm([1] + args.k, desc="k"):  # k=1 first: a warm-up for one-time compiler set-up
        samples = [compile_seconds(target, drafter, args.context, k, args.impl) for _ in range(args.repeats)]
        lower, total = Timing.of(s[0] for s in samples), Timing.of(s[1] for s in samples)
        rows.append(dict(measure="compile", target=args.target, draft=args.draft, context=args.context, k=k,
                         warm_up=not rows, trace_lower_s=lower.median_s, total_s=total.median_s,
                         timings=dict(trace_lower=lower.as_dict("s"), total=total.as_dict("s"))))
        tqdm.write(f"k={k}: trace+lower {lower.median_s:.1f} s, with compile {total.median_s:.1f} s")
    report.write(args.out, report.result("compile", args.argv, env, rows))


TINY = dict(target=lambda t: t if is_tiny(t) else "tiny", draft=lambda d: d if is_tiny(d) else "tiny-draft",
            context=32, k=[2])


def register(subparsers):
    parent = common(out_help="JSON output path", out_required=True, impl="one", repeats=1,
                    repeats_help="compiles of each k; the median and p10 / p90 are reported (default 1)")
    c = subcommand(subparsers, "compile", help="compile time of the speculative program vs k", description=__doc__,
                   run=run, parents=[parent], tiny=TINY)
    c.add_argument("--target", default="llama-3.1-8b", help=f"a preset {preset_names()}")
    c.add_argument("--draft", default="llama-3.2-1b", help="the draft model's preset")
    c.add_argument("--context", type=int, default=512)
    c.add_argument("--k", type=int, nargs="+", default=[2, 8])
    return c
