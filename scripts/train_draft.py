#!/usr/bin/env python
"""Train a draft head for a target model with jspec, and export it in the HF layout: EAGLE-3
(--drafter eagle3, the default), MTP / NextN (--drafter mtp: one extra decoder layer of the
target's type, drafting with the target's own embedding and LM head) or DFlash (--drafter dflash:
--dflash-layers Qwen3 layers drafting a block of --block-size in one forward from the target's
features; its mask token is the highest id the corpus never holds).

The target stays frozen; its features are computed on the fly by the same forward jspec decodes
with, and the head's loss runs through the drafter's own inference functions (``jspec.training``),
unrolled over --ttt draft steps (the EAGLE-3 paper's training-time test). Training data this
machine has offline: chat turns the target writes itself (``chat``: a greedy answer to each of
--chat-prompts committed prompts -- several thousand everyday requests over many domains, a subset
drawn for --seed -- then to prompts that hand it a passage to rewrite, summarise or comment -- its
own answers and standard-library functions -- so that the head learns to copy from context; then
--chat-samples - 1 sampled answers to all of them), and the Python standard library's source
(``stdlib``). The loss distils the target's next-token distribution (--hard-labels: its greedy token). EAGLE-3's reduced draft vocabulary
(--draft-vocab ids) comes from the corpus' token frequencies; MTP drafts over the whole vocabulary.

Everything goes under --out: ``data.npz`` (the tokenised corpus, built once and reused as it is,
also by --resume; --data-file names another, so that heads of several kinds share one), ``checkpoint/``
(the training state every --checkpoint-every steps; --resume continues from it, and a resumed run
takes the same batches as an uninterrupted one), ``head/`` (the final head: ``config.json`` +
``model.safetensors``: EAGLE-3's ``LlamaForCausalLMEagle3`` layout, loadable with
``jspec.drafters.Eagle3.load``, or the MTP layer of a DeepSeek-V3-layout checkpoint, loadable with
``jspec.drafters.MTP.load`` and meant to join the target's weights, or DFlash's published layout,
loadable with ``jspec.drafters.DFlash.load``). A progress bar shows the loss
and the top-1 accuracy of each draft step, also written every --log-every steps to ``train_log.jsonl``;
every --eval-every steps and at the end the held-out acceptance length (greedy, the benchmark's
prompts) is printed and recorded in ``held_out.json``. Deterministic for a --seed.

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


def _count(text: str) -> int | None:
    if text == "all":
        return None
    return positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=Path(__file__).name, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="a known model name, a GGUF file or a checkpoint "
                                                            "directory (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="directory for data, checkpoints and the head")
    p.add_argument("--data-file", type=Path, help="the tokenised corpus, read if it exists, else built and "
                                                  "written there (default: OUT/data.npz)")
    p.add_argument("--drafter", choices=("eagle3", "mtp", "dflash"), default="eagle3",
                   help="the head trained (default: %(default)s); mtp uses the target's LM head, so --draft-vocab "
                        "is ignored")
    p.add_argument("--data", type=_sources, default=("chat", "stdlib"), help="training sources (default: chat,stdlib)")
    p.add_argument("--chat-prompts", type=_count, default=1000,
                   help="committed chat prompts used, drawn for --seed ('all': every one; default: %(default)s)")
    p.add_argument("--chat-tokens", type=positive_int, default=192, help="tokens the target writes per chat prompt")
    p.add_argument("--chat-samples", type=positive_int, default=1,
                   help="answers per chat prompt: the greedy one, then sampled ones at --chat-temperature")
    p.add_argument("--chat-temperature", type=float, default=0.8, help="temperature of the sampled answers")
    p.add_argument("--generate-batch", type=positive_int, default=32, help="prompts per generate call (the GPU "
                                                                           "takes hundreds)")
    p.add_argument("--stdlib-bytes", type=positive_int, default=6_000_000, help="bytes of stdlib source to read")
    p.add_argument("--draft-vocab", type=positive_int, default=8192, help="reduced draft vocabulary size")
    p.add_argument("--width", type=positive_int, default=256, help="tokens per training window")
    p.add_argument("--batch", type=positive_int, default=8, help="windows per step")
    p.add_argument("--train-steps", type=positive_int, default=2000, help="optimizer steps in all")
    p.add_argument("--block-size", type=positive_int, default=8, help="DFlash: the block (B - 1 drafts a round)")
    p.add_argument("--dflash-layers", type=positive_int, default=2, help="DFlash: draft layers")
    p.add_argument("--ttt", type=positive_int, default=4, help="draft steps unrolled (training-time test)")
    p.add_argument("--anchors", type=positive_int, help="anchor rows per window: EAGLE-3 / MTP steps >= 1 start "
                   "there (default 16), DFlash blocks start there (default: a quarter of the rows; the published "
                   "recipe samples up to 512 a sequence)")
    p.add_argument("--hard-labels", action="store_true", help="train on the target's greedy token only (default: "
                                                                  "distil its whole next-token distribution)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=positive_int, default=50, help="steps between lines of train_log.jsonl")
    p.add_argument("--eval-every", type=int, default=500, help="held-out acceptance length every N steps (0: end)")
    p.add_argument("--eval-prompts", type=positive_int, default=12, help="held-out prompts evaluated")
    p.add_argument("--eval-tokens", type=positive_int, default=64,
                   help="new tokens per held-out prompt (default: %(default)s; fewer for a quick smoke run)")
    p.add_argument("--eval-k", type=positive_int, default=4, help="draft tokens per round in the evaluation")
    p.add_argument("--checkpoint-every", type=positive_int, default=250)
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--init", type=Path, metavar="DIR", help="start from a --drafter head exported earlier (an "
                   "OUT/head, or checkpoints/smollm2-dflash): its shapes and weights, a fresh optimizer (a --resume "
                   "checkpoint wins)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="training precision")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16"), default="bfloat16", help="the head's dtype")
    return p


def build_data(args, target, tokenizer):
    """The tokenised corpus (cached in --out/data.npz) and a description of where it came from."""
    import numpy as np
    from tqdm.auto import tqdm

    from jspec import training

    path = args.data_file or args.out / "data.npz"
    if path.exists():
        stored = np.load(path, allow_pickle=False)
        sequences = [s.tolist() for s in np.split(stored["tokens"], stored["offsets"][1:-1])]
        return sequences, json.loads(str(stored["origin"]))
    sequences, origin = [], {}
    if "chat" in args.data:
        with tqdm(desc="chat data (the target writes)", unit=" turns") as bar:
            def answers(prompts, sample):  # sample 0 greedy, the others at --chat-temperature
                return training.self_generated(
                    target, tokenizer, prompts, new_tokens=args.chat_tokens, seed=args.seed + sample,
                    batch_size=args.generate_batch, temperature=0.0 if sample == 0 else args.chat_temperature,
                    progress=bar.update)

            tasks = training.chat_prompts(args.chat_prompts, seed=args.seed)
            greedy, described = answers(tasks, 0)
            texts = (_answer_text(tokenizer, p, s) for p, s in zip(tasks, greedy))
            prose = [text for text in texts if "```" not in text]  # code answers are left to the stdlib's
            code = training.stdlib_functions(len(prose), seed=args.seed)
            transforms = training.transform_prompts(prose, code, seed=args.seed)
            transformed, about = answers(transforms, 0)
            sequences += greedy + transformed
            described = [f"task prompts: {described}", f"passage transforms: {about}"]
            for sample in range(1, args.chat_samples):
                seqs, about = answers(tasks + transforms, sample)
                sequences += seqs
                described.append(f"tasks and transforms, sample {sample}: {about}")
        origin["chat"] = "; ".join(described)
    if "stdlib" in args.data:
        seqs, origin["stdlib"] = training.stdlib_source(tokenizer, max_bytes=args.stdlib_bytes)
        sequences += seqs
    origin["tokens"] = int(sum(len(s) for s in sequences))
    offsets = np.cumsum([0] + [len(s) for s in sequences])
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")  # whole or absent: another run may wait for it
    np.savez(partial, tokens=np.concatenate([np.asarray(s, np.int32) for s in sequences]), offsets=offsets,
             origin=json.dumps(origin))
    partial.replace(path)
    return sequences, origin


def _answer_text(tokenizer, prompt: str, sequence: list[int]) -> str:
    """The target's answer in ``sequence`` (the chat-templated ``prompt`` + generated ids), up to its
    end of turn."""
    answer = sequence[len(tokenizer.encode_chat([{"role": "user", "content": prompt}])):]
    ends = [i for i, t in enumerate(answer) if t in tokenizer.eos_ids]
    return tokenizer.decode(answer[:ends[0]] if ends else answer, skip_special_tokens=True)


def new_drafter(args, target, d2t, sequences, key, dtype):
    """A --drafter head bound to ``target`` (--init's, else a random one), and the ``save_head`` that
    exports it.

    ``eagle3``: shaped like one of the target's layers, reading its [2, L//2, L-3] layers, drafting
    over the vocabulary ``d2t``. ``mtp``: one layer of the target's type on its last hidden state,
    drafting with the target's embedding and LM head (``d2t`` unused). ``dflash``: --dflash-layers
    Qwen3 layers of the target's shapes reading the published default layers; its mask token the
    highest id the corpus ``sequences`` never holds (one the target is not trained to write).
    """
    import dataclasses

    import numpy as np

    from jspec.drafters import (MTP, DFlash, DFlashConfig, Eagle3, Eagle3Config, dflash, eagle3, init_dflash_head,
                                init_eagle3_head, init_mtp_head, mtp)
    from jspec.execution import with_kernels

    c, kind = target.config, args.drafter
    target = with_kernels(target, "xla")  # the kernels have no gradients
    if args.init is not None:
        drafter = {"eagle3": Eagle3, "mtp": MTP, "dflash": DFlash}[kind].load(args.init, dtype=dtype)
        return drafter.bind(target), {"eagle3": eagle3, "mtp": mtp, "dflash": dflash}[kind].save_head
    if kind == "mtp":
        return MTP(init_mtp_head(c, key, dtype)).bind(target), mtp.save_head
    if kind == "dflash":
        unused = np.setdiff1d(np.arange(c.vocab_size), np.concatenate([np.asarray(s) for s in sequences]))
        if not unused.size:
            raise SystemExit("train_draft.py: error: the corpus holds every token id: no id is free for the mask")
        layer = dataclasses.replace(c, num_layers=args.dflash_layers, architecture="Qwen3ForCausalLM", qk_norm=True,
                                    qkv_bias=False, tie_word_embeddings=False)
        ids = dflash.default_target_layer_ids(c.num_layers, args.dflash_layers)
        config = DFlashConfig(layer=layer, block_size=args.block_size, mask_token_id=int(unused[-1]),
                              target_layer_ids=ids, num_target_layers=c.num_layers)
        return DFlash(init_dflash_head(config, key, dtype)).bind(target), dflash.save_head
    layer = dataclasses.replace(c, num_layers=1, tie_word_embeddings=False)
    config = Eagle3Config(layer=layer, draft_vocab_size=d2t.shape[0], target_hidden_size=c.hidden_size)
    head = dataclasses.replace(init_eagle3_head(config, key, dtype), d2t=d2t if d2t.shape[0] < c.vocab_size else None)
    return Eagle3(head).bind(target), eagle3.save_head


def held_out_acceptance(target, drafter, tokenizer, args) -> float:
    """Mean acceptance length (greedy) on the benchmark's held-out prompts, --eval-tokens new tokens."""
    import jspec
    from jspec.bench.accept import prompt_ids, prompt_set

    prompts = [prompt_ids(tokenizer, p) for p in prompt_set()[: args.eval_prompts]]
    # Bound again to the target on its own kernels (training binds it to xla ones).
    result = jspec.speculative_generate(target, drafter, prompts, args.eval_tokens, num_draft_tokens=args.eval_k)
    return float(result.stats["mean_acceptance_length"].mean())


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.init is not None:
        if not (args.init / "config.json").is_file():
            parser.error(f"--init {args.init}: no config.json there (a head that train_draft.py exported)")
        if args.drafter == "dflash":  # the head's block, not --block-size
            args.block_size = json.loads((args.init / "config.json").read_text()).get("block_size", args.block_size)
    if args.drafter == "dflash" and args.eval_k > args.block_size - 1:
        parser.error(f"--eval-k {args.eval_k}: a DFlash block of --block-size {args.block_size} drafts at most "
                     f"{args.block_size - 1} tokens a round")
    if args.anchors is None:
        args.anchors = min(max(args.width // 4, 1) if args.drafter == "dflash" else 16, args.width)
    elif args.anchors > args.width:
        parser.error(f"--anchors {args.anchors}: more than the --width {args.width} rows of a window")
    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    import jspec
    from jspec import training
    from jspec.text import Tokenizer

    dtype = jnp.dtype(args.dtype)
    started = time.time()
    target_path = jspec.io.resolve_model(args.target)
    target = jspec.io.load_model(target_path, dtype=dtype)
    tokenizer = Tokenizer.from_pretrained(target_path)
    sequences, origin = build_data(args, target, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)
    tokens, lengths = training.windows(sequences, args.width)
    if len(tokens) < args.batch:
        raise SystemExit(f"{Path(__file__).name}: error: the corpus gives {len(tokens)} windows, fewer than --batch")
    vocab = target.config.vocab_size  # MTP and DFlash draft over all of it (the target's LM head)
    whole = args.drafter in ("mtp", "dflash")
    d2t = training.draft_vocabulary(sequences, vocab if whole else min(args.draft_vocab, vocab), vocab)
    key = jax.random.key(args.seed)
    try:
        drafter, save_head = new_drafter(args, target, d2t, sequences, jax.random.fold_in(key, 1), dtype)
    except ValueError as e:  # an --init head that is not a --drafter head, or not one for this target
        raise SystemExit(f"{Path(__file__).name}: error: --init {args.init}: {e}") from None
    cfg = training.TrainConfig(learning_rate=args.lr, total_steps=args.train_steps, steps=args.ttt,
                               anchors=args.anchors, warmup_steps=min(100, args.train_steps // 10),
                               soft_labels=not args.hard_labels)
    state = training.init_state(drafter, cfg, jax.random.fold_in(key, 2))
    checkpoint = args.out / "checkpoint"
    if args.resume and checkpoint.exists():
        state = training.restore_state(checkpoint, state)
        started -= json.loads((checkpoint / "metadata.json").read_text()).get("wall_s", 0.0)  # earlier runs' time
    start = int(state.step)
    hot = training.objective.draft_vocabulary_ids(drafter)  # an --init head's vocabulary, not the corpus's
    metadata = dict(data=origin, windows=int(len(tokens)), width=args.width,
                    draft_vocab=int(vocab if hot is None else hot.shape[0]),
                    ttt_steps=args.ttt, anchors=args.anchors, batch=args.batch, soft_labels=not args.hard_labels,
                    learning_rate=args.lr, seed=args.seed, init=None if args.init is None else str(args.init),
                    device=str(jax.devices()[0].device_kind), target=args.target, drafter=args.drafter)
    if args.drafter == "dflash":
        metadata |= dict(block_size=args.block_size, mask_token="the --init head's" if args.init else
                         "the highest id the corpus never holds")
    bar = tqdm(total=args.train_steps, initial=start, desc="training")
    log, evals = args.out / "train_log.jsonl", args.out / "held_out.json"
    record = dict(eval_k=args.eval_k, eval_prompts=args.eval_prompts, greedy=True, evals=[])
    if args.resume:  # the records of the steps a resumed run keeps
        if evals.exists():
            record["evals"] = [e for e in json.loads(evals.read_text())["evals"] if e["step"] <= start]
        if log.exists():
            kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= start]
            log.write_text("".join(f"{line}\n" for line in kept))
    else:
        log.unlink(missing_ok=True)

    def evaluate(step, params):
        al = held_out_acceptance(target, training.with_params(drafter, params), tokenizer, args)
        record["evals"].append(dict(step=step, acceptance_length=round(al, 4), wall_s=round(time.time() - started, 1)))
        evals.write_text(json.dumps(record, indent=1) + "\n")
        return al

    step = start  # counted here: reading the state's step would wait for every step to finish

    def after_step(state, metrics):
        nonlocal step
        step += 1
        bar.update(1)
        if step % args.log_every == 0 or step == args.train_steps:  # metrics read back only here
            accuracy = [round(float(a), 4) for a in jax.device_get(metrics["accuracy"])]
            loss = float(metrics["total"])
            bar.set_postfix_str(f"loss {loss:.3f} top-1 per step {' '.join(f'{a:.2f}' for a in accuracy)}")
            with log.open("a") as f:
                f.write(json.dumps(dict(step=step, loss=round(loss, 4), accuracy=accuracy,
                                        wall_s=round(time.time() - started, 1))) + "\n")
        if args.eval_every and step % args.eval_every == 0 and step < args.train_steps:
            tqdm.write(f"step {step}: held-out acceptance length {evaluate(step, state.params):.2f} "
                       f"(k={args.eval_k}, greedy)")
        if step % args.checkpoint_every == 0 or step == args.train_steps:
            training.save_state(state, checkpoint, metadata=dict(metadata, wall_s=round(time.time() - started, 1)))

    batches = training.data.batches(tokens, lengths, args.batch, seed=args.seed, start_step=start)
    state = training.train(state, drafter, target, batches, cfg=cfg, num_steps=args.train_steps - start,
                           callback=after_step)
    bar.close()
    trained = training.with_params(drafter, state.params)
    al = evaluate(int(state.step), state.params)
    record["final"] = record["evals"][-1]
    evals.write_text(json.dumps(record, indent=1) + "\n")
    print(f"held-out acceptance length {al:.2f} (k={args.eval_k}, greedy, {args.eval_prompts} prompts)")
    head = jax.tree.map(lambda x: x.astype(args.export_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        trained.head)
    save_head(head, args.out / "head", metadata=dict(metadata, steps=int(state.step), held_out_acceptance=al,
                                                    eval_k=args.eval_k, wall_s=round(time.time() - started, 1)))
    print(f"wrote {args.out / 'head'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
