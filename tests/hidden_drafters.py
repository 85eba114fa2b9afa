"""Checks shared by the EAGLE-3 and MTP tests (drafters that read target hidden states)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.engine import pad_prompts, prefill
from jspec.models.llama import forward
from jspec.sampling import SamplingParams
from jspec.speculative import start

MAX_NEW = 16


def ragged_prompts(rng, batch, vocab):
    return [list(rng.integers(0, vocab, size=n)) for n in rng.integers(1, 21, size=batch)]


def cut_after(tokens: list[list[int]], eos_id: int | None) -> list[list[int]]:
    """Each sequence up to and including its first ``eos_id``: what generation stopping at EOS
    emits (tests/test_speculative.py checks jspec.generate against it)."""
    return [seq[: seq.index(eos_id) + 1] if eos_id in seq else seq for seq in tokens]


def greedy_with_eos(target, prompts, eos: bool, max_new: int = MAX_NEW):
    """``(eos_id, plain greedy tokens)``: with ``eos``, a token the plain output really emits (so some
    sequences stop early) and the output cut there; one plain generation either way (an EOS id is
    static, another program to compile)."""
    plain = jspec.generate(target, prompts, max_new)
    eos_id = plain[0][len(plain[0]) // 2] if eos else None
    return eos_id, cut_after(plain, eos_id)


def check_greedy_lossless(target, drafter, seed, batch, k, eos):
    rng = np.random.default_rng(seed)
    prompts = ragged_prompts(rng, batch, target.config.vocab_size)
    eos_id, expected = greedy_with_eos(target, prompts, eos)
    result = jspec.speculative_generate(target, drafter, prompts, MAX_NEW, num_draft_tokens=k, eos_id=eos_id)
    assert result.tokens == expected
    stats = result.stats
    assert (stats["accepted"] <= stats["drafted"]).all() and (stats["drafted"] == stats["rounds"] * k).all()
    return stats


def _prefill_target(target, drafter, prompts):
    tokens, lengths = pad_prompts(prompts)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    kv = target.init_cache(len(prompts), 128)
    logits, features, kv = prefill(target, tokens, lengths, kv, capture=drafter.capture)
    return tokens, lengths, features, jnp.argmax(logits, -1).astype(jnp.int32), kv


def check_catch_up(target, drafter, *, k=3, num_accepted=(0, 2, 3), seed=0):
    """Draft state after prefill -> propose -> verify -> commit equals the state of a draft
    prefilled from scratch over the accepted sequence with the target's features."""
    drafter = drafter.bind(target)
    rng = np.random.default_rng(seed)
    batch = len(num_accepted)
    vocab = target.config.vocab_size
    prompts = [list(rng.integers(0, vocab, size=n)) for n in (5, 11, 3)[:batch]]
    tokens, lengths = pad_prompts(prompts)
    params = SamplingParams()
    state = start(target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                  params=params, eos_ids=(), capacity=128, max_len=128)
    base = state.target_kv.lengths
    ctx = RoundContext(state.history, base, state.root, state.features, state.target_kv)
    _, _, dstate = drafter.propose(state.draft_state, ctx, num_draft_tokens=k, params=params, key=jax.random.key(1))
    # Arbitrary drafts (the accept count is imposed): their rows hold junk from propose.
    drafts = jnp.asarray(rng.integers(0, vocab, size=(batch, k)), jnp.int32)
    verify_tokens = jnp.concatenate([state.root[:, None], drafts], axis=1)
    _, features, _ = forward(target, verify_tokens, state.target_kv, capture=drafter.capture)
    a = jnp.asarray(num_accepted, jnp.int32)
    bonus = jnp.asarray(rng.integers(0, vocab, size=batch), jnp.int32)
    committed = drafter.commit(dstate, CommitContext(base, verify_tokens, a, bonus, features))

    # From scratch: prompt + first token + accepted drafts, then the bonus as the next token.
    first = np.asarray(state.root)
    seqs = [p + [int(first[b])] + [int(t) for t in np.asarray(drafts[b, : num_accepted[b]])] for b, p in enumerate(prompts)]
    s_tokens, s_lengths, s_features, _, _ = _prefill_target(target, drafter, seqs)
    scratch = drafter.prefill(PrefillContext(s_tokens, s_lengths, s_features, bonus), max_len=128)

    np.testing.assert_array_equal(committed.kv.lengths, scratch.kv.lengths)
    np.testing.assert_array_equal(committed.kv.lengths, np.asarray(base) + np.asarray(num_accepted) + 1)
    def close(got, want):  # fp32, two different (equally valid) summation orders
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())))

    for b in range(batch):
        n = int(scratch.kv.lengths[b])
        close(committed.kv.k[0][b, :, :n], scratch.kv.k[0][b, :, :n])
        close(committed.kv.v[0][b, :, :n], scratch.kv.v[0][b, :, :n])
    close(committed.hidden, scratch.hidden)


def check_parity(target, drafter, ref_dir: Path, *, atol=2e-4):
    """Teacher-forced rows, the state after prefill, and the chained greedy drafts against
    the torch reference (tests/hf_reference/drafters.py)."""
    drafter = drafter.bind(target)
    meta = json.loads((ref_dir.parent / "prompts.json").read_text())
    prompts, steps = meta["prompts"], meta["steps"]
    ref = np.load(ref_dir / "reference.npz")
    tokens, lengths, features, first, _ = _prefill_target(target, drafter, prompts)
    np.testing.assert_array_equal(first, [int(ref[f"first_{b}"]) for b in range(len(prompts))])

    dstate = drafter.prefill(PrefillContext(tokens, lengths, features, first), max_len=64)
    # All rows at once (no slicing) for the per-row comparison.
    batch, width = tokens.shape
    last = lengths - 1
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch, 1), tokens.dtype)], axis=1)
    row_tokens = jnp.where(jnp.arange(width)[None] == last[:, None], first[:, None], shifted)
    kv = drafter.init_kv(batch, 64, drafter.layer.o.dtype)
    x_all, _ = drafter.run_rows(kv, row_tokens, drafter.target_features(features), from_target=True)
    logits_all = drafter.head_logits(x_all)
    for b in range(batch):
        n = int(lengths[b])
        # The reference's row hidden is what the next step recycles (EAGLE-3: pre-norm;
        # MTP default: post-norm, transformers' MtpLayer output).
        np.testing.assert_allclose(drafter.recycle(x_all[b, :n]), ref[f"row_hidden_{b}"], rtol=1e-4, atol=atol)
        np.testing.assert_allclose(logits_all[b, :n], ref[f"row_logits_{b}"], rtol=1e-4, atol=atol)
        np.testing.assert_allclose(drafter.recycle(dstate.hidden[b]), ref[f"row_hidden_{b}"][n - 1], rtol=1e-4, atol=atol)

    ctx = RoundContext(None, lengths, first, (), None)
    drafts, probs, _ = drafter.propose(dstate, ctx, num_draft_tokens=steps, params=SamplingParams(), key=jax.random.key(0))
    assert probs is None
    want = np.stack([ref[f"draft_tokens_{b}"] for b in range(batch)])
    np.testing.assert_array_equal(drafts, want)

    # Chained logits step by step, feeding the reference drafts.
    kv, x = dstate.kv, dstate.hidden  # prefill left the draft cache at the prompt lengths
    draft_ids = [np.asarray(ref[f"draft_tokens_{b}"]) for b in range(batch)]
    for step in range(steps):
        logits = drafter.head_logits(x)
        for b in range(batch):
            np.testing.assert_allclose(logits[b], ref[f"chain_logits_{b}"][step], rtol=1e-4, atol=atol)
        tok = jnp.asarray([int(d[step]) for d in draft_ids], jnp.int32)
        x, kv = drafter.run_rows(kv, tok[:, None], drafter.recycle(x)[:, None], from_target=False)
        x = x[:, 0]
