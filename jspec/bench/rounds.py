"""A speculation round against a plain decode step: the measurement behind ``spec``'s ``round`` rows
(also used by ``catch-up`` and ``frozen-kv``).

For each k (and each tree) one jitted round (propose, verify k+1 rows, accept, commit; state donated)
against one plain decode step, medians of back-to-back calls, with the round's bandwidth bound
(``roofline_ratio``). Staged rounds also time their propose and verify alone as separate programs
(accept + commit = round - propose - verify), the propose once more compiled as the on-device loops
are (its draft scan one graph), its bytes and their fraction of the copy bandwidth, and on a GPU
the kernels of the round, its stages and a step side by side.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jspec import engine, speculative
from jspec.bench import decode
from jspec.bench.presets import GREEDY, random_prompts
from jspec.bench.roofline import propose_bytes, round_roofline_ratio
from jspec.bench.timing import compile_all, time_fn, time_steps
from jspec.compile_options import LOOP_COMPILER_OPTIONS
from jspec.drafters.base import RoundContext

NO_LIMIT = 1 << 30  # max_new_tokens of a timed round: never reached


# One jitted prefill for every k: the initial state does not depend on k.
_start = jax.jit(speculative.start, static_argnames=("params", "eos_ids", "capacity", "max_len", "impl"))
_round = jax.jit(speculative.speculative_round,
                 static_argnames=("num_draft_tokens", "params", "eos_ids", "tree", "impl"),
                 donate_argnames=("state",))


def spec_state(target, drafter, batch, context, capacity, impl, seed=0):
    """The speculation state after the prefill of random prompts of ``context`` tokens."""
    tokens = random_prompts(batch, context, target.config.vocab_size, seed)
    lengths = jnp.full((batch,), context, jnp.int32)
    return _start(target, drafter, tokens, lengths, jax.random.key(seed), params=GREEDY, eos_ids=(),
                  capacity=capacity, max_len=capacity, impl=impl)


def measure_rounds(target, drafter, batch, context, ks, *, capacity, impl, repeats, warmup=3, stages_k=(),
                   compile_threads=8, tags=None, trees=(), copy_bytes_per_s=None) -> list[dict]:
    """``round`` rows: a round for each k, and for each tree (``jspec.tree.TreeShape``, its
    ``num_nodes`` drafts), a fresh state each, against a plain decode step. The round programs are
    compiled first, in parallel threads. Chains with k in ``stages_k`` and trees in it also get
    their propose and verify timed alone (and profiled on a GPU); a chain's propose also the bytes it
    reads (:func:`jspec.bench.roofline.propose_bytes`) and, given the copy bandwidth measured in the
    same run, the fraction of it that the propose streams them at."""
    if not ks and not trees:
        return []
    shapes = {k: None for k in ks} | {tree: tree for tree in trees}
    fresh = lambda: spec_state(target, drafter, batch, context, capacity, impl)  # noqa: E731
    abstract = jax.eval_shape(fresh)
    limit = jnp.int32(NO_LIMIT)
    compiled = compile_all({key: _round.lower(target, drafter, abstract, params=GREEDY, eos_ids=(),
                                              num_draft_tokens=key if tree is None else tree.num_nodes, tree=tree,
                                              max_new_tokens=limit, impl=impl)
                            for key, tree in shapes.items()}, compile_threads)
    step = lambda s: engine.decode_step_jit(target, s, params=GREEDY, eos_ids=(), impl=impl)  # noqa: E731
    plain = decode.decode_state(target, batch, context, capacity, impl)
    decode_timing = time_steps(step, plain, warmup=warmup, repeats=repeats)[0]
    decode_s = decode_timing.median_s
    rows = []
    for key, tree in tqdm(shapes.items(), desc=f"k (batch {batch})"):
        timing, state = time_steps(lambda s, key=key: compiled[key](target, drafter, s, max_new_tokens=limit), fresh(),
                                   warmup=warmup, repeats=repeats)
        round_s = timing.median_s
        k = key if tree is None else tree.num_nodes
        shape = {} if tree is None else dict(topk=tree.topk, depth=tree.depth)
        row = dict(measure="round", **(tags or {}), batch=batch, k=k, **shape, round_ms=round_s * 1e3,
                   decode_step_ms=decode_s * 1e3, overhead_ratio=round_s / decode_s,
                   timings=dict(round=timing.as_dict(), decode_step=decode_timing.as_dict()))
        if tree is None:  # the round's bandwidth bound, beside what it costs
            row["roofline_ratio"] = round_roofline_ratio(target, drafter, k, batch, context)
        if key in stages_k:  # what the round spends beyond its two big stages
            calls = stage_calls(target, drafter, state, k, impl=impl, tree=tree)
            stages = {name: time_fn(call, repeats=repeats) for name, call in calls.items()}
            row.update(propose_ms=stages["propose"].median_s * 1e3, verify_ms=stages["verify"].median_s * 1e3,
                       propose_loop_options_ms=stages["propose_loop_options"].median_s * 1e3)
            row["accept_commit_ms"] = row["round_ms"] - row["propose_ms"] - row["verify_ms"]
            row["timings"].update({name: t.as_dict() for name, t in stages.items()})
            read = propose_bytes(drafter, k) if tree is None else None
            if read:
                row["propose_bytes"] = read
                if copy_bytes_per_s:  # the draft steps' bandwidth roofline, as they run inside generation
                    row["propose_fraction_of_copy"] = (read / stages["propose_loop_options"].median_s
                                                       / copy_bytes_per_s)
            # The kernels of one round, its two stages and one decode step side by side (profiler;
            # None off a GPU). Round and step donate their state: the round takes the last one, the
            # step a fresh one.
            step_state = decode.decode_state(target, batch, context, capacity, impl)
            profiles = dict(round=decode.kernel_profile(
                                lambda key=key, state=state: compiled[key](target, drafter, state, max_new_tokens=limit)),
                            decode_step=decode.kernel_profile(lambda: step(step_state)),
                            propose=decode.kernel_profile(calls["propose"]),
                            verify=decode.kernel_profile(calls["verify"]))
            if profiles["round"]:
                row["profiles"] = profiles
        rows.append(row)
        label = f"k={k}" if tree is None else f"tree topk={tree.topk} depth={tree.depth} nodes={k}"
        bound = row.get("roofline_ratio")
        tqdm.write(f"b={batch} {label}: round {round_s * 1e3:.3f} ms = {round_s / decode_s:.2f}x decode step "
                   f"({decode_s * 1e3:.3f} ms)" + (f", bound {bound:.2f}x" if bound else "")
                   + (f"; propose {row['propose_ms']:.3f} ms, verify {row['verify_ms']:.3f} ms"
                      if "propose_ms" in row else "")
                   + (f", propose at {row['propose_fraction_of_copy']:.2f} of copy"
                      if "propose_fraction_of_copy" in row else ""))
    return rows


def stage_calls(target, drafter, state, k, *, impl, tree=None):
    """Propose (``propose_tree`` for a ``tree``) and verify as thunks of their own programs, to time
    or profile alone (``state`` itself is left alone: the verify runs in place on a copy of its
    cache); a tree's verify runs its own tree's mask."""
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
    key = jax.random.key(0)
    if tree is None:
        fn = lambda d, ds, c: d.propose(ds, c, num_draft_tokens=k, params=GREEDY, key=key)[0]  # noqa: E731
    else:
        fn = lambda d, ds, c: d.propose_tree(ds, c, shape=tree, params=GREEDY, key=key)[0]  # noqa: E731
    # Also compiled as the on-device loops are (command buffers, its draft scan one graph): a chain's
    # draft steps as they run inside generation, free of the scan's per-step launches from the host.
    propose, propose_loop = jax.jit(fn), jax.jit(fn, compiler_options=LOOP_COMPILER_OPTIONS)
    mask = None if tree is None else propose(drafter, state.draft_state, ctx).mask
    tokens = jnp.zeros((state.history.shape[0], k + 1), jnp.int32)
    verify = decode.in_place(decode.verify_pass(drafter.capture, impl), target, tokens,
                             jax.tree.map(jnp.copy, state.target_kv), mask)
    return dict(propose=lambda: propose(drafter, state.draft_state, ctx),
                propose_loop_options=lambda: propose_loop(drafter, state.draft_state, ctx), verify=verify)
