"""spec: one speculation round vs one plain decode step, and end-to-end speed-up.

* ``round`` rows (:mod:`jspec.bench.rounds`): one jitted round (propose k drafts, verify k+1 rows, accept, commit; state
  donated) for each ``--k``, against one plain decode step (medians of back-to-back calls);
  for ``--stages-k`` also propose and verify timed alone as separate programs, accept +
  commit = round - propose - verify, and on a GPU the kernels of one round, its propose, its verify
  and one decode step side by side (``profiles``: ``jspec.bench.decode.kernel_profile``; the profiler
  does not see the kernels inside a loop, the propose's draft scan included). The propose is also
  timed inside an on-device loop of proposes (``propose_in_loop_ms``: (T(16) - T(1)) / 15, compiled
  as generation's loops are, so no host between its draft steps), less one iteration of the same
  loop with an empty body (``loop_iteration_ms``: generation pays it once a round):
  ``propose_net_ms``; ``propose_fraction_of_copy``: the bytes the propose reads
  (``propose_bytes``) over that net time and this run's copy bandwidth (the JSON's ``copy_bandwidth``). ``roofline_ratio``:
  the least a round can cost against a step when both stream their bytes at one bandwidth
  (:func:`jspec.bench.roofline.round_roofline_ratio`; the drafter's reads on top of the step's).
* ``end_to_end`` rows: tokens/s of ``speculative_generate``'s on-device loop against plain
  decoding (``(n - 1) / (T(n) - T(1))``), at controlled acceptance: the real drafter proposes and
  the target verifies, but the round accepts a drawn number of drafts, each with probability
  ``alpha`` (:class:`jspec.bench.controlled.ControlledAcceptance`; ``--alpha -1``: greedy
  verification, the drafter's own acceptance). ``round_over_step_in_loop`` = acceptance length /
  speed-up: a round against a plain step, both inside their on-device loops; the best speed-up
  the bandwidth allows is acceptance length / ``roofline_ratio``. ``--k-end-to-end policy``: at
  each batch and alpha, the k that ``jspec.policy`` picks from this run's round rows at that batch
  for a static batch of ``--new-tokens`` each (straggler-corrected; ``k_source`` "policy", else
  "given"); a k of 0 is plain decoding, recorded as such (speed-up 1, no speculative timings).
* ``policy`` rows: the k that ``jspec.policy`` picks from the measured round costs.
* ``--hf``: HF transformers on the same shapes (``hf_peer`` / ``hf_ratio`` rows).

Preset targets get :func:`jspec.bench.presets.confident` weights (a drafter's own acceptance, e.g.
self-drafting at ``--alpha -1``, then survives bf16 rounding). Writes ``--out`` and a PNG.

  python -m jspec.bench spec --out spec.json --target llama-3.1-8b --drafter eagle3 --k 2 4
  python -m jspec.bench spec --out spec.json --drafter eagle3 --k 1 2 4 --k-end-to-end policy --alpha 0.6 0.8
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import jspec
from jspec import engine, speculative
from jspec.bench import decode, plots, report
from jspec.bench.flags import BF16, add_tp, add_weights, common, mesh_of, subcommand
from jspec.bench.controlled import ACCEPTANCE_METHOD, ControlledAcceptance, expected_acceptance_length
from jspec.bench.presets import GREEDY, PRESETS, confident, is_tiny, load_target, random_prompts, weights_note
from jspec.bench.roofline import copy_bandwidth, round_roofline_ratio
from jspec.bench.rounds import PROPOSES_IN_LOOP, measure_rounds
from jspec.bench.timing import time_fn
from jspec.drafters import (MTP, DFlash, DFlashConfig, DraftModel, Eagle3, Eagle3Config, NGram, init_dflash_head,
                            init_eagle3_head, init_mtp_head)
from jspec.drafters.dflash import default_target_layer_ids
from jspec.execution import with_kernels
from jspec.policy import choose_for_batch, round_costs_by_batch

DRAFTERS = ("draft-model", "self", "ngram", "eagle3", "mtp", "dflash")
DFLASH_LAYERS, DFLASH_BLOCK = 5, 16  # the published Qwen3-8B-DFlash-b16 shapes
POLICY = "policy"  # --k-end-to-end: the k jspec.policy picks from this run's round costs


def k_or_policy(text: str) -> int | str:
    """argparse type of ``--k-end-to-end``: a number of draft tokens, or the word ``policy``."""
    return POLICY if text == POLICY else int(text)


def check_policy_args(args) -> None:
    """``--k-end-to-end policy`` chooses among ``--k`` from their round costs at a controlled alpha:
    a ``ValueError`` (before anything is loaded or compiled) where there is nothing to choose from."""
    if POLICY not in args.k_end_to_end:
        return
    if not args.k:
        raise ValueError("--k-end-to-end policy chooses k from this run's round costs: give --k at least one value")
    if not all(0.0 <= alpha <= 1.0 for alpha in args.alpha):
        raise ValueError(f"--k-end-to-end policy chooses k for a controlled alpha in [0, 1], got --alpha {args.alpha}")


def end_to_end_k_max(args) -> int:
    """The largest k an end-to-end run may take: the given ones and, for ``policy``, any of ``--k``."""
    given = [k for k in args.k_end_to_end if k != POLICY]
    return max(given + (args.k if POLICY in args.k_end_to_end else []))


def end_to_end_ks(args, round_rows, batch, alpha) -> list[tuple[str, int]]:
    """``(k_source, k)`` for each entry of ``--k-end-to-end``: a number as "given"; ``policy`` as the
    k (0: plain decoding) jspec.policy picks from ``round_rows`` at ``batch`` and ``alpha`` for a static
    batch of ``args.new_tokens`` each."""
    costs = round_costs_by_batch(round_rows)
    return [("policy", choose_for_batch(costs, batch, alpha, new_tokens=args.new_tokens)) if k == POLICY
            else ("given", k) for k in args.k_end_to_end]


def eagle3_drafter(target, dtype, key, impl="auto") -> Eagle3:
    """An EAGLE-3-shaped head for ``target``: one layer of the target's shapes, RoPE theta 1e4,
    a 32k draft vocabulary (as published), the default captured layers where the target has 5+."""
    layer = dataclasses.replace(target.config, num_layers=1, rope_theta=10000.0, rope_scaling=None)
    depth = target.config.num_layers  # the default layers [2, L//2, L-3] need L >= 5
    config = Eagle3Config(layer=layer, draft_vocab_size=min(32000, layer.vocab_size),
                          target_hidden_size=target.config.hidden_size,
                          aux_layers=None if depth >= 5 else (0, depth // 2, depth - 1))
    head = jax.jit(init_eagle3_head, static_argnums=(0, 2))(config, key, dtype)
    return Eagle3(head).bind(with_kernels(target, impl))


def dflash_drafter(target, dtype, key, impl="auto") -> DFlash:
    """A DFlash-shaped draft for ``target``: ``DFLASH_LAYERS`` Qwen3 layers of the target's shapes,
    block ``DFLASH_BLOCK``, the published default target layers (Qwen3-8B: 1, 9, 17, 25, 33; every
    layer of a target too shallow for them)."""
    depth = target.config.num_layers
    layer = dataclasses.replace(target.config, num_layers=DFLASH_LAYERS, qk_norm=True, qkv_bias=False,
                                architecture="Qwen3ForCausalLM")
    ids = default_target_layer_ids(depth, DFLASH_LAYERS) if depth >= DFLASH_LAYERS + 3 else tuple(range(depth))
    config = DFlashConfig(layer=layer, block_size=DFLASH_BLOCK, mask_token_id=target.config.vocab_size - 1,
                          target_layer_ids=ids, num_target_layers=depth)
    head = jax.jit(init_dflash_head, static_argnums=(0, 2))(config, key, dtype)
    return DFlash(head).bind(with_kernels(target, impl))


def make_drafter(kind, target, *, draft, dtype, seed, impl):
    """A drafter of ``kind`` bound to ``target`` on the kernels ``impl``."""
    target = with_kernels(target, impl)
    if kind == "draft-model":
        return DraftModel(load_target(draft, dtype, seed + 1)).bind(target)
    if kind == "self":
        return DraftModel(target).bind(target)
    if kind == "ngram":
        return NGram()
    key = jax.random.key(seed + 1)
    if kind == "eagle3":
        return eagle3_drafter(target, dtype, key, impl)
    if kind == "mtp":
        return MTP(jax.jit(init_mtp_head, static_argnums=(0, 2))(target.config, key, dtype)).bind(target)
    if kind == "dflash":
        return dflash_drafter(target, dtype, key, impl)
    raise SystemExit(f"unknown drafter {kind!r}")


def end_to_end(target, drafter, batch, args, tags, round_rows=()) -> list[dict]:
    """tokens/s of speculative_generate's on-device loop vs generate's, at controlled acceptance, for
    each k of ``args.k_end_to_end`` (``policy``: chosen from ``round_rows``, this run's round rows at
    ``batch``; see :func:`end_to_end_ks`). At k = 0 one decodes plainly: the row has the plain speed."""
    n, context, vocab = args.new_tokens, args.context, target.config.vocab_size
    target = with_kernels(target, args.impl)
    drafter = drafter.bind(target)
    ks_by_alpha = {alpha: end_to_end_ks(args, round_rows, batch, alpha) for alpha in args.alpha}
    plain, width = decode.plain_loop(target, batch, context, n, args.impl, seed=1)
    t1, tn = time_fn(lambda: plain(1), repeats=args.repeats), time_fn(lambda: plain(n), repeats=args.repeats)
    plain_tps = batch * (n - 1) / (tn.median_s - t1.median_s)
    plain_timings = {"plain_1_token": t1.as_dict(), f"plain_{n}_tokens": tn.as_dict()}
    prompts = random_prompts(batch, context, vocab, 1)
    lengths = jnp.full((batch,), context, jnp.int32)
    capacity = engine.cache_length(context, context + width + end_to_end_k_max(args) + 1)
    rows = []
    for alpha in tqdm(args.alpha, desc="alpha"):
        # alpha < 0: the drafter's own acceptance under greedy verification (e.g. --drafter self)
        acceptance = None if alpha < 0 else ControlledAcceptance(jnp.float32(alpha))
        for k_source, k in ks_by_alpha[alpha]:
            row = dict(measure="end_to_end", **tags, batch=batch, alpha=alpha, k=k, k_source=k_source, new_tokens=n,
                       acceptance_method=ACCEPTANCE_METHOD if alpha >= 0 else "the drafter's own, greedy verification",
                       expected_acceptance_length=None if alpha < 0 else expected_acceptance_length(alpha, k))
            label = f"b={batch} alpha={alpha} " + ("policy " if k_source == "policy" else "") + f"k={k}"
            if k == 0:
                rows.append(dict(row, mean_acceptance_length=1.0, spec_tokens_per_s=plain_tps,
                                 plain_tokens_per_s=plain_tps, speedup=1.0, timings=plain_timings))
                tqdm.write(f"{label}: plain decoding, {plain_tps:.1f} tok/s")
                continue
            spec = lambda m, k=k: speculative.speculative_on_device(  # noqa: E731
                target, drafter, prompts, lengths, jax.random.key(0), jnp.int32(m),
                loop=speculative.Loop(GREEDY, (), k, capacity, capacity), acceptance=acceptance,
            )
            s1, sn = time_fn(lambda: spec(1), repeats=args.repeats), time_fn(lambda: spec(n), repeats=args.repeats)
            _, _, rounds, accepted = spec(n)
            spec_tps = batch * (n - 1) / (sn.median_s - s1.median_s)
            rounds, accepted = np.asarray(rounds).sum(), np.asarray(accepted).sum()
            rows.append(dict(
                row, mean_acceptance_length=float((accepted + rounds) / max(rounds, 1)),
                spec_tokens_per_s=spec_tps, plain_tokens_per_s=plain_tps,
                speedup=spec_tps / plain_tps,
                # A round in the loop against a plain step in the loop: (tokens per round) / speed-up.
                round_over_step_in_loop=float((accepted + rounds) / max(rounds, 1)) * plain_tps / spec_tps,
                roofline_ratio=round_roofline_ratio(target, drafter, k, batch, context),
                timings={"spec_1_token": s1.as_dict(), f"spec_{n}_tokens": sn.as_dict(), **plain_timings},
            ))
            last = rows[-1]
            tqdm.write(f"{label}: {spec_tps:.1f} tok/s vs plain {plain_tps:.1f} "
                       f"({spec_tps / plain_tps:.2f}x), acceptance length {last['mean_acceptance_length']:.2f}, "
                       f"a round {last['round_over_step_in_loop']:.2f}x a step in the loop"
                       + (f" (bound {last['roofline_ratio']:.2f}x)" if last["roofline_ratio"] else ""))
    return rows


def policy_rows(rounds, new_tokens) -> list[dict]:
    """The k jspec.policy picks per batch and acceptance rate: per round (continuous batching),
    and for whole batches of ``new_tokens`` each (straggler-corrected)."""
    by_batch = round_costs_by_batch(rounds)
    batches = sorted({2**i for i in range(max(by_batch).bit_length())} | set(by_batch))
    return [dict(measure="policy", batch=batch, alpha=alpha, new_tokens=tokens,
                 k=choose_for_batch(by_batch, batch, alpha, new_tokens=tokens))
            for tokens in (None, new_tokens) for batch in batches for alpha in (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)]


def hf_rows(target, drafter, end_to_end_rows, args, env) -> list[dict]:
    """HF transformers on the same shapes in the same run, and jspec / HF ratios (batch 1)."""
    from jspec.bench import hf_peer

    draft_config = drafter.model.config if isinstance(drafter, DraftModel) else None
    k = end_to_end_k_max(args)
    prompt = np.asarray(random_prompts(1, args.context, target.config.vocab_size, 1)).tolist()
    versions, peers = hf_peer.peer_results(target.config, draft_config, prompt, new_tokens=args.new_tokens,
                                           k=k, repeats=max(2, args.repeats // 3), seed=args.seed)
    env.update(versions)
    tps = {row["variant"]: row.get("tokens_per_s") for row in peers}
    ours = [r for r in end_to_end_rows if r["batch"] == 1]
    ratios = {}
    if ours and tps.get("eager_dynamic_cache"):
        ratios["plain_jspec_over_hf_eager"] = ours[0]["plain_tokens_per_s"] / tps["eager_dynamic_cache"]
    if ours and tps.get("static_cache_compiled"):
        ratios["plain_jspec_over_hf_static_compiled"] = ours[0]["plain_tokens_per_s"] / tps["static_cache_compiled"]
    # Random weights: HF's draft model accepts ~nothing, matched by controlled acceptance at alpha = 0.
    zero = [r for r in ours if r["alpha"] == 0.0 and r["k"] == k]
    if zero and tps.get("assisted_draft_model"):
        ratios["spec_alpha0_jspec_over_hf_assisted_draft"] = zero[0]["spec_tokens_per_s"] / tps["assisted_draft_model"]
    tqdm.write(f"HF peer: {tps}\nratios: {ratios}")
    return peers + [dict(measure="hf_ratio", ratio=name, value=value) for name, value in ratios.items()]


def run(args):
    check_policy_args(args)
    dtype = jnp.dtype(args.dtype)
    mesh = mesh_of(args.tp, args.weights)
    target = load_target(args.target, dtype, args.seed, mesh)
    if args.target in PRESETS:  # random weights whose greedy continuation survives bf16 rounding
        target = confident(target, args.seed)
    drafter = make_drafter(args.drafter, target, draft=args.draft, dtype=dtype, seed=args.seed, impl=args.impl)
    if args.weights != BF16:  # after confident(), which rewrites bf16 weights; the drafter reads the target's tables
        target = jspec.quantize(target, args.weights)
        drafter = jspec.quantize(drafter.bind(target), args.weights)
    if mesh is not None:  # confident() made new arrays: place them (and the drafter) again
        target, drafter = jspec.shard(target, mesh), jspec.shard(drafter, mesh)
    names = [args.target] + ([args.draft] if args.drafter == "draft-model" else [])
    env = report.environment(dtype, args.seed, weights=weights_note(names))
    tags = dict(target=args.target, drafter=args.drafter, context=args.context, impl=args.impl, tp=args.tp,
                weights=args.weights)
    if args.drafter == "draft-model":
        tags["draft"] = args.draft
    rows = []
    # The propose's bandwidth roofline needs the copy bandwidth of this run (the stages' rows use it).
    copy = copy_bandwidth(args.copy_bytes) if args.stages_k else None

    def save():  # after each stage of each batch: a compile that runs out of time loses nothing measured
        result = report.result("spec", args.argv, env, rows, copy_bandwidth=copy, notes=(
            "round / decode step: medians of back-to-back donated jitted calls; stages: separate jitted programs "
            "(propose; verify forward of k+1 rows), accept_commit = round - propose - verify; "
            f"propose_in_loop_ms: (T({PROPOSES_IN_LOOP}) - T(1)) / {PROPOSES_IN_LOOP - 1} of proposes back to back in one "
            "on-device loop (the draft cache carried through it, updated in place); loop_iteration_ms: the same for "
            "an empty body; propose_net_ms: their difference; "
            "propose_fraction_of_copy: propose_bytes / propose_net_ms / this run's copy bandwidth"))
        report.write(args.out, result)
        return result

    for batch in args.batch:
        capacity = engine.cache_length(args.context, args.context + 64 + (args.repeats + 8) * (max(args.k + [1]) + 1))
        round_rows = measure_rounds(target, drafter, batch, args.context, args.k, capacity=capacity,
                                    impl=args.impl, repeats=args.repeats, stages_k=args.stages_k,
                                    compile_threads=args.compile_threads, tags=tags,
                                    copy_bytes_per_s=copy and copy["bytes_per_s"])
        rows += round_rows
        save()
        if args.alpha:
            rows += end_to_end(target, drafter, batch, args, tags, round_rows)
            save()
    rounds = [row for row in rows if row["measure"] == "round"]
    if rounds:
        rows += policy_rows(rounds, args.new_tokens)
    if args.hf:
        rows += hf_rows(target, drafter, [row for row in rows if row["measure"] == "end_to_end"], args, env)
    result = save()
    plots.spec(result, Path(args.out).with_suffix(".png"))


TINY = dict(target=lambda t: t if is_tiny(t) else "tiny", draft=lambda d: d if is_tiny(d) else "tiny-draft", context=32,
            k=[2], new_tokens=28,
            k_end_to_end=[2], alpha=[0.8], stages_k=[2], repeats=2, copy_bytes=1 << 22)


def register(subparsers):
    parent = common(out_help="JSON output path (a PNG plot is written beside it)", out_required=True, impl="one")
    s = subcommand(subparsers, "spec", help="speculation round cost and end-to-end speed-up", description=__doc__,
                   run=run, parents=[parent], tiny=TINY)
    s.add_argument("--target", default="llama-3.1-8b")
    s.add_argument("--drafter", default="draft-model", choices=DRAFTERS)
    s.add_argument("--draft", default="llama-3.2-1b", help="draft model preset/path for --drafter draft-model")
    s.add_argument("--batch", type=int, nargs="+", default=[1])
    s.add_argument("--context", type=int, default=512)
    s.add_argument("--k", type=int, nargs="*", default=list(range(1, 9)), help="k values for round timing")
    s.add_argument("--stages-k", type=int, nargs="*", default=[4], help="k values whose stages are timed alone")
    s.add_argument("--k-end-to-end", type=k_or_policy, nargs="+", default=[4],
                   help="k values for the end-to-end runs (0: plain decoding), or 'policy': at each batch and "
                        "alpha the k jspec.policy picks from this run's round costs (--k) for a static batch of "
                        "--new-tokens each, 0 meaning plain decoding (e.g. --k-end-to-end 4 policy)")
    s.add_argument("--alpha", type=float, nargs="*", default=[0.0, 0.6, 0.8, 0.9, 1.0],
                   help="controlled per-draft acceptance rates for the end-to-end runs (none: skip them; -1: "
                        "greedy verification, the drafter's own acceptance)")
    s.add_argument("--new-tokens", type=int, default=128)
    add_tp(s)
    add_weights(s, many=False)
    s.add_argument("--hf", action="store_true", help="also run HF transformers (torch, GPU) on the same shapes")
    s.add_argument("--compile-threads", type=int, default=8, help="round programs compile in parallel threads")
    s.add_argument("--copy-bytes", type=int, default=2 << 30,
                   help="bytes of the copy-bandwidth buffer (measured when --stages-k is given)")
    return s
