"""frozen-kv: the Gemma 4 assistant drafter (FrozenKVMTP) against plain decoding.

Random weights made on the device: each ``--targets`` preset and an assistant shaped for it
(:data:`ASSISTANTS`; only the E2B and 26B-A4B assistant shapes are on record, so the 31B
target gets H_a 1024 as the 26B-A4B assistant and E4B gets H_a 256 as the E2B one; 4 layers
``[S, S, S, F]``), or a real assistant with ``--assistant PATH``. Preset targets get
:func:`jspec.bench.presets.confident` weights. For each batch size:

* ``round`` rows: one speculation round for each ``--k`` against one plain decode step, both
  dispatched back to back as donated jitted calls (``spec``'s round timing), with propose and
  verify timed alone for ``--stages-k``;
* ``propose`` rows: the drafter's propose with the seed step as iteration 0 of the draft scan
  (the library's) against the seed as a separate jitted call before a scan of k - 1 steps,
  dispatched back to back (``separate``) and with a host sync between the two
  (``separate_synced``, host glue between two programs); each sample is ``--propose-calls``
  calls back to back;
* ``end_to_end`` rows: ``spec``'s tokens/s against plain decoding at controlled acceptance, the
  per-draft acceptance ``alpha`` solved per k from a target mean acceptance length
  (``--acceptance K:LENGTH``; default SGLang's Gemma-4-31B GSM8K topk-1 figures, 4.48 at 6 draft
  tokens -- read both as k = 5, SGLang's speculative_num_draft_tokens counting the root, and as
  k = 6 -- and 2.54 at 3 steps).

  python -m jspec.bench frozen-kv --out frozen_kv.json --targets gemma-4-31b gemma-4-e4b
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jspec import engine
from jspec.bench import plots, report
from jspec.bench.flags import common, subcommand, tree_arg
from jspec.bench.presets import GREEDY, confident, is_tiny, load_target, weights_note
from jspec.bench.rounds import measure_rounds, spec_state
from jspec.bench.spec import end_to_end
from jspec.bench.timing import time_fn
from jspec.drafters import FrozenKVMTP, assistant_config, init_assistant
from jspec.drafters.base import RoundContext
from jspec.execution import with_kernels
from jspec.tree import TreeShape

# Assistant shapes per target preset (heads: a multiple of the target's KV heads of either type).
ASSISTANTS = {
    "gemma-4-31b": dict(hidden_size=1024, num_heads=32),  # the tied head, as the 26B-A4B assistant
    "gemma-4-e4b": dict(hidden_size=256, num_heads=4, num_centroids=2048, centroid_top_k=32),  # as E2B's
    "tiny-gemma4": dict(hidden_size=32, num_heads=2, num_centroids=16, centroid_top_k=4),
}
SGLANG_ACCEPTANCE = ["5:4.48", "6:4.48", "3:2.54"]


def make_drafter(target, target_name, *, path, dtype, seed, impl) -> FrozenKVMTP:
    if path:
        return FrozenKVMTP.load(path, dtype=dtype).bind(with_kernels(target, impl))
    if target_name not in ASSISTANTS:
        raise SystemExit(f"no assistant shape for {target_name!r}: pass --assistant PATH "
                         f"(shapes for {sorted(ASSISTANTS)})")
    config = assistant_config(target.config, num_layers=4, **ASSISTANTS[target_name])
    assistant = jax.jit(init_assistant, static_argnums=(0, 2))(config, jax.random.key(seed + 1), dtype)
    return FrozenKVMTP(assistant).bind(with_kernels(target, impl))


def alpha_for(k: int, length: float) -> float:
    """The per-token acceptance ``alpha`` whose expected acceptance length ``sum(alpha**i, i <= k)``
    is ``length`` (1 <= length <= k + 1)."""
    if not 1.0 <= length <= k + 1:
        raise SystemExit(f"an acceptance length of {length} is impossible with k = {k} (1 .. {k + 1})")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < length else (lo, mid)
    return (lo + hi) / 2


def acceptance_pair(text: str) -> tuple[int, float]:
    """argparse type: 'K:LENGTH' -> (k, mean acceptance length)."""
    try:
        k, length = text.split(":")
        return int(k), float(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K:LENGTH, e.g. 6:4.48, got {text!r}") from None


# --- propose: the seed folded into the scan vs a separate call ---------------------------------


@functools.partial(jax.jit, static_argnames="k")
def _propose_folded(drafter, ctx, key, k):
    return drafter.propose((), ctx, num_draft_tokens=k, params=GREEDY, key=key)[0]


@jax.jit
def _seed(drafter, target_kv, lengths, root, hidden):
    """The seed step alone: the first draft and the recurrent hidden it hands to the scan."""
    y, hidden = drafter.step(drafter.frozen_kv(target_kv, lengths), root, hidden)
    return drafter.draw(None, y, GREEDY)[0], hidden


@jax.jit
def _after_seed(drafter, target_kv, lengths, first, hidden, keys):
    """Steps 1 .. k-1, from the seed's draft and hidden: all k drafts."""
    rest, _ = drafter.draft_scan(drafter.frozen_kv(target_kv, lengths), first, hidden, keys, GREEDY)
    return jnp.concatenate([first[:, None], rest], axis=1)


def propose_variants(drafter, state, k):
    """``{variant: thunk}`` each returning the k drafts ``[batch, k]`` of one propose."""
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
    key = jax.random.key(0)
    keys = jax.random.split(key, k)[1:]
    kv, lengths, root, hidden = state.target_kv, state.target_kv.lengths, state.root, state.features[0]

    def separate(sync):
        first, h = _seed(drafter, kv, lengths, root, hidden)
        if sync:  # host glue between two programs
            jax.block_until_ready((first, h))
        return _after_seed(drafter, kv, lengths, first, h, keys) if k > 1 else first[:, None]

    return {"folded": lambda: _propose_folded(drafter, ctx, key, k),
            "separate": lambda: separate(False), "separate_synced": lambda: separate(True)}


def measure_propose(drafter, state, ks, *, calls, repeats, tags) -> list[dict]:
    rows = []
    for k in ks:
        variants = propose_variants(drafter, state, k)
        drafts = {name: np.asarray(fn()) for name, fn in variants.items()}
        if not all(np.array_equal(d, drafts["folded"]) for d in drafts.values()):
            raise RuntimeError(f"k={k}: the propose variants disagree on the drafts")
        timings = {name: time_fn(fn, repeats=repeats, calls=calls) for name, fn in variants.items()}
        ms = {name: t.median_s * 1e3 for name, t in timings.items()}
        rows.append(dict(measure="propose", **tags, k=k, folded_ms=ms["folded"], separate_ms=ms["separate"],
                         separate_synced_ms=ms["separate_synced"], saved_ms=ms["separate"] - ms["folded"],
                         saved_synced_ms=ms["separate_synced"] - ms["folded"],
                         timings={name: t.as_dict() for name, t in timings.items()}))
        tqdm.write(f"b={tags['batch']} k={k}: propose folded {ms['folded']:.3f} ms, seed separate "
                   f"{ms['separate']:.3f} ms, separate + host sync {ms['separate_synced']:.3f} ms")
    return rows


# --- the command ---------------------------------------------------------------------------------


def run(args):
    dtype = jnp.dtype(args.dtype)
    env = report.environment(dtype, args.seed, weights=weights_note(args.targets) + (
        f"; assistant: {args.assistant}" if args.assistant else "; assistant: random"))
    rows, notes = [], []

    def save():
        report.write(args.out, report.result("frozen-kv", args.argv, env, rows, notes=" ".join(notes)))

    for name in args.targets:
        target = load_target(name, dtype, args.seed)
        if not args.assistant:  # random weights whose greedy continuation survives bf16 rounding
            target = confident(target, args.seed)
        drafter = make_drafter(target, name, path=args.assistant, dtype=dtype, seed=args.seed, impl=args.impl)
        a = drafter.assistant.config
        head = "tied head" if a.num_centroids is None else f"centroid head ({a.num_centroids}, top {a.centroid_top_k})"
        notes.append(f"{name}: assistant H_a {a.hidden_size}, {a.text.num_layers} layers {list(a.text.layer_types)}, "
                     f"{a.text.num_heads} heads, intermediate {a.text.intermediate_size}, {head}"
                     f"{'' if args.assistant else ', random weights'}.")
        tags = dict(target=name, drafter="frozen_kv_mtp", context=args.context, impl=args.impl,
                    assistant_hidden=a.hidden_size)
        for batch in args.batch:
            k_max = max(args.k + args.propose_k + [k for k, _ in args.acceptance] + [t.num_nodes for t in args.trees]
                        + [1])
            capacity = engine.cache_length(args.context, args.context + 64 + (args.repeats + 8) * (k_max + 1))
            rows += measure_rounds(target, drafter, batch, args.context, args.k, capacity=capacity, impl=args.impl,
                                   repeats=args.repeats, stages_k=args.stages_k, compile_threads=args.compile_threads,
                                   tags=tags, trees=args.trees)
            save()
            state = spec_state(target, drafter, batch, args.context, capacity, args.impl)
            rows += measure_propose(drafter, state, args.propose_k, calls=args.propose_calls, repeats=args.repeats,
                                    tags=dict(tags, batch=batch))
            save()
            for k, length in args.acceptance:
                alpha = alpha_for(k, length)
                e2e_args = argparse.Namespace(**{**vars(args), "k_end_to_end": [k], "alpha": [alpha]})
                rows += [dict(row, target_acceptance_length=length)
                         for row in end_to_end(target, drafter, batch, e2e_args, tags)]
                save()
        del target, drafter
    notes.append("round / decode step: medians of back-to-back donated jitted calls (both dispatched); propose: "
                 "the seed step inside the draft scan (folded) vs a separate jitted call before it; end to end: "
                 "controlled acceptance (a drawn number of drafts per round), alpha solved from the target acceptance length. No real assistant weights were "
                 "reachable here, so the acceptance of rope_position 'bonus' vs 'last_committed' on real weights "
                 "(transformers vs SGLang / vLLM / tpu-inference) is not measured.")
    save()
    plots.spec(report.read(args.out), Path(args.out).with_suffix(".png"))


TINY = dict(targets=lambda targets: [t for t in targets if is_tiny(t)] or ["tiny-gemma4"], context=32, k=[2],
            trees=[TreeShape(2, 2, 3)],
            stages_k=[2], propose_k=[2], acceptance=[(2, 2.5)], new_tokens=28, repeats=2, propose_calls=2)


def register(subparsers):
    parent = common(out_help="JSON output path (a PNG plot is written beside it)", out_required=True, impl="one")
    s = subcommand(subparsers, "frozen-kv", help="the Gemma 4 assistant drafter: round, seed folding, end to end",
                   description=__doc__, run=run, parents=[parent], tiny=TINY)
    s.add_argument("--targets", nargs="+", default=["gemma-4-31b", "gemma-4-e4b"],
                   help=f"Gemma 4 presets with an assistant shape {sorted(ASSISTANTS)}, or checkpoints "
                        "(with --assistant)")
    s.add_argument("--assistant", default=None, help="a gemma4_assistant checkpoint instead of random weights")
    s.add_argument("--batch", type=int, nargs="+", default=[1])
    s.add_argument("--context", type=int, default=512)
    s.add_argument("--k", type=int, nargs="*", default=list(range(1, 9)), help="k values for round timing")
    s.add_argument("--stages-k", type=int, nargs="*", default=[3, 6], help="k values whose stages are timed alone")
    s.add_argument("--propose-k", type=int, nargs="*", default=[1, 3, 6, 8],
                   help="k values for the seed folded vs separate propose timing")
    s.add_argument("--propose-calls", type=int, default=20, help="propose calls back to back per timed sample")
    s.add_argument("--acceptance", type=acceptance_pair, nargs="*",
                   default=[acceptance_pair(p) for p in SGLANG_ACCEPTANCE],
                   help="K:LENGTH pairs: end-to-end runs at k with this mean acceptance length (none: skip)")
    s.add_argument("--trees", type=tree_arg, nargs="*", default=[],
                   help="TOPK:DEPTH:NODES draft trees whose round is timed beside the chains' (e.g. 3:6:12)")
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--compile-threads", type=int, default=8, help="round programs compile in parallel threads")
    return s
