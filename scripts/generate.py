#!/usr/bin/env python
"""Generate with jspec: plain decoding and speculative decoding side by side.

By default it loads the built-in tiny Llama-3 checkpoint (checkpoints/tiny-llama3, random
weights made by transformers), runs a ragged batch of prompts through plain greedy decoding
and through speculative decoding with each drafter, checks that the tokens agree, and
prints the tokens, acceptance statistics and timings.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_MODEL = ROOT / "checkpoints" / "tiny-llama3"
DEFAULT_PROMPTS = ["5 17 42 8 99 3 61 5 17 42", "7 120", "11 12 13 14 15 11 12 13"]


def _load(path: str, dtype):
    import jspec

    p = Path(path)
    return jspec.restore(p) if (p / "jspec_config.json").exists() else jspec.load_hf(p, dtype=dtype)


def _timed(fn):
    fn()  # compile
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="HF checkpoint dir or jspec checkpoint dir")
    parser.add_argument("--draft", default=None, help="draft model dir for the draft-model drafter (default: the target itself)")
    parser.add_argument("--prompt", action="append", help="space-separated token ids; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    parser.add_argument("--drafter", nargs="+", default=["ngram", "draft-model"], choices=["ngram", "draft-model"])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--eos-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, help="parameter dtype, e.g. bfloat16 (default: as stored)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jspec
    from jspec.drafters import DraftModel, NGram

    try:
        prompts = [[int(t) for t in p.split()] for p in (args.prompt or DEFAULT_PROMPTS)]
    except ValueError:
        parser.error("--prompt takes space-separated integer token ids")
    dtype = getattr(jnp, args.dtype) if args.dtype else None
    try:
        target = _load(args.model, dtype)
        draft = _load(args.draft, dtype) if args.draft else target
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=args.eos_id)
    key = jax.random.key(args.seed)
    c = target.config
    print(f"target: {c.architecture}, {c.num_layers} layers, vocab {c.vocab_size}, {target.dtype}, "
          f"on {jax.devices()[0].device_kind}")

    try:
        plain, plain_s = _timed(lambda: jspec.generate(target, prompts, args.max_new_tokens, key=key, **sampling))
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    print(f"\nplain decoding: {sum(map(len, plain)) / plain_s:.0f} tokens/s")
    for prompt, out in zip(prompts, plain):
        print(f"  {prompt} -> {out}")

    drafters = {"ngram": NGram(max_ngram=3), "draft-model": DraftModel(draft)}
    for name in args.drafter:
        result, spec_s = _timed(lambda: jspec.speculative_generate(
            target, drafters[name], prompts, args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
            key=key, **sampling,
        ))
        same = "identical to plain decoding" if result.tokens == plain else "differs from plain decoding"
        if args.temperature > 0:
            same = "sampled (same distribution as plain decoding)"
        lengths = ", ".join(f"{x:.2f}" for x in result.stats["mean_acceptance_length"])
        print(f"\nspeculative, {name}, k={args.num_draft_tokens}: {sum(map(len, result.tokens)) / spec_s:.0f} "
              f"tokens/s, {same}")
        print(f"  mean acceptance length per sequence (tokens per verify incl. bonus): {lengths}")
        for prompt, out in zip(prompts, result.tokens):
            print(f"  {prompt} -> {out}")


if __name__ == "__main__":
    main()
