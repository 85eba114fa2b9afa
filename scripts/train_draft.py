#!/usr/bin/env python
"""Train an EAGLE-3 draft head for a target model with jspec, and export it in the HF layout.

The target stays frozen; its features are computed on the fly by the same forward jspec decodes
with, and the head's loss runs through the drafter's own inference functions (``jspec.training``),
unrolled over --ttt draft steps (the EAGLE-3 paper's training-time test). Training data this
machine has offline: chat turns the target writes itself for a committed prompt list (``chat``),
and the Python standard library's source (``stdlib``). The reduced draft vocabulary (--draft-vocab
ids) comes from the corpus' token frequencies.

Everything goes under --out: ``data.npz`` (the tokenised corpus, built once), ``checkpoint/``
(the training state every --checkpoint-every steps; --resume continues from it, and a resumed run
takes the same batches as an uninterrupted one), ``head/`` (the final head: ``config.json`` +
``model.safetensors``, loadable with ``jspec.drafters.Eagle3.load``). A progress bar shows the loss
and the top-1 accuracy of each draft step; every --eval-every steps the held-out acceptance length
(greedy, the benchmark's prompts) is printed. Deterministic for a --seed.

  .venv/bin/python scripts/train_draft.py --target smollm2-135m-instruct --out ~/.cache/jspec/heads/smollm2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jspec.cli import OneLineErrorParser, positive_int

DEFAULT_TARGET = "smollm2-135m-instruct"


def _sources(text: str) -> tuple[str, ...]:
    names = tuple(t for t in text.split(",") if t)
    bad = [n for n in names if n not in ("chat", "stdlib")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of chat,stdlib, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=Path(__file__).name, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="a known model name, a GGUF file or a checkpoint "
                                                            "directory (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="directory for data, checkpoints and the head")
    p.add_argument("--data", type=_sources, default=("chat", "stdlib"), help="training sources (default: chat,stdlib)")
    p.add_argument("--chat-tokens", type=positive_int, default=192, help="tokens the target writes per chat prompt")
    p.add_argument("--chat-samples", type=positive_int, default=1,
                   help="answers per chat prompt: the greedy one, then sampled ones at --chat-temperature")
    p.add_argument("--chat-temperature", type=float, default=0.8, help="temperature of the sampled answers")
    p.add_argument("--stdlib-bytes", type=positive_int, default=6_000_000, help="bytes of stdlib source to read")
    p.add_argument("--draft-vocab", type=positive_int, default=8192, help="reduced draft vocabulary size")
    p.add_argument("--width", type=positive_int, default=256, help="tokens per training window")
    p.add_argument("--batch", type=positive_int, default=8, help="windows per step")
    p.add_argument("--train-steps", type=positive_int, default=2000, help="optimizer steps in all")
    p.add_argument("--ttt", type=positive_int, default=4, help="draft steps unrolled (training-time test)")
    p.add_argument("--anchors", type=positive_int, default=16, help="anchor rows per window for steps >= 1")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=500, help="held-out acceptance length every N steps (0: end)")
    p.add_argument("--eval-prompts", type=positive_int, default=12, help="held-out prompts evaluated")
    p.add_argument("--eval-k", type=positive_int, default=4, help="draft tokens per round in the evaluation")
    p.add_argument("--checkpoint-every", type=positive_int, default=250)
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="training precision")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="bfloat16", help="the head's dtype")
    return p


def build_data(args, target, tokenizer):
    """The tokenised corpus (cached in --out/data.npz) and a description of where it came from."""
    import numpy as np
    from tqdm.auto import tqdm

    from jspec import training

    path = args.out / "data.npz"
    if path.exists():
        stored = np.load(path, allow_pickle=False)
        sequences = [s.tolist() for s in np.split(stored["tokens"], stored["offsets"][1:-1])]
        return sequences, json.loads(str(stored["origin"]))
    sequences, origin = [], {}
    if "chat" in args.data:
        prompts = training.chat_prompts()
        described = []
        with tqdm(total=len(prompts) * args.chat_samples, desc="chat data (the target writes)") as bar:
            for sample in range(args.chat_samples):
                seqs, about = training.self_generated(
                    target, tokenizer, prompts, new_tokens=args.chat_tokens, seed=args.seed + sample,
                    temperature=0.0 if sample == 0 else args.chat_temperature, progress=bar.update)
                sequences += seqs
                described.append(about)
        origin["chat"] = "; ".join(described)
    if "stdlib" in args.data:
        seqs, origin["stdlib"] = training.stdlib_source(tokenizer, max_bytes=args.stdlib_bytes)
        sequences += seqs
    origin["tokens"] = int(sum(len(s) for s in sequences))
    offsets = np.cumsum([0] + [len(s) for s in sequences])
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=np.concatenate([np.asarray(s, np.int32) for s in sequences]), offsets=offsets,
             origin=json.dumps(origin))
    return sequences, origin


def new_drafter(target, d2t, key, dtype):
    """A random EAGLE-3 head shaped like one of the target's layers, reading its [2, L//2, L-3] layers."""
    import dataclasses

    from jspec.drafters import Eagle3, Eagle3Config, init_eagle3_head

    c = target.config
    layer = dataclasses.replace(c, num_layers=1, tie_word_embeddings=False)
    config = Eagle3Config(layer=layer, draft_vocab_size=d2t.shape[0], target_hidden_size=c.hidden_size)
    head = dataclasses.replace(init_eagle3_head(config, key, dtype), d2t=d2t if d2t.shape[0] < c.vocab_size else None)
    return Eagle3(head, impl="xla").bind(target)


def held_out_acceptance(target, drafter, tokenizer, args) -> float:
    """Mean acceptance length (greedy) on the benchmark's held-out prompts, 64 new tokens."""
    import dataclasses

    import jspec
    from jspec.bench.accept import prompt_ids, prompt_set

    prompts = [prompt_ids(tokenizer, p) for p in prompt_set()[: args.eval_prompts]]
    result = jspec.speculative_generate(target, dataclasses.replace(drafter, impl="auto"), prompts, 64,
                                        num_draft_tokens=args.eval_k)
    return float(result.stats["mean_acceptance_length"].mean())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    import jspec
    from jspec import training
    from jspec.drafters.eagle3 import save_head
    from jspec.text import Tokenizer

    dtype = jnp.dtype(args.dtype)
    started = time.time()
    target_path = jspec.io.resolve_model(args.target)
    target = jspec.io.load_model(target_path, dtype=dtype)
    tokenizer = Tokenizer.from_pretrained(target_path)
    sequences, origin = build_data(args, target, tokenizer)
    tokens, lengths = training.windows(sequences, args.width)
    if len(tokens) < args.batch:
        raise SystemExit(f"{Path(__file__).name}: error: the corpus gives {len(tokens)} windows, fewer than --batch")
    d2t = training.draft_vocabulary(sequences, min(args.draft_vocab, target.config.vocab_size),
                                    target.config.vocab_size)
    key = jax.random.key(args.seed)
    drafter = new_drafter(target, d2t, jax.random.fold_in(key, 1), dtype)
    cfg = training.TrainConfig(learning_rate=args.lr, total_steps=args.train_steps, steps=args.ttt,
                               anchors=args.anchors, warmup_steps=min(100, args.train_steps // 10))
    state = training.init_state(drafter, cfg, jax.random.fold_in(key, 2))
    checkpoint = args.out / "checkpoint"
    if args.resume and checkpoint.exists():
        state = training.restore_state(checkpoint, state)
    start = int(state.step)
    metadata = dict(data=origin, windows=int(len(tokens)), width=args.width, draft_vocab=int(d2t.shape[0]),
                    ttt_steps=args.ttt, batch=args.batch, learning_rate=args.lr, seed=args.seed,
                    device=str(jax.devices()[0].device_kind), target=args.target)
    bar = tqdm(total=args.train_steps, initial=start, desc="training")

    def after_step(state, metrics):
        step = int(state.step)
        acc = " ".join(f"{a:.2f}" for a in jax.device_get(metrics["accuracy"]))
        bar.set_postfix_str(f"loss {float(metrics['total']):.3f} top-1 per step {acc}")
        bar.update(1)
        if args.eval_every and step % args.eval_every == 0 and step < args.train_steps:
            al = held_out_acceptance(target, training.with_params(drafter, state.params), tokenizer, args)
            tqdm.write(f"step {step}: held-out acceptance length {al:.2f} (k={args.eval_k}, greedy)")
        if step % args.checkpoint_every == 0 or step == args.train_steps:
            training.save_state(state, checkpoint, metadata=metadata)

    batches = training.data.batches(tokens, lengths, args.batch, seed=args.seed, start_step=start)
    state = training.train(state, drafter, target, batches, cfg=cfg, num_steps=args.train_steps - start,
                           callback=after_step)
    bar.close()
    trained = training.with_params(drafter, state.params)
    al = held_out_acceptance(target, trained, tokenizer, args)
    print(f"held-out acceptance length {al:.2f} (k={args.eval_k}, greedy, {args.eval_prompts} prompts)")
    head = jax.tree.map(lambda x: x.astype(args.export_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        trained.head)
    save_head(head, args.out / "head", metadata=dict(metadata, steps=int(state.step), held_out_acceptance=al,
                                                    eval_k=args.eval_k, wall_s=round(time.time() - started, 1)))
    print(f"wrote {args.out / 'head'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
