"""A speculation round against a plain decode step: the measurement behind ``spec``'s ``round`` rows
(also used by ``catch-up`` and ``frozen-kv``).

For each k (and each tree) one jitted round (propose, verify k+1 rows, accept, commit; state donated)
against one plain decode step, medians of back-to-back calls, with the round's bandwidth bound
(``roofline_ratio``). Staged rounds also time their propose and verify alone as separate programs
(accept + commit = round - propose - verify), the propose once more inside an on-device loop of
proposes (as generation runs it: no host between its launches), its bytes and their fraction of
the copy bandwidth, and on a GPU the kernels of the round, its stages and a step side by side.
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
from jspec.execution import with_kernels

NO_LIMIT = 1 << 30  # max_new_tokens of a timed round: never reached
PROPOSES_IN_LOOP = 16  # the long run of the in-loop propose timing; the short one is a single propose


# One jitted prefill for every k: the initial state does not depend on k.
_start = jax.jit(speculative.start, static_argnames=("params", "eos_ids", "capacity", "max_len"))
_round = jax.jit(speculative.speculative_round, static_argnames=("num_draft_tokens", "params", "eos_ids", "tree"),
                 donate_argnames=("state",))


def spec_state(target, drafter, batch, context, capacity, impl, seed=0):
    """The speculation state after the prefill of random prompts of ``context`` tokens."""
    tokens = random_prompts(batch, context, target.config.vocab_size, seed)
    lengths = jnp.full((batch,), context, jnp.int32)
    target = with_kernels(target, impl)
    return _start(target, drafter.bind(target), tokens, lengths, jax.random.key(seed), params=GREEDY, eos_ids=(),
                  capacity=capacity, max_len=capacity)


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
    target = with_kernels(target, impl)
    drafter = drafter.bind(target)
    shapes = {k: None for k in ks} | {tree: tree for tree in trees}
    fresh = lambda: spec_state(target, drafter, batch, context, capacity, impl)  # noqa: E731
    abstract = jax.eval_shape(fresh)
    limit = jnp.int32(NO_LIMIT)
    compiled = compile_all({key: _round.lower(target, drafter, abstract, params=GREEDY, eos_ids=(),
                                              num_draft_tokens=key if tree is None else tree.num_nodes, tree=tree,
                                              max_new_tokens=limit)
                            for key, tree in shapes.items()}, compile_threads)
    step = lambda s: engine.decode_step_jit(target, s, params=GREEDY, eos_ids=())  # noqa: E731
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
            calls, loops = stage_calls(target, drafter, state, k, impl=impl, tree=tree)
            stages = {name: time_fn(call, repeats=repeats) for name, call in calls.items()}
            in_loop, loop_timings = time_proposes_in_loop(loops, repeats=repeats)
            stages |= loop_timings
            row.update(propose_ms=stages["propose"].median_s * 1e3, verify_ms=stages["verify"].median_s * 1e3,
                       **{name.removesuffix("_s") + "_ms": seconds * 1e3 for name, seconds in in_loop.items()})
            row["accept_commit_ms"] = row["round_ms"] - row["propose_ms"] - row["verify_ms"]
            row["timings"].update({name: t.as_dict() for name, t in stages.items()})
            read = propose_bytes(drafter, k) if tree is None else None
            if read:
                row["propose_bytes"] = read
                if copy_bytes_per_s:  # the draft steps' bandwidth roofline, as they run inside generation
                    row["propose_fraction_of_copy"] = read / in_loop["propose_net_s"] / copy_bytes_per_s
            # The kernels of one round, its two stages and one decode step side by side (profiler;
            # None off a GPU). The stages read the last state, so they go first: the round donates
            # it; the step takes a fresh one.
            profiles = dict(propose=decode.kernel_profile(calls["propose"]),
                            verify=decode.kernel_profile(calls["verify"]))
            profiles["round"] = decode.kernel_profile(
                lambda key=key, state=state: compiled[key](target, drafter, state, max_new_tokens=limit))
            step_state = decode.decode_state(target, batch, context, capacity, impl)
            profiles["decode_step"] = decode.kernel_profile(lambda: step(step_state))
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
    cache; a tree's verify runs its own tree's mask), and the on-device loops of
    :func:`time_proposes_in_loop`: ``loops["propose"](n)``, ``n`` of those proposes in one loop
    (:func:`proposes_in_loop`), and ``loops["empty"](n)``, the same loop with nothing in its body."""
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
    key = jax.random.key(0)
    def fn(d, ds, c):  # (drafts, new draft state)
        if tree is not None:
            return d.propose_tree(ds, c, shape=tree, params=GREEDY, key=key)
        tokens, _, new_state = d.propose(ds, c, num_draft_tokens=k, params=GREEDY, key=key)
        return tokens, new_state

    propose = jax.jit(lambda d, ds, c: fn(d, ds, c)[0])
    loops = dict(propose=proposes_in_loop(fn), empty=proposes_in_loop(lambda d, ds, c: (jnp.int32(0), ds)))
    mask = None if tree is None else propose(drafter, state.draft_state, ctx).mask
    tokens = jnp.zeros((state.history.shape[0], k + 1), jnp.int32)
    verify = decode.in_place(decode.verify_pass(drafter.capture, impl), target, tokens,
                             jax.tree.map(jnp.copy, state.target_kv), mask)
    return (dict(propose=lambda: propose(drafter, state.draft_state, ctx), verify=verify),
            {name: (lambda n, loop=loop: loop(drafter, state.draft_state, ctx, jnp.int32(n)))
             for name, loop in loops.items()})


def time_proposes_in_loop(loops, *, repeats) -> tuple[dict, dict]:
    """Seconds per propose inside the on-device loop, (T(n) - T(1)) / (n - 1) of medians with
    n = ``PROPOSES_IN_LOOP`` (``loops`` from :func:`stage_calls`): ``propose_in_loop_s``, one
    propose and one iteration of the loop around it; ``loop_iteration_s``, an iteration with an
    empty body (the loop's own counter, condition and body launch, which generation pays once a
    round, not once a propose); ``propose_net_s``, the difference. And the timings by name."""
    timings = {f"{name}_in_loop_{n}": time_fn(lambda n=n, loop=loop: loop(n), repeats=repeats)
               for name, loop in loops.items() for n in (1, PROPOSES_IN_LOOP)}

    def slope(name):
        return ((timings[f"{name}_in_loop_{PROPOSES_IN_LOOP}"].median_s - timings[f"{name}_in_loop_1"].median_s)
                / (PROPOSES_IN_LOOP - 1))

    seconds = dict(propose_in_loop_s=slope("propose"), loop_iteration_s=slope("empty"))
    seconds["propose_net_s"] = seconds["propose_in_loop_s"] - seconds["loop_iteration_s"]
    return seconds, timings


def proposes_in_loop(propose):
    """``run(drafter, draft_state, ctx, n)``: ``propose(drafter, draft_state, ctx)`` (its drafts and
    its new draft state) ``n`` times (traced) back to back in one on-device loop compiled as
    generation's loops are (command buffers), so its draft steps launch as they do inside generation:
    per propose = (T(n) - T(1)) / (n - 1), the way ``decode`` takes ms/token. Every iteration reads
    its inputs through an optimization barrier tied to the counter, which keeps XLA from hoisting the
    loop-invariant propose out of the loop; the drafts' sum keeps it alive. The loop carries the
    draft state's cache buffers as each propose leaves them (:func:`rewound`), so they are updated in
    place as in generation, not copied from a read-only input every iteration."""

    def run(drafter, draft_state, ctx, n):
        def body(i, carry):
            total, state = carry
            state_i, ctx_i, _ = jax.lax.optimization_barrier((state, ctx, i))
            drafts, new_state = propose(drafter, state_i, ctx_i)  # a chain's tokens, or a tree
            total += sum(jnp.sum(leaf, dtype=jnp.int32) for leaf in jax.tree.leaves(drafts))
            return total, rewound(new_state, draft_state)

        return jax.lax.fori_loop(0, n, body, (jnp.int32(0), draft_state))[0]

    return jax.jit(run, compiler_options=LOOP_COMPILER_OPTIONS)


def rewound(new_state, draft_state):
    """``draft_state`` with the cache buffers (leaves of rank >= 4, ``[batch, heads, rows, head_dim]``)
    of ``new_state``: the rows a propose wrote lie past the lengths it started from, so the next
    propose reads the cache the first one read and writes the same rows."""
    return jax.tree.map(lambda new, old: new if new.ndim >= 4 else old, new_state, draft_state)
