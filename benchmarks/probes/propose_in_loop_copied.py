"""The EAGLE-3-shaped propose (8B shapes, k = 4, batch 1, context 512, bf16 random weights) in the
eleventh session's on-device loop, which reads the draft state as a loop-invariant input: XLA then
copies the draft cache before every propose writes its rows into it. Per propose (T(16) - T(1)) / 15
with and without command buffers, twice each, and the kernels of a loop of four proposes (own GPU
time). ``jspec.bench.rounds.proposes_in_loop`` now carries the cache through the loop instead;
``propose_in_loop.py`` times that. Run from the tree::

    PYTHONPATH=. OUT=. TAG=main python benchmarks/probes/propose_in_loop_copied.py   # loop_diag_<TAG>.json
"""
import dataclasses, json, os
import jax, jax.numpy as jnp
import jspec
from jspec.bench.presets import GREEDY, PRESETS, confident
from jspec.bench.roofline import copy_bandwidth, propose_bytes
from jspec.bench.rounds import spec_state
from jspec.bench.spec import make_drafter
from jspec.bench.timing import own_times, time_fn, traced_events
from jspec.drafters.base import RoundContext
from jspec.compile_options import LOOP_COMPILER_OPTIONS

K, CONTEXT, CAPACITY = 4, 512, 1024
out, tag = os.environ.get("OUT", "."), os.environ.get("TAG", "tree")
config = dataclasses.replace(PRESETS[os.environ.get("TARGET", "llama-3.1-8b")], num_layers=2)
target = confident(jax.jit(jspec.init_params, static_argnums=(0, 2))(config, jax.random.key(0), jnp.bfloat16), 0)
drafter = make_drafter("eagle3", target, draft=None, dtype=jnp.bfloat16, seed=0, impl="auto")
state = spec_state(target, drafter, 1, CONTEXT, CAPACITY, "auto")
ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
fn = lambda d, ds, c: d.propose(ds, c, num_draft_tokens=K, params=GREEDY, key=jax.random.key(0))[0]
copy = copy_bandwidth(2 << 30)
read = propose_bytes(drafter, K)

def loop_with(options):
    def run(drafter, draft_state, ctx, n):
        def body(i, total):
            state_i, ctx_i, _ = jax.lax.optimization_barrier((draft_state, ctx, i))
            return total + jnp.sum(fn(drafter, state_i, ctx_i))
        return jax.lax.fori_loop(0, n, body, jnp.int32(0))
    f = jax.jit(run, compiler_options=options)
    return lambda n: f(drafter, state.draft_state, ctx, jnp.int32(n))

result = dict(tag=tag, propose_bytes=read, copy_tb_s=copy["tb_s"], device=str(jax.devices()[0]))
for name, opts in (("command_buffers", LOOP_COMPILER_OPTIONS), ("no_command_buffers", {})):
    loop = loop_with(opts)
    runs = []
    for _ in range(2):
        t1 = time_fn(lambda: loop(1), repeats=10).median_s
        t16 = time_fn(lambda: loop(16), repeats=10).median_s
        s = (t16 - t1) / 15
        runs.append(dict(ms=s * 1e3, fraction=read / s / copy["bytes_per_s"], t1_ms=t1 * 1e3))
    events = sorted(traced_events([lambda: loop(4)]))
    if not events:
        print(name, runs); continue
    t0 = events[0][0]
    tl = [dict(start_us=round((st - t0) / 1e3, 2), name=nm, own_us=round(own * 1e6, 2), dur_us=round(d / 1e3, 2))
          for (st, nm, d), (_, own) in zip(events, own_times(events))]
    span = (events[-1][0] + events[-1][2] - t0) / 1e3
    busy = sum(x["own_us"] for x in tl)
    result[name] = dict(runs=runs, kernels_in_4=len(tl), span_us_4=span, busy_us_4=busy, timeline=tl)
    print(name, runs, "kernels", len(tl), "span", span, "busy", busy, flush=True)
prop = jax.jit(fn)
ev = sorted(traced_events([lambda: prop(drafter, state.draft_state, ctx)] * 3))
if ev:
    result["dispatched_span_us"] = (ev[-1][0] + ev[-1][2] - ev[0][0]) / 1e3 / 3
    print("dispatched events", len(ev))
with open(f"{out}/loop_diag_{tag}.json", "w") as f:
    json.dump(result, f, indent=1)
