"""invariant: is speculative greedy output plain greedy output, token for token, at real shapes?

For every target x drafter x ``--impl`` x batch: ``jspec.generate`` (plain greedy) and
``jspec.speculative_generate`` (greedy, chains of ``--k`` drafts, or ``--tree`` draft trees) on the
same ragged batch of random prompts, with the same ``impl`` for the target and the drafter. Under ``impl="invariant"``
(batch-invariant kernels: a row's result does not depend on the rows computed with it) the two must
agree bitwise in bf16; the ``auto`` rows show the drift that the mode removes (a verify over k+1
rows rounds differently from a one-row decode step, and near-tied logits flip).

Weights are random (``jspec.init_params``, made on the device) at the presets' real shapes; their
logit margins are small, so rounding differences flip tokens (``--confident``: the wide-margin
weights of ``jspec.bench.presets.confident`` instead). Drafters: ``eagle3`` (a random head of the target's
shapes), ``draft-model`` (a smaller preset of the same vocabulary, :data:`DRAFTS` or ``--draft``),
``self`` (the target drafts for itself: under invariant every draft must be accepted).

One ``invariant`` row each: ``differing_tokens`` (positions of the ``num_tokens = batch x
new_tokens`` new tokens where the two outputs differ), ``first_difference`` (the earliest such
position in any sequence, or null), ``mean_acceptance_length`` (tokens per verify round),
``first_prompt_vs_batch`` (batches above the smallest: the first prompt, the same in every batch,
decoded plainly here against in the smallest batch; under invariant 0 tokens differ),
``all_drafts_accepted`` (self-drafting only; a tree accepts its whole depth only where its node budget
keeps the greedy path, which flat random logits may not: ``--confident``), wall seconds of both calls (the first call, compile
included unless an earlier row compiled the same program; ``--repeats N``: also N warm calls
each). ``--out`` is rewritten after every row.

  python -m jspec.bench invariant --out invariant.json
  python -m jspec.bench invariant --out inv.json --targets llama-3.1-8b --drafters self --batch 8
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

import jspec
from jspec.bench import report
from jspec.bench.flags import common, impl_choice, subcommand, tree_arg
from jspec.bench.presets import PRESETS, confident, is_tiny, load_target, random_prompts, weights_note
from jspec.bench.spec import DRAFTERS, make_drafter
from jspec.bench.timing import time_fn

# A smaller preset of the same vocabulary for --drafters draft-model (--draft adds or overrides pairs).
DRAFTS = {"llama-3.1-8b": "llama-3.2-1b", "llama-3.1-70b": "llama-3.2-1b", "qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b",
          "tiny": "tiny-draft", "tiny-gemma4": "tiny-draft"}
NOTES = ("differing_tokens: positions of the batch x new_tokens new tokens where speculative greedy != plain greedy "
         "(same impl); first_difference: the earliest such position in any sequence; plain_s / spec_s: wall seconds "
         "of the first call, compile included (warm calls in timings with --repeats)")


def ragged_prompts(batch: int, context: int, vocab: int, seed: int, ragged: bool = True) -> list[list[int]]:
    """``batch`` random token-id lists, the first ``context`` long, the others down to about half
    of it (``ragged=False``: all ``context`` long)."""
    tokens = np.asarray(random_prompts(batch, context, vocab, seed))
    lengths = [context - (b * context) // (2 * batch) if ragged else context for b in range(batch)]
    return [tokens[b, :n].tolist() for b, n in enumerate(lengths)]


def compare(plain: list[list[int]], spec: list[list[int]]) -> dict:
    """Where two batches (``batch`` lists of new token ids) differ; a position missing from one side
    counts as differing."""
    differing, first, sequences = 0, None, 0
    for a, b in zip(plain, spec, strict=True):
        width = max(len(a), len(b))
        a, b = (np.pad(np.asarray(x, np.int64), (0, width - len(x)), constant_values=-1) for x in (a, b))
        where = np.flatnonzero(a != b)
        if where.size:
            differing, sequences = differing + int(where.size), sequences + 1
            first = int(where[0]) if first is None else min(first, int(where[0]))
    return dict(num_tokens=sum(len(a) for a in plain), differing_tokens=differing, sequences_differing=sequences,
                first_difference=first)


def timed_call(fn, repeats: int):
    """``(fn(), wall seconds of that first call, Timing of ``repeats`` warm calls or None)``."""
    start = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - start
    return out, seconds, time_fn(fn, warmup=0, repeats=repeats) if repeats > 0 else None


def measure(target, drafter, prompts, plain, args, impl, self_draft: bool) -> dict:
    """One row's figures: speculative greedy generation against the given plain greedy tokens."""
    tree = args.tree
    shape = dict(num_draft_tokens=args.k) if tree is None else dict(
        num_draft_tokens=tree.num_nodes, topk=tree.topk, depth=tree.depth)
    result, spec_s, warm = timed_call(lambda: jspec.speculative_generate(
        target, drafter, prompts, args.new_tokens, impl=impl, **shape), args.repeats)
    rounds, accepted = result.stats["rounds"], result.stats["accepted"]
    row = compare(plain, result.tokens)
    row.update(mean_acceptance_length=float((accepted.sum() + rounds.sum()) / max(rounds.sum(), 1)), spec_s=spec_s)
    if self_draft:  # every round accepts all k drafts (a tree: its depth); only a sequence's last may be cut short
        row["all_drafts_accepted"] = bool((accepted >= (args.k if tree is None else tree.depth) * (rounds - 1)).all())
    if warm is not None:
        row["timings"] = dict(spec=warm.as_dict("s"))
    return row


def draft_of(target: str, args) -> str | None:
    return dict(args.draft).get(target, DRAFTS.get(target))


def rows_of_target(name, args, write) -> None:
    """Every impl x drafter x batch row of one target (``write(row)`` after each); the plain greedy
    tokens of an impl and batch are generated once, for all drafters."""
    dtype = jnp.dtype(args.dtype)
    target = load_target(name, dtype, args.seed)
    if args.confident and name in PRESETS:
        target = confident(target, args.seed)
    vocab = target.config.vocab_size
    prompts = {batch: ragged_prompts(batch, args.context, vocab, args.seed + 2, args.ragged) for batch in args.batch}
    for impl in args.impl:
        plain = {}  # batch -> (tokens, first-call seconds, warm Timing): shared by the drafters
        for kind in args.drafters:
            draft = draft_of(name, args)
            if kind == "draft-model" and draft is None:
                print(f"{name}: no draft model of its vocabulary known (--draft {name}=PRESET): draft-model skipped")
                continue
            drafter = make_drafter(kind, target, draft=draft, dtype=dtype, seed=args.seed, impl=impl)
            for batch in sorted(args.batch):
                if batch not in plain:
                    plain[batch] = timed_call(lambda b=batch: jspec.generate(
                        target, prompts[b], args.new_tokens, impl=impl), args.repeats)
                tokens, plain_s, plain_warm = plain[batch]
                row = dict(measure="invariant", target=name, drafter=kind,
                           **({"draft": draft} if kind == "draft-model" else {}), impl=impl, batch=batch, k=args.k,
                           **({} if args.tree is None else dict(topk=args.tree.topk, depth=args.tree.depth,
                                                                 nodes=args.tree.num_nodes)),
                           new_tokens=args.new_tokens, prompt_lengths=[len(p) for p in prompts[batch]],
                           **measure(target, drafter, prompts[batch], tokens, args, impl, kind == "self"),
                           plain_s=plain_s)
                if plain_warm is not None:
                    row["timings"]["plain"] = plain_warm.as_dict("s")
                smallest = min(args.batch)
                if batch != smallest:  # the first prompt is the same in every batch: its plain output must be too
                    row["first_prompt_vs_batch"] = dict(
                        batch=smallest, **compare([plain[smallest][0][0]], [tokens[0]]))
                write(row)
            del drafter


def _print(row) -> None:
    first = "" if row["first_difference"] is None else f" (first at {row['first_difference']})"
    accepted = "" if "all_drafts_accepted" not in row else f", all drafts accepted: {row['all_drafts_accepted']}"
    alone = row.get("first_prompt_vs_batch")
    alone = "" if alone is None else (f"; first prompt vs batch {alone['batch']}: {alone['differing_tokens']}/"
                                      f"{alone['num_tokens']} differ")
    print(f"{row['target']} {row['drafter']} impl={row['impl']} b={row['batch']}: {row['differing_tokens']}/"
          f"{row['num_tokens']} tokens differ{first}; acceptance length {row['mean_acceptance_length']:.2f}"
          f"{accepted}{alone}; plain {row['plain_s']:.1f} s, spec {row['spec_s']:.1f} s", flush=True)


def run(args):
    drafts = [draft_of(t, args) for t in args.targets] if "draft-model" in args.drafters else []
    names = list(args.targets) + [d for d in drafts if d]
    env = report.environment(args.dtype, args.seed, weights=weights_note(names) + (
        ", confident()" if args.confident else ", jspec.init_params (small logit margins)"))
    rows = []

    def write(row):
        rows.append(row)
        _print(row)
        report.write(args.out, report.result("invariant", args.argv, env, rows, notes=NOTES))

    for name in args.targets:
        rows_of_target(name, args, write)
    invariant = [r for r in rows if r["impl"] == "invariant"]
    differing = sum(r["differing_tokens"] + r.get("first_prompt_vs_batch", {}).get("differing_tokens", 0)
                    for r in invariant)
    if invariant:
        print(f"impl=invariant: {differing} differing tokens over {len(invariant)} rows")
    return 1 if differing else 0  # like `kernels check`: a broken guarantee fails the command


def draft_pairs(text: str) -> tuple[str, str]:
    """argparse type of ``--draft``: 'TARGET=DRAFT'."""
    target, sep, draft = text.partition("=")
    if not sep or not target or not draft:
        raise ValueError(text)
    return target, draft


TINY = dict(targets=lambda ts: [t for t in ts if is_tiny(t)] or ["tiny"], batch=[3], new_tokens=16, context=12,
            k=3, repeats=0)


def register(subparsers):
    parent = common(out_help="JSON output path (rewritten after every row)", out_required=True, repeats=0,
                    repeats_help="warm calls timed after the checked one (default 0: the first call's wall "
                                 "seconds only, compile included)")
    s = subcommand(subparsers, "invariant", help="speculative greedy == plain greedy, token for token, per impl",
                   description=__doc__, run=run, parents=[parent], tiny=TINY)
    s.add_argument("--targets", nargs="+", default=["llama-3.1-8b", "qwen2.5-coder-1.5b"])
    s.add_argument("--drafters", nargs="+", default=["eagle3", "draft-model", "self"], choices=DRAFTERS)
    s.add_argument("--draft", nargs="*", type=draft_pairs, default=[], metavar="TARGET=DRAFT",
                   help=f"draft model of a target for --drafters draft-model (defaults: {DRAFTS})")
    s.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    s.add_argument("--new-tokens", type=int, default=256)
    s.add_argument("--k", type=int, default=4, help="drafts per round (a chain)")
    s.add_argument("--tree", type=tree_arg, default=None, metavar="TOPK:DEPTH:NODES",
                   help="draft trees instead of chains, e.g. 2:4:8")
    s.add_argument("--impl", nargs="+", default=["invariant", "auto"], type=impl_choice,
                   help="kernel modes to compare, target and drafter alike")
    s.add_argument("--context", type=int, default=128, help="the longest prompt's length")
    s.add_argument("--ragged", action=argparse.BooleanOptionalAction, default=True,
                   help="prompts from --context down to about half of it (default) or all --context long")
    s.add_argument("--confident", action="store_true", help="presets.confident weights (wide logit margins)")
    return s
