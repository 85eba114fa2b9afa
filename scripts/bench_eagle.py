"""EAGLE-3 speculation round vs plain decode, and the draft catch-up with / without dead-row slicing.

Random bf16 weights made on the device: a Llama-3.1-8B-shaped target (32 layers, hidden 4096,
32/8 heads, head_dim 128, intermediate 14336, vocab 128256) and an EAGLE-3-shaped head (one
midlayer reading 2*4096, fc 3*4096 -> 4096, draft vocab 32000). ``--tiny`` runs tiny shapes
(CPU smoke test).

Measured, for each batch size (median over repeats after warm-up, ``block_until_ready``):

* ``decode_step``: one plain decode step (``jspec.engine.decode_step_jit``, donated state);
* ``round[k]``: one speculation round (propose k drafts, verify k+1 rows, accept, catch-up),
  ``jspec.speculative.speculative_round`` jitted with the state donated, k = 1..8;
* ``catch_up[k]``: the draft catch-up over k+1 verify rows plus the head for the next first
  draft: ``sliced`` (rows cut to the last accepted one right after the K/V write),
  ``layer_unsliced`` (whole layer over all rows, head on the kept row), ``unsliced`` (layer,
  final norm and LM head over all rows, then the row is picked).

Random weights accept ~no drafts, so rounds advance one token; the timing of a round does not
depend on how many drafts are accepted (all k+1 rows are verified and caught up).

  python scripts/bench_eagle.py --out benchmarks/eagle3_round.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from jspec.benchmarking import PRESETS, environment, time_steps, write_json
from jspec.config import LlamaConfig
from jspec.drafters import Eagle3, Eagle3Config, init_eagle3_head
from jspec.drafters._head import HeadState
from jspec.engine import DecodeState, decode_step_jit
from jspec.models.llama import init_params
from jspec.sampling import SamplingParams
from jspec.speculative import SpecState, speculative_round

EAGLE3_8B = dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128,
                 draft_vocab_size=32000, rope_theta=10000.0, max_position_embeddings=2048)
EAGLE3_TINY = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                   draft_vocab_size=200, rope_theta=10000.0, max_position_embeddings=4096)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)), help="draft lengths k")
    p.add_argument("--catch-up-ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--impl", default="auto", choices=["auto", "pallas", "xla"])
    p.add_argument("--compile-threads", type=int, default=8, help="XLA compiles run in parallel threads")
    p.add_argument("--catch-up-only", action="store_true", help="measure only the catch-up step")
    p.add_argument("--catch-up-calls", type=int, default=50,
                   help="catch-up calls per timing sample, issued back to back (sub-ms programs: host sync would dominate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/eagle3_round.json")
    return p.parse_args(argv)


def timed_loop(fn, state, warmup, repeats, calls=1):
    """Median milliseconds per donated call (see ``jspec.benchmarking.time_steps``)."""
    timing, state = time_steps(fn, state, warmup=warmup, repeats=repeats, calls=calls)
    stats = timing.as_dict()
    if calls > 1:
        stats["calls_per_sample"] = calls
    return stats, state


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    tc = PRESETS["tiny"] if args.tiny else PRESETS["llama-3.1-8b"]
    hs = EAGLE3_TINY if args.tiny else EAGLE3_8B
    layer = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=hs["hidden_size"], intermediate_size=hs["intermediate_size"],
        num_layers=1, num_heads=hs["num_heads"], num_kv_heads=hs["num_kv_heads"], head_dim=hs["head_dim"],
        max_position_embeddings=hs["max_position_embeddings"], rms_norm_eps=1e-5, rope_theta=hs["rope_theta"],
    )
    hc = Eagle3Config(layer=layer, draft_vocab_size=hs["draft_vocab_size"], target_hidden_size=tc.hidden_size,
                      aux_layers=(0, 1, 1) if args.tiny else None)  # default [2, L//2, L-3] = [2, 16, 29]
    key = jax.random.key(args.seed)
    target = jax.jit(init_params, static_argnums=(0, 2))(tc, key, dtype)
    head = jax.jit(lambda k: init_eagle3_head(hc, k, dtype))(jax.random.fold_in(key, 1))
    drafter = Eagle3(head, impl=args.impl).bind(target)
    max_len = -(-(args.context + (args.warmup + args.repeats + 2) * (max(args.ks) + 2) * 2) // 128) * 128
    params = SamplingParams()
    H, F = tc.hidden_size, len(drafter.capture) * tc.hidden_size

    result = dict(
        environment=environment(dtype, args.seed),
        shapes=dict(
            target=dataclasses.asdict(tc), eagle3_layer=dataclasses.asdict(layer),
            draft_vocab_size=hc.draft_vocab_size, aux_layers=list(drafter.capture),
            context=args.context, cache_max_len=max_len, batches=args.batches, ks=args.ks,
            catch_up_ks=args.catch_up_ks, impl=args.impl,
        ),
        decode_step={}, round={}, catch_up={},
    )

    def spec_state(batch):
        kv = target.init_cache(batch, max_len)
        kv = dataclasses.replace(kv, lengths=jnp.full((batch,), args.context, jnp.int32))
        dkv = drafter._init_kv(batch, max_len, dtype)
        dkv = dataclasses.replace(dkv, lengths=jnp.full((batch,), args.context, jnp.int32))
        def zeros():  # distinct buffers: the state is donated
            return jnp.zeros((batch,), jnp.int32)

        history = jax.random.randint(jax.random.key(2), (batch, max_len), 0, tc.vocab_size, jnp.int32)
        return SpecState(
            target_kv=kv, draft_state=HeadState(dkv, jnp.zeros((batch, layer.hidden_size), dtype)),
            history=history, prompt_lengths=zeros() + args.context, num_generated=zeros() + 1,
            features=tuple(jnp.zeros((batch, H), dtype) for _ in drafter.capture),
            done=jnp.zeros((batch,), bool), key=jax.random.key(3), rounds=zeros(), accepted=zeros(),
        )

    def decode_state(batch):
        kv = target.init_cache(batch, max_len)
        kv = dataclasses.replace(kv, lengths=jnp.full((batch,), args.context, jnp.int32))
        return DecodeState(kv=kv, last_token=jnp.zeros((batch,), jnp.int32), output=jnp.zeros((batch, 8), jnp.int32),
                           num_generated=jnp.zeros((batch,), jnp.int32),
                           done=jnp.zeros((batch,), bool), step=jnp.int32(0), key=jax.random.key(4))

    # --- compile everything up front (in parallel threads) ------------------------------
    round_jit = jax.jit(
        speculative_round, static_argnames=("num_draft_tokens", "params", "eos_ids", "impl"), donate_argnames=("state",)
    )
    big = jnp.int32(2**30)

    def catch_up_fn(variant, d, kv, base, tokens, feats, last):
        if variant == "unsliced":
            kv = dataclasses.replace(kv, lengths=base)
            x_all, kv = d.run_rows(kv, tokens, d._target_features(feats), from_target=True)
            logits_all = d._logits(x_all)  # [B, W, V_d]
            idx = last[:, None, None]
            logits = jnp.take_along_axis(logits_all, idx, axis=1)[:, 0]
            hidden = jnp.take_along_axis(x_all, idx, axis=1)[:, 0]
            return dataclasses.replace(kv, lengths=base + last + 1), hidden, logits
        st = d.catch_up(kv, base, tokens, feats, last, slice_dead_rows=variant == "sliced")
        return st.kv, st.hidden, d._logits(st.hidden)

    catch_up_jit = jax.jit(catch_up_fn, static_argnums=0, donate_argnums=2)

    jobs = []  # (kind, batch, k, variant, lowered, args)
    for b in args.batches if not args.catch_up_only else []:
        ds = jax.eval_shape(lambda: decode_state(b))
        jobs.append(("decode_step", b, None, None, decode_step_jit.lower(target, ds, params=params, eos_ids=(), impl=args.impl)))
        ss = jax.eval_shape(lambda: spec_state(b))
        for k in args.ks:
            low = round_jit.lower(target, drafter, ss, num_draft_tokens=k, params=params, eos_ids=(),
                                  max_new_tokens=big, impl=args.impl)
            jobs.append(("round", b, k, None, low))
    for b in args.batches:
        for k in args.catch_up_ks:
            w = k + 1
            kv = jax.eval_shape(lambda: drafter._init_kv(b, max_len, dtype))
            i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
            toks = jax.ShapeDtypeStruct((b, w), jnp.int32)
            feats = tuple(jax.ShapeDtypeStruct((b, w, H), dtype) for _ in drafter.capture)
            for variant in ("sliced", "layer_unsliced", "unsliced"):
                jobs.append(("catch_up", b, k, variant, catch_up_jit.lower(variant, drafter, kv, i32, toks, feats, i32)))
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        compiled = list(tqdm(pool.map(lambda j: j[4].compile(), jobs), total=len(jobs), desc="compile"))
    result["compile_s"] = time.perf_counter() - t0
    del F

    # --- measure ------------------------------------------------------------------------
    states = {}
    for (kind, b, k, variant, _), exe in tqdm(list(zip(jobs, compiled)), desc="measure"):
        if kind == "decode_step":
            fn = functools.partial(exe, target)
            stats, _ = timed_loop(lambda s: fn(s), decode_state(b), args.warmup, args.repeats)
            result["decode_step"][str(b)] = stats
        elif kind == "round":
            state = states.pop(b) if b in states else spec_state(b)
            stats, state = timed_loop(lambda s: exe(target, drafter, s, max_new_tokens=big), state, args.warmup, args.repeats)
            states[b] = state
            decode = result["decode_step"][str(b)]["median_ms"]
            stats["vs_decode_step"] = stats["median_ms"] / decode
            stats["break_even_tokens_per_round"] = stats["median_ms"] / decode
            result["round"].setdefault(str(b), {})[str(k)] = stats
        else:
            w = k + 1
            base = jnp.full((b,), args.context, jnp.int32)
            toks = jax.random.randint(jax.random.key(5), (b, w), 0, tc.vocab_size, jnp.int32)
            feats = tuple(jax.random.normal(jax.random.key(6 + i), (b, w, H), dtype) for i in range(len(drafter.capture)))
            last = jnp.asarray(np.arange(b) % w, jnp.int32)

            def step(kv):
                kv, hidden, logits = exe(drafter, kv, base, toks, feats, last)
                return kv

            stats, _ = timed_loop(step, drafter._init_kv(b, max_len, dtype), args.warmup, args.repeats,
                                  calls=args.catch_up_calls)
            result["catch_up"].setdefault(str(b), {}).setdefault(str(k), {})[variant] = stats
        write_json(args.out, result)  # partial results survive a time limit
    for b, per_k in result["catch_up"].items():
        for k, v in per_k.items():
            if "sliced" in v and "unsliced" in v:
                v["unsliced_over_sliced"] = v["unsliced"]["median_ms"] / v["sliced"]["median_ms"]
    write_json(args.out, result)
    print(f"wrote {args.out}")
    for b in args.batches:
        if not args.catch_up_only:
            d = result["decode_step"][str(b)]["median_ms"]
            rounds = " ".join(f"k{k}={v['median_ms']:.2f}" for k, v in result["round"][str(b)].items())
            print(f"batch {b}: decode {d:.2f} ms | rounds (ms) {rounds}")
        else:
            print(f"batch {b}:")
        for k, v in result["catch_up"][str(b)].items():
            print(f"  catch-up k={k}: " + " ".join(f"{n}={v[n]['median_ms']:.3f}ms" for n in ("sliced", "layer_unsliced", "unsliced")))


if __name__ == "__main__":
    main()
