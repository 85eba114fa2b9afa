"""catch-up: the EAGLE-3 speculation round vs plain decode, and the draft catch-up with and
without dead-row slicing.

Random weights made on the device: a ``--target`` preset (default Llama-3.1-8B) and an
EAGLE-3-shaped head for it (one layer of the target's shapes reading 2 x hidden, fc 3 x hidden
-> hidden, a 32k draft vocabulary). For each batch size (medians over repeats after warm-up):

* ``round`` rows: one speculation round for each k in ``--ks`` and each draft tree of ``--trees``
  (EAGLE-2 expansion, ``propose_tree``) against one plain decode step (the round timing of
  ``spec``); trees and the chains of ``--stages-k`` also get their propose (the draft time) and
  verify timed alone;
* ``catch_up`` rows: the draft catch-up over k+1 verify rows plus the head for the next first
  draft, in three variants: ``sliced`` (the library's: rows cut to the last accepted one right
  after the K/V write), ``layer_unsliced`` (the whole layer over all rows, the head on the kept
  row), ``unsliced`` (layer, final norm and LM head over all rows, then the row is picked).
  Sub-millisecond programs: each sample is ``--catch-up-calls`` calls issued back to back.

Random weights accept ~no drafts, so rounds advance one token; a round's time does not depend
on how many drafts are accepted (all k+1 rows are verified and caught up).

  python -m jspec.bench catch-up --out eagle3_round.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec.bench import report
from jspec.bench.flags import common, subcommand, tree_arg
from jspec.bench.presets import is_tiny, load_target, weights_note
from jspec.bench.rounds import measure_rounds
from jspec.bench.spec import eagle3_drafter
from jspec.bench.timing import compile_all, time_steps
from jspec.kv import KVCache
from jspec.tree import TreeShape
from pallas_kernels import gather_rows


def sliced(drafter, kv, base, tokens, features, last):
    """The library's catch-up: rows past the kept one are dropped right after the K/V write."""
    state = drafter.catch_up(kv, base, tokens, features, last)
    return state.kv, state.hidden, drafter.head_logits(state.hidden)


def _all_rows(drafter, kv, base, tokens, features):
    """The layer over every catch-up row (K/V of all rows written): ``x [B, T, H]``."""
    return drafter.run_rows(kv.truncate(base), tokens, drafter.target_features(features), from_target=True)


def layer_unsliced(drafter, kv, base, tokens, features, last):
    """All rows through the whole layer, then the kept row is gathered and the head run on it."""
    x, kv = _all_rows(drafter, kv, base, tokens, features)
    hidden = gather_rows(x, last, impl=drafter.execution.kernels)
    return kv.truncate(base + last + 1), hidden, drafter.head_logits(hidden)


def unsliced(drafter, kv, base, tokens, features, last):
    """All rows through the layer, the final norm and the LM head; the kept row picked last."""
    x, kv = _all_rows(drafter, kv, base, tokens, features)
    logits = drafter.head_logits(x)  # [B, T, V_draft]
    idx = last[:, None, None]
    hidden = jnp.take_along_axis(x, idx, axis=1)[:, 0]
    return kv.truncate(base + last + 1), hidden, jnp.take_along_axis(logits, idx, axis=1)[:, 0]


VARIANTS = {"sliced": sliced, "layer_unsliced": layer_unsliced, "unsliced": unsliced}
_catch_up = jax.jit(lambda variant, *args: VARIANTS[variant](*args), static_argnums=0, donate_argnums=2)


def draft_cache(drafter, batch, max_len, context, dtype) -> KVCache:
    """The head's one-layer cache holding ``context`` rows."""
    c = drafter.head.config.layer
    return KVCache.zeros(1, batch, c.num_kv_heads, max_len, c.head_dim, dtype).advance(context)


def catch_up_inputs(drafter, target, batch, k, context, dtype):
    """Random verify tokens and target features of k+1 rows; the kept row varies by sequence."""
    rows, hidden = k + 1, target.config.hidden_size
    base = jnp.full((batch,), context, jnp.int32)
    tokens = jax.random.randint(jax.random.key(5), (batch, rows), 0, target.config.vocab_size, jnp.int32)
    features = tuple(jax.random.normal(jax.random.key(6 + i), (batch, rows, hidden), dtype)
                     for i in range(len(drafter.capture.residuals)))
    last = jnp.asarray(np.arange(batch) % rows, jnp.int32)
    return base, tokens, features, last


def run(args):
    dtype = jnp.dtype(args.dtype)
    target = load_target(args.target, dtype, args.seed)
    drafter = eagle3_drafter(target, dtype, jax.random.key(args.seed + 1), args.impl)
    widest = max(args.ks + [max(t.num_nodes, t.fed_rows) for t in args.trees])
    max_len = -(-(args.context + (args.warmup + args.repeats + 2) * (widest + 2) * 2) // 128) * 128
    env = report.environment(dtype, args.seed, weights=weights_note([args.target]))
    tags = dict(target=args.target, drafter="eagle3", context=args.context, impl=args.impl, cache_max_len=max_len)
    rows = []

    def save():  # partial results survive a time limit
        report.write(args.out, report.result("catch-up", args.argv, env, rows))

    inputs = {(b, k): catch_up_inputs(drafter, target, b, k, args.context, dtype)
              for b in args.batches for k in args.catch_up_ks}
    lowered = {(b, k, v): _catch_up.lower(v, drafter, jax.eval_shape(lambda b=b: draft_cache(drafter, b, max_len,
                                                                                               args.context, dtype)),
                                          *inputs[b, k])
               for b, k in inputs for v in VARIANTS}
    compiled = compile_all(lowered, args.compile_threads)
    for b in args.batches:
        if not args.catch_up_only:
            rows += measure_rounds(target, drafter, b, args.context, args.ks, capacity=max_len, impl=args.impl,
                                   repeats=args.repeats, warmup=args.warmup, compile_threads=args.compile_threads,
                                   tags=tags, trees=args.trees, stages_k=tuple(args.stages_k) + tuple(args.trees))
            save()
        for k in tqdm(args.catch_up_ks, desc=f"catch-up (batch {b})"):
            row = dict(measure="catch_up", **tags, batch=b, k=k, timings={})
            for variant in VARIANTS:
                exe = compiled[b, k, variant]
                timing, _ = time_steps(lambda kv, exe=exe: exe(drafter, kv, *inputs[b, k])[0],
                                       draft_cache(drafter, b, max_len, args.context, dtype), warmup=args.warmup,
                                       repeats=args.repeats, calls=args.catch_up_calls)
                row[f"{variant}_ms"] = timing.median_s * 1e3
                row["timings"][variant] = timing.as_dict()
            row["unsliced_over_sliced"] = row["unsliced_ms"] / row["sliced_ms"]
            rows.append(row)
            save()
            tqdm.write(f"b={b} k={k} catch-up: " + " ".join(f"{v}={row[f'{v}_ms']:.3f}ms" for v in VARIANTS))
    print(f"wrote {args.out}")


TINY = dict(target=lambda t: t if is_tiny(t) else "tiny", dtype="float32", batches=[1], ks=[2], catch_up_ks=[2],
            trees=[TreeShape(2, 2, 3)],
            context=32, warmup=1, repeats=2, catch_up_calls=2)


def register(subparsers):
    parent = common(out_help="JSON output path (default eagle3_round.json)",
                    out_default="eagle3_round.json", repeats=20, impl="one")
    c = subcommand(subparsers, "catch-up", help="EAGLE-3 round vs decode step; draft catch-up sliced or not",
                   description=__doc__, run=run, parents=[parent], tiny=TINY)
    c.add_argument("--target", default="llama-3.1-8b", help="target preset (the head takes its shapes)")
    c.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    c.add_argument("--ks", type=int, nargs="*", default=list(range(1, 9)), help="draft lengths k of the rounds")
    c.add_argument("--stages-k", type=int, nargs="*", default=[], help="chains whose propose and verify are timed alone")
    c.add_argument("--trees", type=tree_arg, nargs="*", default=[],
                   help="TOPK:DEPTH:NODES draft trees whose round, propose and verify are timed (e.g. 4:6:32)")
    c.add_argument("--catch-up-ks", type=int, nargs="+", default=[1, 2, 4, 8])
    c.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--compile-threads", type=int, default=8, help="XLA compiles run in parallel threads")
    c.add_argument("--catch-up-only", action="store_true", help="measure only the catch-up step")
    c.add_argument("--catch-up-calls", type=int, default=50,
                   help="catch-up calls per timing sample, issued back to back (sub-ms programs: host sync "
                        "would dominate)")
    return c
