"""Training text a machine without network has, as token windows, and the reduced draft vocabulary.

Sources (each returns token id lists, with a description of its origin for the checkpoint):

* ``stdlib_source``: the Python standard library's own ``.py`` files (this interpreter's), in
  sorted path order -- a natural corpus for code models;
* ``self_generated``: chat turns the target writes itself for the committed prompts
  (``chat_prompts``: ``prompts.json`` beside this module, families of templates x the lists
  that suit them, several thousand everyday chat requests over many domains, disjoint from the
  benchmark's held-out prompts) -- training on the target's own distribution, the standard recipe
  for heads;
* ``transform_prompts``: prompts that hand the target a passage to rewrite, summarise or comment
  (its own earlier answers, ``stdlib_functions``), so the head also learns to copy from context,
  where the drafts of a chat that edits a text come from.

``windows`` packs sequences into ``[n, width]`` windows; ``draft_vocabulary`` picks the most
frequent target ids for a reduced head vocabulary (``d2t`` offsets, SpecForge's convention).
"""

from __future__ import annotations

import ast
import itertools
import json
import string
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = Path(__file__).with_name("prompts.json")


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


def stdlib_source(tokenizer, *, max_bytes: int = 2_000_000) -> tuple[list[list[int]], str]:
    """Token ids of the standard library's ``.py`` files, whole files in sorted order until
    ``max_bytes`` of source; and a description of what was read."""
    texts, size = [], 0
    for path in _stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if size + len(text) > max_bytes:
            break
        texts.append(text)
        size += len(text)
    about = f"Python {sysconfig.get_python_version()} stdlib: {len(texts)} files, {size} bytes"
    return [tokenizer.encode(t) for t in texts], about


def stdlib_functions(count: int, *, min_chars: int = 150, max_chars: int = 800, seed: int = 0) -> list[str]:
    """``count`` top-level functions (source text of ``min_chars`` to ``max_chars``) of the standard
    library, drawn at random for ``seed`` from the same files as :func:`stdlib_source`."""
    functions = []
    for path in _stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        functions += [source for node in tree.body if isinstance(node, ast.FunctionDef)
                      if min_chars <= len(source := ast.get_source_segment(text, node) or "") <= max_chars]
    pick = np.random.default_rng(seed).permutation(len(functions))[:count]
    return [functions[i] for i in sorted(pick)]


def transform_prompts(prose: list[str], code: list[str], *, seed: int = 0, path=PROMPTS) -> list[str]:
    """Each prose passage in one of the prose transform templates, each code snippet in one of the
    code templates (those with a code block), the template drawn at random for ``seed``."""
    templates = json.loads(Path(path).read_text())["transforms"]
    for_code = [t for t in templates if "```" in t]
    for_prose = [t for t in templates if "```" not in t]
    rng = np.random.default_rng(seed)
    return ([for_prose[rng.integers(len(for_prose))].format(text=t.strip()) for t in prose]
            + [for_code[rng.integers(len(for_code))].format(text=t.strip()) for t in code])


def chat_prompts(count: int | None = None, *, seed: int = 0, path=PROMPTS) -> list[str]:
    """The committed prompts: each family's templates filled with every combination of the lists its
    placeholders name (a template without placeholders is one prompt), in file order without
    repeats; ``count`` of them (all if None or more) drawn at random for ``seed``, kept in that order."""
    prompts = {}
    for family in json.loads(Path(path).read_text())["families"]:
        for template in family["templates"]:
            names = sorted({field for _, field, _, _ in string.Formatter().parse(template) if field})
            for values in itertools.product(*(family[n] for n in names)):
                prompts.setdefault(template.format(**dict(zip(names, values))), None)
    prompts = list(prompts)
    if count is None or count >= len(prompts):
        return prompts
    pick = np.random.default_rng(seed).permutation(len(prompts))[:count]
    return [prompts[i] for i in sorted(pick)]


def self_generated(target, tokenizer, prompts: list[str], *, new_tokens: int, batch_size: int = 32,
                   temperature: float = 0.0, seed: int = 0, progress=None) -> tuple[list[list[int]], str]:
    """The target's own answers: chat-templated prompt + up to ``new_tokens`` generated tokens per
    prompt (greedy by default; an answer ends at the target's end of turn, which it keeps), in
    order of ``prompts``; and a description.

    Batches of ``batch_size`` prompts of similar length (sorted by length; the last batch filled
    with copies of a prompt, its answers dropped), each generated with a cache of a length that only
    the prompts' padded width sets: one compiled program per width bucket and temperature, however
    many prompts."""
    encoded = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i]), i))
    sequences = [None] * len(encoded)
    key = jax.random.key(seed)
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        chunk = [encoded[i] for i in rows]
        key, sub = jax.random.split(key)
        answers = _generate(target, chunk + [chunk[-1]] * (batch_size - len(chunk)), new_tokens,
                            temperature=temperature, key=sub, eos_ids=tokenizer.eos_ids)
        for i, ids, out in zip(rows, chunk, answers):
            sequences[i] = ids + out
        if progress is not None:
            progress(len(chunk))
    about = f"{len(prompts)} chat turns generated by the target (temperature {temperature}, {new_tokens} tokens)"
    return sequences, about


def _generate(target, prompts, new_tokens: int, *, temperature: float, key, eos_ids) -> list[list[int]]:
    """``jspec.generate`` with a cache length set by the padded prompt width alone (not by the
    longest prompt), so that batches of one width share one compiled program."""
    from jspec import engine

    batch = engine.host_batch(target, prompts, new_tokens, temperature=temperature, top_k=None, top_p=None,
                              eos_id=tuple(eos_ids), key=key)
    width, out_width = batch.tokens.shape[1], engine.output_width(new_tokens)
    output, counts = engine.generate_on_device(
        target, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), batch.key, jnp.int32(new_tokens),
        params=batch.params, eos_ids=batch.eos_ids, output_width=out_width,
        max_len=engine.cache_length(width, width + out_width))
    output, counts = np.asarray(output), np.asarray(counts)
    return [output[b, :counts[b]].tolist() for b in range(len(prompts))]


def windows(sequences: list[list[int]], width: int, *, min_tokens: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Cut every sequence into windows of ``width`` tokens (the last piece padded with zeros):
    ``tokens [n, width]`` int32 and ``lengths [n]``; pieces shorter than ``min_tokens`` dropped."""
    rows, lengths = [], []
    for seq in sequences:
        for start in range(0, len(seq), width):
            piece = seq[start:start + width]
            if len(piece) >= min_tokens:
                rows.append(piece + [0] * (width - len(piece)))
                lengths.append(len(piece))
    if not rows:
        raise ValueError(f"no window of at least {min_tokens} tokens in {len(sequences)} sequences")
    return np.asarray(rows, np.int32), np.asarray(lengths, np.int32)


def draft_vocabulary(sequences: list[list[int]], size: int, vocab_size: int) -> jax.Array:
    """``d2t [size]`` int32 offsets of the ``size`` most frequent target ids (ties: lower id),
    sorted by id: draft id ``i`` is target id ``i + d2t[i]``."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = np.bincount(np.concatenate([np.asarray(s, np.int64) for s in sequences]), minlength=vocab_size)
    hot = np.sort(np.argsort(-counts[:vocab_size], kind="stable")[:size])
    return jnp.asarray(hot - np.arange(size), jnp.int32)


def batches(tokens: np.ndarray, lengths: np.ndarray, batch_size: int, *, seed: int, start_step: int = 0):
    """Endless shuffled batches ``(tokens [batch, width], lengths [batch])``, one permutation per
    epoch from ``seed``; ``start_step`` skips the batches a resumed run already took."""
    per_epoch = max(1, len(tokens) // batch_size)
    step = start_step
    while True:
        epoch, index = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(len(tokens))
        pick = order[index * batch_size:(index + 1) * batch_size]
        yield jnp.asarray(tokens[pick]), jnp.asarray(lengths[pick])
        step += 1
