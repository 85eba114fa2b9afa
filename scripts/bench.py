#!/usr/bin/env python
"""jspec benchmarks: plain decode and speculative decoding, timed on device.

Subcommands:
  decode   ms/token of the on-device greedy decode loop and its HBM roofline fraction
  spec     one speculation round vs one plain decode step for k = 1..8 (per stage), and
           end-to-end tokens/s against plain decode at controlled acceptance (oracle drafter)
  compile  compile time of the whole speculative program for several k

Targets are presets (random weights generated on the device from the real configs) or a
checkpoint directory. ``--tiny`` runs a seconds-long CPU smoke version. Results are JSON
(with the environment) plus a PNG plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jspec  # noqa: E402
from jspec import benchmarking as B  # noqa: E402
from jspec import engine, speculative  # noqa: E402
from jspec.drafters import MTP, DraftModel, Eagle3, Eagle3Config, NGram, init_eagle3_head, init_mtp_head  # noqa: E402
from jspec.drafters.oracle import Oracle  # noqa: E402
from jspec.policy import choose_for_batch, round_costs_by_batch  # noqa: E402
from jspec.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams()


def _random_prompts(batch, context, vocab, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, vocab, size=(batch, context)), jnp.int32)


def _decode_state(model, batch, context, max_len, impl, seed=0):
    tokens = _random_prompts(batch, context, model.config.vocab_size, seed)
    lengths = jnp.full((batch,), context, jnp.int32)
    return engine.start_decoding(
        model, tokens, lengths, jax.random.key(seed), params=GREEDY, eos_ids=(), output_width=16,
        max_len=max_len, impl=impl,
    )


def measure_decode_loop(model, batch, context, *, steps, impl, repeats):
    """ms per token of ``generate``'s on-device while loop: (T(n2) - T(n1)) / (n2 - n1)."""
    c = model.config
    tokens = _random_prompts(batch, context, c.vocab_size, 0)
    lengths = jnp.full((batch,), context, jnp.int32)
    width = engine.output_width(steps)
    max_len = engine.cache_length(context, context + width)
    run = lambda n: engine.generate_on_device(  # noqa: E731
        model, tokens, lengths, jax.random.key(0), jnp.int32(n), params=GREEDY, eos_ids=(),
        output_width=width, max_len=max_len, impl=impl,
    )
    short, long = B.time_fn(lambda: run(1), repeats=repeats), B.time_fn(lambda: run(steps), repeats=repeats)
    per_token = (long.median_s - short.median_s) / (steps - 1)
    # The same difference over the GPU time of the kernels alone (profiler): what the wall time
    # adds on top of it is the time the GPU sat idle between kernels (launches, loop control).
    # (both programs are compiled and warm from the wall timing above)
    kernels_short = B.gpu_kernel_times(lambda: run(1), warmup=0)
    kernels_long = B.gpu_kernel_times(lambda: run(steps), warmup=0)
    gpu = None
    if kernels_long:
        gpu = dict(busy_s_per_token=(sum(t for _, t in kernels_long) - sum(t for _, t in kernels_short)) / (steps - 1),
                   kernels_per_token=(len(kernels_long) - len(kernels_short)) / (steps - 1))
    return per_token, short, long, gpu


def _verify_pass(capture, impl):
    """The target's verify forward: ``k + 1`` rows against the cache (read-only), all logits."""
    return jax.jit(lambda t, tokens, kv: jspec.forward(t, tokens, kv, capture=capture, impl=impl)[0])


def measure_verify(model, batch, context, *, rows, impl, repeats):
    """Seconds of one verify forward of ``rows`` rows per sequence after ``context`` cached rows."""
    state = _decode_state(model, batch, context, engine.cache_length(context, context + rows), impl)
    tokens = jnp.zeros((batch, rows), jnp.int32)
    verify = _verify_pass((), impl)
    return B.time_fn(lambda: verify(model, tokens, state.kv), repeats=repeats)


def cmd_decode(args):
    dtype = jnp.dtype(args.dtype)
    bw = B.copy_bandwidth(args.copy_bytes)
    results = []

    def save():  # after every row: a slow compile that runs out of time loses nothing measured
        out = dict(kind="decode", environment=B.environment(dtype, args.seed), copy_bandwidth=bw,
                   method="generate's on-device while loop; ms/token = (T(n) - T(1)) / (n - 1), medians; "
                          "gpu_busy_ms_per_token: the same difference over the kernels' GPU time (profiler); "
                          "verify: one jitted forward of --verify-rows rows (all logits), median",
                   steps=args.steps, results=results)
        B.write_json(args.out, out)

    for preset in tqdm(args.targets, desc="targets"):
        model = B.load_target(preset, dtype, args.seed)
        weights = B.weight_bytes_per_step(model)
        for batch in args.batch:
            for context in args.context:
                for impl in args.impl:
                    per_token, short, long, gpu = measure_decode_loop(
                        model, batch, context, steps=args.steps, impl=impl, repeats=args.repeats
                    )
                    kv = B.kv_bytes_per_step(model, batch, context + args.steps // 2)
                    roofline_s = (weights + kv) / bw["bytes_per_s"]
                    row = dict(
                        target=preset, batch=batch, context=context, impl=impl, ms_per_token=per_token * 1e3,
                        tokens_per_s=batch / per_token, weight_bytes=weights, kv_bytes=kv,
                        roofline_ms_per_token=roofline_s * 1e3, roofline_fraction=roofline_s / per_token,
                        prefill_plus_first_token_ms=short.median_s * 1e3,
                        timings={"1_token": short.as_dict(), f"{args.steps}_tokens": long.as_dict()},
                    )
                    message = (f"{preset} b={batch} ctx={context} {impl}: {per_token * 1e3:.3f} ms/token, "
                               f"roofline {roofline_s * 1e3:.3f} ms ({roofline_s / per_token:.1%})")
                    if gpu:
                        row.update(gpu_busy_ms_per_token=gpu["busy_s_per_token"] * 1e3,
                                   kernels_per_token=gpu["kernels_per_token"],
                                   gpu_busy_roofline_fraction=roofline_s / gpu["busy_s_per_token"])
                        message += (f"; GPU busy {gpu['busy_s_per_token'] * 1e3:.3f} ms/token "
                                    f"({gpu['kernels_per_token']:.0f} kernels, "
                                    f"{roofline_s / gpu['busy_s_per_token']:.1%} of roofline)")
                    if args.verify_rows:
                        verify = measure_verify(model, batch, context, rows=args.verify_rows, impl=impl,
                                                repeats=args.repeats)
                        verify_s = verify.median_s
                        verify_roofline_s = (weights + B.kv_bytes_per_step(model, batch, context)) / bw["bytes_per_s"]
                        row.update(verify_rows=args.verify_rows, verify_ms=verify_s * 1e3,
                                   verify_roofline_fraction=verify_roofline_s / verify_s,
                                   verify_timing=verify.as_dict())
                        message += f"; verify {args.verify_rows} rows {verify_s * 1e3:.3f} ms " \
                                   f"({verify_roofline_s / verify_s:.1%})"
                    results.append(row)
                    save()
                    tqdm.write(message)
        del model
    _plot_decode(results, Path(args.out).with_suffix(".png"))


def _plot_decode(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['target']}\nb{r['batch']} ctx{r['context']}\n{r['impl']}" for r in results]
    ax.bar(range(len(results)), [r["roofline_fraction"] for r in results], color="tab:blue")
    ax.axhline(0.85, color="tab:red", ls="--", label="goal 85%")
    ax.set_xticks(range(len(results)), labels, fontsize=7)
    ax.set_ylabel("fraction of HBM roofline")
    ax.set_title("Plain greedy decode vs roofline ((weights + KV) / copy bandwidth)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------------
# spec


def _drafter(kind, target, args, dtype):
    if kind == "draft-model":
        return DraftModel(B.load_target(args.draft, dtype, args.seed + 1))
    if kind == "self":
        return DraftModel(target)
    if kind == "ngram":
        return NGram()
    key = jax.random.key(args.seed + 1)
    if kind == "eagle3":  # an EAGLE-3-shaped head for this target (32k draft vocabulary, as published)
        layer = dataclasses.replace(target.config, num_layers=1, rope_theta=10000.0, rope_scaling=None)
        depth = target.config.num_layers  # the default layers [2, L//2, L-3] need L >= 5
        config = Eagle3Config(layer=layer, draft_vocab_size=min(32000, layer.vocab_size),
                              target_hidden_size=target.config.hidden_size,
                              aux_layers=None if depth >= 5 else (0, depth // 2, depth - 1))
        return Eagle3(jax.jit(init_eagle3_head, static_argnums=(0, 2))(config, key, dtype)).bind(target)
    if kind == "mtp":
        return MTP(jax.jit(init_mtp_head, static_argnums=(0, 2))(target.config, key, dtype)).bind(target)
    raise SystemExit(f"unknown drafter {kind!r}")


# One jitted prefill for every k: the initial state does not depend on k.
_start = jax.jit(speculative.start, static_argnames=("params", "eos_ids", "capacity", "max_len", "impl"))


def _spec_state(target, drafter, batch, context, capacity, impl, seed=0):
    tokens = _random_prompts(batch, context, target.config.vocab_size, seed)
    lengths = jnp.full((batch,), context, jnp.int32)
    return _start(target, drafter, tokens, lengths, jax.random.key(seed), params=GREEDY, eos_ids=(),
                 capacity=capacity, max_len=capacity, impl=impl)


def cmd_spec(args):
    dtype = jnp.dtype(args.dtype)
    target = B.load_target(args.target, dtype, args.seed)
    if args.target in B.PRESETS:  # random weights: make the oracle's reference continuation stable
        target = B.confident(target, args.seed)
    drafter = _drafter(args.drafter, target, args, dtype)
    results = {"rounds": [], "end_to_end": []}
    big = jnp.int32(1 << 30)  # max_new_tokens: never reached while timing rounds
    for batch in args.batch:
        capacity = engine.cache_length(args.context, args.context + 64 + (args.repeats + 8) * (max(args.k + [1]) + 1))
        if args.k:
            decode = jax.jit(lambda m, s: engine.decode_step(m, s, params=GREEDY, eos_ids=(), impl=args.impl),
                             donate_argnums=1)
            state = _decode_state(target, batch, args.context, capacity, args.impl)
            decode_timing = B.time_steps(lambda s: decode(target, s), state, repeats=args.repeats)[0]
            decode_s = decode_timing.median_s
        for k in tqdm(args.k, desc=f"k (batch {batch})"):
            round_fn = jax.jit(
                lambda t, d, s, k=k: speculative.speculative_round(
                    t, d, s, num_draft_tokens=k, params=GREEDY, eos_ids=(), max_new_tokens=big, impl=args.impl
                ),
                donate_argnums=2,
            )
            state = _spec_state(target, drafter, batch, args.context, capacity, args.impl)
            timing, state = B.time_steps(lambda s: round_fn(target, drafter, s), state, repeats=args.repeats)
            round_s = timing.median_s
            stages = _stage_times(target, drafter, state, k, args) if k in args.stages_k else {}
            if stages:  # what the round spends beyond its two big stages
                stages["accept_commit_ms"] = round_s * 1e3 - stages["propose_ms"] - stages["verify_ms"]
            results["rounds"].append(dict(
                batch=batch, k=k, round_ms=round_s * 1e3, decode_step_ms=decode_s * 1e3,
                overhead_ratio=round_s / decode_s, **stages,
                timings=dict(round=timing.as_dict(), decode_step=decode_timing.as_dict()),
            ))
            tqdm.write(f"b={batch} k={k}: round {round_s * 1e3:.3f} ms = {round_s / decode_s:.2f}x decode step "
                       f"({decode_s * 1e3:.3f} ms); stages {stages}")
        if args.alpha:
            results["end_to_end"] += _end_to_end(target, drafter, batch, args)
    if results["rounds"]:  # the k that jspec.policy picks from these costs, per batch and acceptance rate
        by_batch = round_costs_by_batch(results["rounds"])
        batches = sorted({2**i for i in range(max(by_batch).bit_length())} | set(by_batch))
        alphas = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
        results["policy"] = {  # per-round view (continuous batching)
            batch: {alpha: choose_for_batch(by_batch, batch, alpha) for alpha in alphas} for batch in batches
        }
        results["policy_static_batch"] = {  # whole batches of --new-tokens each (straggler-corrected)
            batch: {alpha: choose_for_batch(by_batch, batch, alpha, new_tokens=args.new_tokens) for alpha in alphas}
            for batch in batches
        }
    if args.hf:
        results["hf"] = _hf_peer(target, drafter, results["end_to_end"], args)
    out = dict(kind="spec", environment=B.environment(dtype, args.seed), target=args.target,
               drafter=args.drafter, draft=args.draft if args.drafter == "draft-model" else None,
               context=args.context, impl=args.impl, results=results,
               notes="round/decode times: medians of back-to-back donated jitted calls (p10/p90 in timings); stages timed as "
                     "separate jitted programs (propose; verify forward of k+1 rows); accept+commit = "
                     "round - propose - verify.")
    B.write_json(args.out, out)
    _plot_spec(out, Path(args.out).with_suffix(".png"))


def _stage_times(target, drafter, state, k, args):
    """Propose and verify timed alone (state not donated: both are read-only here)."""
    from jspec.drafters.base import RoundContext
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
    propose = jax.jit(lambda d, ds, c: d.propose(ds, c, num_draft_tokens=k, params=GREEDY, key=jax.random.key(0))[0])
    tokens = jnp.zeros((state.history.shape[0], k + 1), jnp.int32)
    verify = _verify_pass(drafter.capture, args.impl)
    p = B.time_fn(lambda: propose(drafter, state.draft_state, ctx), repeats=args.repeats).median_s
    v = B.time_fn(lambda: verify(target, tokens, state.target_kv), repeats=args.repeats).median_s
    return dict(propose_ms=p * 1e3, verify_ms=v * 1e3)


def _end_to_end(target, drafter, batch, args):
    """tokens/s of speculative_generate's on-device loop vs generate's, at controlled acceptance."""
    c = target.config
    n = args.new_tokens
    prompts = _random_prompts(batch, args.context, c.vocab_size, 1)
    lengths = jnp.full((batch,), args.context, jnp.int32)
    width = engine.output_width(n)
    max_len = engine.cache_length(args.context, args.context + width)
    plain = lambda m: engine.generate_on_device(  # noqa: E731
        target, prompts, lengths, jax.random.key(0), jnp.int32(m), params=GREEDY, eos_ids=(),
        output_width=width, max_len=max_len, impl=args.impl,
    )
    t1, tn = B.time_fn(lambda: plain(1), repeats=args.repeats), B.time_fn(lambda: plain(n), repeats=args.repeats)
    plain_tps = batch * (n - 1) / (tn.median_s - t1.median_s)
    # The reference continuation the oracle replays: the target's own greedy output.
    out, _ = plain(width)  # the whole buffer, so late proposals have a reference too
    k_max = max(args.k_end_to_end)
    capacity = engine.cache_length(args.context, args.context + width + k_max + 1)
    reference = jnp.zeros((batch, capacity), jnp.int32).at[:, : args.context].set(prompts)
    reference = reference.at[:, args.context : args.context + width].set(out)
    rows = []
    for alpha in tqdm(args.alpha, desc="alpha"):
        # alpha < 0: the drafter on its own, no oracle (e.g. --drafter self accepts everything)
        oracle = drafter if alpha < 0 else Oracle(drafter, reference, jnp.float32(alpha), c.vocab_size)
        for k in args.k_end_to_end:
            spec = lambda m, k=k: speculative.speculative_on_device(  # noqa: E731
                target, oracle, prompts, lengths, jax.random.key(0), jnp.int32(m), params=GREEDY, eos_ids=(),
                num_draft_tokens=k, capacity=capacity, max_len=capacity, impl=args.impl,
            )
            s1, sn = B.time_fn(lambda: spec(1), repeats=args.repeats), B.time_fn(lambda: spec(n), repeats=args.repeats)
            _, emitted, rounds, accepted = spec(n)
            spec_tps = batch * (n - 1) / (sn.median_s - s1.median_s)
            rounds, accepted = np.asarray(rounds).sum(), np.asarray(accepted).sum()
            rows.append(dict(
                batch=batch, alpha=alpha, k=k, mean_acceptance_length=float((accepted + rounds) / max(rounds, 1)),
                expected_acceptance_length=(
                    None if alpha < 0 else (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
                ),
                spec_tokens_per_s=spec_tps, plain_tokens_per_s=plain_tps, speedup=spec_tps / plain_tps,
                timings={"spec_1_token": s1.as_dict(), f"spec_{n}_tokens": sn.as_dict(),
                         "plain_1_token": t1.as_dict(), f"plain_{n}_tokens": tn.as_dict()},
            ))
            tqdm.write(f"b={batch} alpha={alpha} k={k}: {spec_tps:.1f} tok/s vs plain {plain_tps:.1f} "
                       f"({spec_tps / plain_tps:.2f}x), acceptance length {rows[-1]['mean_acceptance_length']:.2f}")
    return rows


def _hf_peer(target, drafter, end_to_end, args):
    """HF transformers on the same shapes in the same run, and jspec / HF ratios (batch 1)."""
    import _hf_peer

    draft_config = drafter.model.config if isinstance(drafter, DraftModel) else None
    prompt = np.asarray(_random_prompts(1, args.context, target.config.vocab_size, 1)).tolist()
    hf = _hf_peer.peer_results(target.config, draft_config, prompt, new_tokens=args.new_tokens,
                               k=max(args.k_end_to_end), repeats=max(2, args.repeats // 3), seed=args.seed)
    rows = [r for r in end_to_end if r["batch"] == 1]
    ratios = {}
    if rows and isinstance(hf.get("eager_dynamic_cache"), float):
        ratios["plain_jspec_over_hf_eager"] = rows[0]["plain_tokens_per_s"] / hf["eager_dynamic_cache"]
    if isinstance(hf.get("static_cache_compiled"), float) and rows:
        ratios["plain_jspec_over_hf_static_compiled"] = rows[0]["plain_tokens_per_s"] / hf["static_cache_compiled"]
    # Random weights: HF's draft model accepts ~nothing, matched by jspec's oracle at alpha = 0.
    zero = [r for r in rows if r["alpha"] == 0.0]
    if zero and isinstance(hf.get("assisted_draft_model"), float):
        ratios["spec_alpha0_jspec_over_hf_assisted_draft"] = zero[0]["spec_tokens_per_s"] / hf["assisted_draft_model"]
    tqdm.write(f"HF peer: {hf}\nratios: {ratios}")
    return dict(tokens_per_s=hf, ratios=ratios)


def _plot_spec(out, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    rounds = out["results"]["rounds"]
    for batch in sorted({r["batch"] for r in rounds}):
        rs = [r for r in rounds if r["batch"] == batch]
        a1.plot([r["k"] for r in rs], [r["overhead_ratio"] for r in rs], "o-", label=f"batch {batch}")
    a1.set_xlabel("draft tokens k")
    a1.set_ylabel("round time / plain decode step")
    a1.set_title(f"{out['target']} + {out['drafter']}: round cost")
    a1.legend()
    for row_k in sorted({r["k"] for r in out["results"]["end_to_end"]}):
        rs = [r for r in out["results"]["end_to_end"] if r["k"] == row_k]
        a2.plot([r["mean_acceptance_length"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"k={row_k}")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set_xlabel("mean acceptance length (tokens per verify)")
    a2.set_ylabel("speed-up over plain decode")
    a2.set_title("end to end, oracle drafter at controlled acceptance")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd_compile(args):
    """Trace + compile time of the whole speculative program for several k (abstract weights)."""
    import time

    dtype = jnp.dtype(args.dtype)
    abstract = lambda name: jax.eval_shape(  # noqa: E731
        lambda: jspec.init_params(B.PRESETS[name], jax.random.key(0), dtype)
    )
    target, drafter = abstract(args.target), DraftModel(abstract(args.draft))
    tokens = jax.ShapeDtypeStruct((1, args.context), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    capacity = engine.cache_length(args.context, args.context + 256)
    rows = []
    for k in tqdm([1] + args.k, desc="k"):  # k=1 first: a warm-up for one-time compiler set-up
        start = time.perf_counter()
        traced = speculative.speculative_on_device.trace(
            target, drafter, tokens, lengths, jax.random.key(0), jnp.int32(128), params=GREEDY, eos_ids=(),
            num_draft_tokens=k, capacity=capacity, max_len=capacity, impl=args.impl,
        )
        lowered = traced.lower()
        lower_s = time.perf_counter() - start
        lowered.compile()
        rows.append(dict(k=k, warm_up=len(rows) == 0, trace_lower_s=lower_s, total_s=time.perf_counter() - start))
        tqdm.write(f"k={k}: trace+lower {lower_s:.1f} s, with compile {rows[-1]['total_s']:.1f} s")
    out = dict(kind="compile", environment=B.environment(dtype, args.seed), target=args.target, draft=args.draft,
               context=args.context, results=rows,
               notes="speculative_on_device (prefill + while loop of rounds, draft steps a lax.scan), "
                     "compiled from abstract shapes; the first row is a warm-up")
    B.write_json(args.out, out)


def _impl(text):
    from pallas_kernels._dispatch import check_impl

    try:
        check_impl(text, "skinny_matmul")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="seconds-long CPU smoke run on tiny random models")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--impl", default="auto", type=_impl,
                        help="kernel choice: auto, pallas or xla, optionally with per-kernel exceptions, "
                             "e.g. 'auto,skinny_matmul=xla'")
    parser.add_argument("--out", required=True, help="JSON output path (a PNG plot is written beside it)")
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("decode", help="plain greedy decode vs roofline")
    d.add_argument("--targets", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"],
                   help=f"presets {B.preset_names()} or checkpoint directories")
    d.add_argument("--batch", type=int, nargs="+", default=[1])
    d.add_argument("--context", type=int, nargs="+", default=[512])
    d.add_argument("--steps", type=int, default=128)
    d.add_argument("--impl", dest="impl_list", nargs="+", type=_impl, default=None,
                   help="kernel choices to compare (same syntax as the global --impl)")
    d.add_argument("--verify-rows", type=int, default=0,
                   help="also time a verify forward of this many rows (k + 1), e.g. 5")
    d.add_argument("--copy-bytes", type=int, default=2 << 30)

    s = sub.add_parser("spec", help="speculation round cost and end-to-end speed-up")
    s.add_argument("--target", default="llama-3.1-8b")
    s.add_argument("--drafter", default="draft-model", choices=["draft-model", "self", "ngram", "eagle3", "mtp"])
    s.add_argument("--draft", default="llama-3.2-1b", help="draft model preset/path for --drafter draft-model")
    s.add_argument("--batch", type=int, nargs="+", default=[1])
    s.add_argument("--context", type=int, default=512)
    s.add_argument("--k", type=int, nargs="*", default=list(range(1, 9)), help="k values for round timing")
    s.add_argument("--stages-k", type=int, nargs="*", default=[4], help="k values whose stages are timed alone")
    s.add_argument("--k-end-to-end", type=int, nargs="+", default=[4])
    s.add_argument("--alpha", type=float, nargs="*", default=[0.0, 0.6, 0.8, 0.9, 1.0],
                   help="oracle acceptance rates for the end-to-end runs (none: skip them; -1: the drafter "
                        "alone, without the oracle)")
    s.add_argument("--new-tokens", type=int, default=128)
    s.add_argument("--hf", action="store_true", help="also run HF transformers (torch, GPU) on the same shapes")

    cp = sub.add_parser("compile", help="compile time of the speculative program vs k")
    cp.add_argument("--target", default="llama-3.1-8b")
    cp.add_argument("--draft", default="llama-3.2-1b")
    cp.add_argument("--context", type=int, default=512)
    cp.add_argument("--k", type=int, nargs="+", default=[2, 8])

    args = parser.parse_args(argv)
    if args.tiny:
        jax.config.update("jax_platforms", "cpu")
        args.repeats = 2
        # tiny presets named on the command line are kept (e.g. tiny-gemma4), anything else is replaced
        if args.command == "decode":
            args.targets = [t for t in args.targets if t.startswith("tiny")] or ["tiny"]
            args.batch, args.context, args.steps, args.copy_bytes = [1], [32], 8, 1 << 22
        elif args.command == "spec":
            args.target = args.target if args.target.startswith("tiny") else "tiny"
            args.draft, args.context, args.k, args.new_tokens = "tiny-draft", 32, [2], 32
            # shrink what was asked for; an empty --alpha / --stages-k stays empty
            args.k_end_to_end = [2]
            args.alpha, args.stages_k = [0.8][: len(args.alpha)], [2][: len(args.stages_k)]
        else:
            args.target, args.draft, args.context, args.k = "tiny", "tiny-draft", 32, [2]
    if args.command == "decode":
        args.impl = args.impl_list or [args.impl]
        cmd_decode(args)
    elif args.command == "spec":
        cmd_spec(args)
    else:
        cmd_compile(args)


if __name__ == "__main__":
    main()
