"""Is a decode loop iteration's own cost (condition, body graph launch) a visible part of a small
model's ms/token? Plain decoding (batch 1, context 512, bf16 random weights) in an on-device loop
that runs 1, 2 or 4 decode steps per iteration, compiled with the library's loop options; ms/token
= (T(100) - T(4)) / 96, each twice. Run from the tree::

    PYTHONPATH=. OUT=. python benchmarks/probes/decode_steps_per_iteration.py smollm2-135m llama-3.2-1b
"""
import json, os, sys
import jax, jax.numpy as jnp
import jspec
from jspec import engine
from jspec.bench.presets import GREEDY, PRESETS, confident, random_prompts
from jspec.bench.timing import time_fn
from jspec.compile_options import LOOP_COMPILER_OPTIONS

CONTEXT, BATCH = 512, 1
out = os.environ.get("OUT", ".")
res = {}
for name in sys.argv[1:]:
    config = PRESETS[name]
    model = confident(jax.jit(jspec.init_params, static_argnums=(0, 2))(config, jax.random.key(0), jnp.bfloat16), 0)
    tokens = random_prompts(BATCH, CONTEXT, config.vocab_size, 0)
    lengths = jnp.full((BATCH,), CONTEXT, jnp.int32)
    width = 128
    max_len = engine.cache_length(CONTEXT, CONTEXT + width)

    def make(per_iteration):
        def run(model, tokens, lengths, n):
            state = engine.start_decoding(model, tokens, lengths, jax.random.key(0), params=GREEDY, eos_ids=(),
                                          output_width=width, max_len=max_len)
            def body(s):
                for _ in range(per_iteration):
                    s = engine.decode_step(model, s, params=GREEDY, eos_ids=())
                return s
            s = jax.lax.while_loop(lambda s: (s.step < n) & ~jnp.all(s.done), body, state)
            return s.output
        run = jax.jit(run, compiler_options=LOOP_COMPILER_OPTIONS)
        return lambda n: run(model, tokens, lengths, jnp.int32(n))

    row = {}
    for rep in range(2):
        for per in (1, 2, 4):
            loop = make(per)
            short, long = time_fn(lambda: loop(4), repeats=10), time_fn(lambda: loop(100), repeats=10)
            ms = (long.median_s - short.median_s) / 96 * 1e3
            row.setdefault(f"steps_per_iteration_{per}", []).append(ms)
            print(name, per, round(ms, 4), flush=True)
    res[name] = row
json.dump(res, open(f"{out}/decode_unroll_probe.json", "w"), indent=1)
