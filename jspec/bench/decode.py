"""decode: ms/token of the on-device greedy decode loop and its HBM roofline fraction.

ms/token = (T(n) - T(1)) / (n - 1) of ``generate``'s on-device while loop (medians, so the
prefill cancels out); the roofline is (weights + KV bytes one step reads) / the copy bandwidth
measured in the same run. On a GPU each row also has the kernels of one decode step (one
dispatched forward of a row; the profiler: GPU time, count, NCCL time, the top kernels by time),
and with ``--verify-rows`` the wall time and the same profile of one verify forward of that many
rows, side by side. Targets are presets
(random weights made on the device) or checkpoint directories. Writes ``--out`` (JSON) and a
PNG beside it.

  python -m jspec.bench decode --out decode.json --targets llama-3.1-8b --impl xla auto
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jspec import engine
from jspec.execution import with_kernels
from jspec.bench import plots, report
from jspec.bench.flags import add_tp, add_weights, common, mesh_of, subcommand, tree_arg
from jspec.bench.presets import GREEDY, is_tiny, load_target, preset_names, random_prompts, weights_note
from jspec.bench.roofline import copy_bandwidth, kv_bytes_per_step, weight_bytes_per_step
from jspec.bench.timing import Timing, gpu_kernel_times, time_fn
from jspec.models import forward
from jspec.models.base import NO_CAPTURE
from jspec.tree import DraftTree

NOTES = ("weights: the format of every matmul weight and table (bf16, or quantized round to nearest by "
         "jspec.quantize on the device); weight_bytes: the bytes a step reads in it, so roofline_fraction is against "
         "the format's own roofline; ms_per_token: generate's on-device while loop, (T(n) - T(1)) / (n - 1) of "
         "medians; step_profile / verify[].profile: the GPU kernels of one dispatched forward of 1 / each "
         "--verify-rows rows (profiler: total ms, count, NCCL ms under --tp, the top kernels by time), since the "
         "profiler does not see the kernels inside the while loop; verify_ms: wall time of that verify forward "
         "(all logits)")


_start_decoding = jax.jit(engine.start_decoding, static_argnames=("params", "eos_ids", "output_width", "max_len"))


def decode_state(model, batch, context, max_len, impl, seed=0):
    """A plain decode state after the prefill of random prompts of ``context`` tokens."""
    tokens = random_prompts(batch, context, model.config.vocab_size, seed)
    lengths = jnp.full((batch,), context, jnp.int32)
    return _start_decoding(with_kernels(model, impl), tokens, lengths, jax.random.key(seed), params=GREEDY,
                           eos_ids=(), output_width=16, max_len=max_len)


def verify_pass(capture, impl):
    """The target's verify forward of ``k + 1`` rows (a tree's with its ``tree_mask``) as a round
    runs it, in place: ``(logits, kv)`` with the cache donated and handed back at its old lengths.
    (Undonated, the forward would copy each layer's K and V to write its rows into them, a ``memcpy``
    no round pays.)"""

    def run(target, tokens, kv, tree_mask=None):
        logits, _, new_kv = forward(with_kernels(target, impl), tokens, kv, capture=capture, tree_mask=tree_mask)
        return logits, new_kv.truncate(kv.lengths)

    return jax.jit(run, donate_argnums=2)


def in_place(verify, target, tokens, kv, tree_mask=None):
    """A thunk running ``verify`` (:func:`verify_pass`) again and again on one cache, which each
    call donates and gets back."""
    cache = [kv]

    def call():
        logits, cache[0] = verify(target, tokens, cache[0], tree_mask)
        return logits

    return call


def verify_call(model, batch, context, *, rows, impl, topk=None):
    """A thunk running one verify forward of ``rows`` rows per sequence after ``context`` cached
    rows, in place; with ``topk``, of a tree: the complete ``topk``-ary tree of ``rows`` nodes in
    heap order (the time depends on the rows and the masked attention, not on the tree's shape)."""
    state = decode_state(model, batch, context, engine.cache_length(context, context + rows), impl)
    tokens = jnp.zeros((batch, rows), jnp.int32)
    verify = verify_pass(NO_CAPTURE, impl)
    if topk is None:
        return in_place(verify, model, tokens, state.kv)
    parents = jnp.asarray([-1] + [(i - 1) // topk for i in range(1, rows)], jnp.int32)
    tree = DraftTree.from_parents(tokens, jnp.broadcast_to(parents, (batch, rows)))
    return in_place(verify, model, tokens, state.kv, tree.mask)


def measure_verify(model, batch, context, *, rows, impl, repeats, topk=None) -> Timing:
    """Wall time of :func:`verify_call`'s forward, ``repeats`` samples."""
    return time_fn(verify_call(model, batch, context, rows=rows, impl=impl, topk=topk), repeats=repeats)


def plain_loop(model, batch, context, new_tokens, impl, seed=0):
    """``run(n)``: ``generate``'s on-device loop over random prompts, ``n`` tokens (traced), and
    the output width it was compiled for."""
    tokens = random_prompts(batch, context, model.config.vocab_size, seed)
    lengths = jnp.full((batch,), context, jnp.int32)
    width = engine.output_width(new_tokens)
    max_len = engine.cache_length(context, context + width)

    def run(n):
        return engine.generate_on_device(
            with_kernels(model, impl), tokens, lengths, jax.random.key(0), jnp.int32(n), params=GREEDY, eos_ids=(),
            output_width=width, max_len=max_len,
        )

    return run, width


COLLECTIVE_PREFIXES = ("psum", "all_reduce", "all-reduce", "all_gather", "all-gather", "reduce_scatter",
                       "reduce-scatter", "collective_permute", "collective-permute")


def is_collective(kernel_name: str) -> bool:
    """A communication kernel under ``--tp``: NCCL's, or XLA's own one-shot kernels, which it names
    after the collective (``psum_484_0_fusion_1`` for the all-reduce of a row-split projection,
    ``all_reduce_1_fusion_1``; most of a step's all-reduces run as these, not as NCCL's)."""
    name = kernel_name.lower()
    return "nccl" in name or name.startswith(COLLECTIVE_PREFIXES)


def kernel_profile(call, *, top: int = 40) -> dict | None:
    """The GPU kernels of one dispatched ``call()`` (profiler; None off a GPU): total time, count,
    the collectives' time (:func:`is_collective`), and the ``top`` kernel names by time with their counts. Profiled outside the
    on-device loop because the profiler does not see the kernels inside a while loop (jax 0.11.2:
    6-10 of ~350 per Llama step, with or without command buffers)."""
    kernels = gpu_kernel_times(call, warmup=0)
    if not kernels:
        return None
    by_name: dict[str, list[float]] = {}
    for name, seconds in kernels:
        by_name.setdefault(name, []).append(seconds)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return dict(gpu_ms=sum(t for _, t in kernels) * 1e3, kernels=len(kernels),
                collective_ms=sum(t for name, t in kernels if is_collective(name)) * 1e3,
                top_kernels=[dict(name=name, count=len(times), ms=sum(times) * 1e3) for name, times in ranked])


def measure_decode_loop(model, batch, context, *, steps, impl, repeats):
    """Seconds per token of the on-device loop, and its 1- and ``steps``-token timings."""
    run, _ = plain_loop(model, batch, context, steps, impl)
    short, long = time_fn(lambda: run(1), repeats=repeats), time_fn(lambda: run(steps), repeats=repeats)
    return (long.median_s - short.median_s) / (steps - 1), short, long


def run(args):
    if args.loop_only and (args.verify_rows or args.verify_trees):
        raise SystemExit("error: --loop-only times the loop alone: drop --verify-rows / --verify-trees")
    dtype = jnp.dtype(args.dtype)
    bw = copy_bandwidth(args.copy_bytes)
    env = report.environment(dtype, args.seed, weights=weights_note(args.targets))
    rows = []

    def save():  # after every row: a slow compile that runs out of time loses nothing measured
        report.write(args.out, report.result("decode", args.argv, env, rows, copy_bandwidth=bw, notes=NOTES))

    mesh = mesh_of(args.tp, args.weights)
    for preset in tqdm(args.targets, desc="targets"):
        for fmt in args.weights:
            model = load_target(preset, dtype, args.seed, mesh, weights=fmt)
            weights = weight_bytes_per_step(model)
            for batch in args.batch:
                for context in args.context:
                    for impl in args.impl:
                        row = _row(model, preset, weights, bw, batch, context, impl, fmt, args)
                        rows.append(dict(row, weights=fmt))
                        save()
            del model
    plots.decode(rows, Path(args.out).with_suffix(".png"))


def _row(model, preset, weights, bw, batch, context, impl, fmt, args):
    per_token, short, long = measure_decode_loop(
        model, batch, context, steps=args.steps, impl=impl, repeats=args.repeats
    )
    kv = kv_bytes_per_step(model, batch, context + args.steps // 2)
    roofline_s = (weights + kv) / (bw["bytes_per_s"] * args.tp)  # tensor parallel: every device streams its share
    row = dict(
        measure="decode", target=preset, batch=batch, context=context, impl=impl, steps=args.steps, tp=args.tp,
        ms_per_token=per_token * 1e3, tokens_per_s=batch / per_token, weight_bytes=weights, kv_bytes=kv,
        roofline_ms_per_token=roofline_s * 1e3, roofline_fraction=roofline_s / per_token,
        prefill_plus_first_token_ms=short.median_s * 1e3,
        timings={"1_token": short.as_dict(), f"{args.steps}_tokens": long.as_dict()},
    )
    message = (f"{preset} {fmt} b={batch} ctx={context} {impl}: {per_token * 1e3:.3f} ms/token, "
               f"roofline {roofline_s * 1e3:.3f} ms ({roofline_s / per_token:.1%})")
    if args.loop_only:
        tqdm.write(message)
        return row
    step_call = verify_call(model, batch, context, rows=1, impl=impl)
    step_time = time_fn(step_call, repeats=args.repeats)  # dispatched, the clock the verify forward runs on
    row.update(step_ms=step_time.median_s * 1e3)
    row["timings"]["step"] = step_time.as_dict()
    step = kernel_profile(step_call)
    if step:
        row.update(step_profile=step, step_gpu_roofline_fraction=roofline_s * 1e3 / step["gpu_ms"])
        message += (f"; one step's kernels {step['gpu_ms']:.3f} ms ({step['kernels']}, "
                    f"{roofline_s * 1e3 / step['gpu_ms']:.1%} of roofline)"
                    + (f", collectives {step['collective_ms']:.3f} ms" if args.tp > 1 else ""))
    for verify_rows in args.verify_rows:
        call = verify_call(model, batch, context, rows=verify_rows, impl=impl)
        verify = time_fn(call, repeats=args.repeats)
        verify_roofline_s = (weights + kv_bytes_per_step(model, batch, context)) / (bw["bytes_per_s"] * args.tp)
        entry = dict(rows=verify_rows, verify_ms=verify.median_s * 1e3,
                     verify_roofline_fraction=verify_roofline_s / verify.median_s,
                     verify_over_step=verify.median_s / step_time.median_s, timing=verify.as_dict())
        verify_kernels = kernel_profile(call)
        if verify_kernels:
            entry.update(profile=verify_kernels, verify_gpu_over_step_gpu=verify_kernels["gpu_ms"] / step["gpu_ms"])
        row.setdefault("verify", []).append(entry)
        message += f"; verify {verify_rows} rows {verify.median_s * 1e3:.3f} ms " \
                   f"({verify_roofline_s / verify.median_s:.1%}, {verify.median_s / step_time.median_s:.2f}x " \
                   f"a dispatched step's {step_time.median_s * 1e3:.3f} ms)"
    for tree in args.verify_trees:
        tree_t = measure_verify(model, batch, context, rows=tree.num_nodes + 1, topk=tree.topk, impl=impl,
                                repeats=args.repeats)
        chain_t = measure_verify(model, batch, context, rows=tree.depth + 1, impl=impl, repeats=args.repeats)
        row.setdefault("verify_trees", []).append(dict(
            topk=tree.topk, depth=tree.depth, nodes=tree.num_nodes, tree_verify_ms=tree_t.median_s * 1e3,
            chain_verify_ms=chain_t.median_s * 1e3, timings=dict(tree=tree_t.as_dict(), chain=chain_t.as_dict())))
        message += (f"; tree verify {tree.num_nodes} nodes {tree_t.median_s * 1e3:.3f} ms vs chain of depth "
                    f"{tree.depth} {chain_t.median_s * 1e3:.3f} ms")
    tqdm.write(message)
    return row


# 256 steps: a tiny model's token costs ~0.03 ms on a CPU, so that T(n) - T(1) stands above the noise of
# a loaded machine (at 64 steps it once came out negative)
TINY = dict(targets=lambda targets: [t for t in targets if is_tiny(t)] or ["tiny"], batch=[1], context=[32],
            steps=256, copy_bytes=1 << 22, repeats=5)


def register(subparsers):
    parent = common(out_help="JSON output path (a PNG plot is written beside it)", out_required=True, impl="many")
    d = subcommand(subparsers, "decode", help="plain greedy decode vs roofline", description=__doc__, run=run,
                   parents=[parent], tiny=TINY)
    d.add_argument("--targets", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"],
                   help=f"presets {preset_names()} or checkpoint directories")
    d.add_argument("--batch", type=int, nargs="+", default=[1])
    d.add_argument("--context", type=int, nargs="+", default=[512])
    d.add_argument("--steps", type=int, default=128)
    add_tp(d)
    d.add_argument("--verify-rows", type=int, nargs="*", default=[],
                   help="also time a verify forward of each of these many rows (k + 1), e.g. 5 16")
    add_weights(d, many=True)
    d.add_argument("--verify-trees", type=tree_arg, nargs="*", default=[],
                   help="TOPK:DEPTH:NODES: also time a tree verify of NODES + 1 rows against a chain verify of "
                        "DEPTH + 1 rows, e.g. 4:6:32")
    d.add_argument("--copy-bytes", type=int, default=2 << 30)
    d.add_argument("--loop-only", action="store_true",
                   help="the on-device loop's ms/token alone: no dispatched step, step profile or verify (one "
                        "compile a row instead of three: E4B's rows take minutes each otherwise)")
    return d
