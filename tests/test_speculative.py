"""Speculative generation is lossless: greedy output equals plain greedy decoding token for
token, sampled output has exactly the target distribution."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

import jspec
from jspec.drafters import MTP, DraftModel, Eagle3, NGram, init_mtp_head
from jspec.sampling import SamplingParams, probabilities
from tests.hidden_drafters import cut_after, greedy_with_eos
from tests.stats import assert_cells_match, assert_matches_distribution, samples_to_detect
from tests.tiny import dflash, eagle3_head, tiny_model

MAX_NEW = 16


def _prompts(rng, batch, vocab, repetitive=False):
    lengths = rng.integers(1, 21, size=batch)
    if repetitive:  # gives the n-gram drafter something to find
        return [list(np.tile(rng.integers(0, vocab, size=3), 7)[:n]) for n in lengths]
    return [list(rng.integers(0, vocab, size=n)) for n in lengths]


# (seed, batch, k, eos, drafter, target overrides)
GREEDY_CASES = [
    (0, 1, 1, False, "draft", {}),
    (1, 3, 2, True, "draft", dict(qkv_bias=True)),
    (2, 4, 3, False, "draft", dict(qk_norm=True, head_dim=32)),
    (3, 2, 5, True, "draft", dict(tie_word_embeddings=True, num_kv_heads=1)),
    (4, 2, 3, False, "self", {}),
    (5, 4, 5, True, "self", dict(num_kv_heads=4)),
    (6, 1, 2, False, "ngram", {}),
    (7, 3, 3, True, "ngram", dict(qkv_bias=True, qk_norm=True)),
    (8, 4, 5, False, "ngram", {}),
    (9, 2, 1, True, "ngram", {}),
]


def _drafter(kind, target, seed):
    if kind == "draft":
        return DraftModel(tiny_model(seed + 100, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16))
    if kind == "self":
        return DraftModel(target)
    return NGram(max_ngram=3)


@pytest.mark.parametrize("seed, batch, k, eos, kind, overrides", GREEDY_CASES)
def test_greedy_speculative_equals_greedy(seed, batch, k, eos, kind, overrides):
    target = tiny_model(seed, **overrides)
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng, batch, target.config.vocab_size, repetitive=kind == "ngram")
    eos_id, expected = greedy_with_eos(target, prompts, eos, MAX_NEW)
    result = jspec.speculative_generate(target, _drafter(kind, target, seed), prompts, MAX_NEW, num_draft_tokens=k, eos_id=eos_id)
    assert result.tokens == expected
    stats = result.stats
    assert (stats["accepted"] <= stats["drafted"]).all() and (stats["drafted"] == stats["rounds"] * k).all()
    if kind == "self":  # the target drafting for itself accepts every draft
        assert stats["accepted"].sum() >= 0.99 * stats["drafted"].sum()
        np.testing.assert_allclose(stats["mean_acceptance_length"], k + 1)


def test_plain_generation_stops_after_eos_which_it_includes():
    """What the lossless tests above expect with an EOS: the plain output cut after its first EOS
    (each EOS id compiles another program, so they cut the plain output instead of generating again)."""
    target = tiny_model(1, qkv_bias=True)
    prompts = _prompts(np.random.default_rng(1), 3, target.config.vocab_size)
    plain = jspec.generate(target, prompts, MAX_NEW)
    eos_id = plain[0][len(plain[0]) // 2]
    with_eos = jspec.generate(target, prompts, MAX_NEW, eos_id=eos_id)
    assert with_eos == cut_after(plain, eos_id) and len(with_eos[0]) < MAX_NEW


def _ngram_proposal(history, length, k, **kw):
    import jax.numpy as jnp

    from jspec.drafters.base import RoundContext

    hist = jnp.array([history + [0] * 8])
    lengths = jnp.array([length])
    ctx = RoundContext(hist, lengths, hist[:, length], (), None)
    tokens, probs, _ = NGram(**kw).propose((), ctx, num_draft_tokens=k, params=SamplingParams(), key=None)
    assert probs is None
    return tokens[0].tolist()


def test_ngram_proposes_what_followed_the_latest_match():
    # sequence 5 6 7 8 9 | 1 6 7 4 | 6 7  (root = the last 7, at index 10)
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 4, 6, 7]
    assert _ngram_proposal(seq, 10, 2) == [4, 6]  # latest "6 7" is at 6..7, followed by 4 6
    assert _ngram_proposal(seq, 10, 4) == [4, 6, 7, 7]  # past the known tokens: the root repeats
    # The longest n-gram wins over a later, shorter match: "9 1 2" -> 3 0 (not 5, after the last "2").
    assert _ngram_proposal([9, 1, 2, 3, 0, 2, 5, 9, 1, 2], 9, 2, max_ngram=3) == [3, 0]
    # No match: the root is repeated.
    assert _ngram_proposal([1, 2, 3], 2, 2) == [3, 3]


def test_ngram_earliest_match_drafts_what_hf_prompt_lookup_drafts():
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 4, 6, 7]
    assert _ngram_proposal(seq, 10, 2, max_ngram=2, match="earliest") == [8, 9]  # the first "6 7", at 1..2
    assert _ngram_proposal([9, 1, 2, 3, 0, 2, 5, 9, 1, 2], 9, 2, max_ngram=3, match="earliest") == [3, 0]
    with pytest.raises(ValueError, match="match"):
        NGram(match="first")


# --- sampling ---------------------------------------------------------------------------

SAMPLING_VOCAB = 8
NUM_SAMPLES = 6_000


def _exact_joint(target, prompt, params, length=3):
    """P(first ``length`` new tokens) by enumeration: ``[vocab] * length`` array."""
    vocab = target.config.vocab_size
    joint = np.ones((1,))
    for depth in range(length):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        seqs = np.array([prompt + list(p) for p in prefixes])
        probs = np.asarray(probabilities(jspec.score(target, seqs)[:, -1], params), np.float64)
        joint = (joint.reshape(-1, 1) * probs).ravel()
    return joint


SAMPLING_CASES = [
    ("draft", dict(temperature=1.0)),
    ("draft", dict(temperature=0.7, top_k=4)),
    ("draft", dict(temperature=1.3, top_p=0.8)),
    ("ngram", dict(temperature=1.0)),
    ("eagle3", dict(temperature=1.0)),  # reduced draft vocab: q is zero outside it
    ("mtp", dict(temperature=0.9, top_k=6)),
    ("dflash", dict(temperature=0.8, top_p=0.9)),  # one block: both drafts from one forward
    ("pard", dict(temperature=1.0)),  # a mask token's row drafts the second
]


def _sampling_drafter(kind, target):
    if kind == "draft":
        return DraftModel(tiny_model(12, vocab_size=SAMPLING_VOCAB, num_layers=1))
    if kind == "eagle3":
        return Eagle3(eagle3_head(14, target, draft_vocab=6, aux=(0, 1, 1)))
    if kind == "mtp":
        return MTP(init_mtp_head(target.config, jax.random.key(15), scale=0.3))
    if kind == "dflash":
        return dflash(target, block_size=3, seed=16)
    if kind == "pard":
        return DraftModel(tiny_model(17, vocab_size=SAMPLING_VOCAB, num_layers=1), parallel_token=SAMPLING_VOCAB - 1)
    return NGram(max_ngram=2)


@pytest.mark.parametrize("kind, sampling", SAMPLING_CASES)
def test_sampled_speculative_has_the_target_distribution(kind, sampling):
    target = tiny_model(11, vocab_size=SAMPLING_VOCAB)
    drafter = _sampling_drafter(kind, target)
    prompt = [1, 5, 1, 5, 2]
    result = jspec.speculative_generate(
        target, drafter, [prompt] * NUM_SAMPLES, 3, num_draft_tokens=2, key=jax.random.key(3), **sampling
    )
    tokens = np.array(result.tokens)
    index = (tokens * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(target, prompt, SamplingParams(**sampling)))


def test_sampled_rounds_that_accept_every_draft_emit_a_bonus_of_the_target_distribution():
    """k = 1 over a 3-token window: token 1 comes from the prefill, token 2 is the draft or the
    correction, token 3 the bonus of a round that accepted its draft (or the next round's
    token). Enough samples that a 20% error in any outcome of mass >= 0.02 fails the test: tens of
    thousands of sequences, so the models are narrow (half the cache, a quarter of the matmuls)."""
    narrow = dict(vocab_size=SAMPLING_VOCAB, hidden_size=32, intermediate_size=32, num_heads=2, num_kv_heads=1)
    target = tiny_model(11, **narrow)
    drafter = DraftModel(tiny_model(12, num_layers=1, **narrow))
    prompt, params = [1, 5, 1, 5, 2], SamplingParams(temperature=1.0)
    exact = _exact_joint(target, prompt, params)
    num_samples = samples_to_detect(0.02, 0.2, num_cells=int((exact >= 0.02).sum()))
    result = jspec.speculative_generate(
        target, drafter, [prompt] * num_samples, 3, num_draft_tokens=1, key=jax.random.key(4), temperature=1.0
    )
    stats = result.stats
    all_accepted_first_round = (stats["rounds"] == 1) & (stats["accepted"] == 1)
    assert all_accepted_first_round.mean() > 0.2  # the bonus path is well covered
    tokens = np.array(result.tokens)
    index = (tokens * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, exact)
    assert_cells_match(index, exact, min_mass=0.02)


def test_identical_draft_accepts_everything_when_sampling():
    target = tiny_model(13, vocab_size=SAMPLING_VOCAB)
    result = jspec.speculative_generate(
        target, DraftModel(target), [[1, 2, 3]] * 64, 12, num_draft_tokens=3, temperature=1.0, key=jax.random.key(0)
    )
    assert result.stats["accepted"].sum() >= 0.99 * result.stats["drafted"].sum()


# --- bad input ---------------------------------------------------------------------------


def test_bad_input_is_rejected():
    target = tiny_model(0)
    good = DraftModel(tiny_model(1, num_layers=1))
    with pytest.raises(ValueError, match="draft vocab_size 50 != target vocab_size 97"):
        jspec.speculative_generate(target, DraftModel(tiny_model(1, vocab_size=50)), [[1, 2]], 4)
    for bad_k in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens must be an int >= 1"):
            jspec.speculative_generate(target, good, [[1, 2]], 4, num_draft_tokens=bad_k)
    with pytest.raises(ValueError, match="num_draft_tokens=8 is too large"):
        jspec.speculative_generate(target, good, [[1] * 200], 50, num_draft_tokens=8)
    with pytest.raises(ValueError, match="top_p"):
        jspec.speculative_generate(target, good, [[1, 2]], 4, temperature=1.0, top_p=2.0)
    with pytest.raises(ValueError, match="temperature"):
        jspec.speculative_generate(target, NGram(), [[1, 2]], 4, temperature=-0.5)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jspec.speculative_generate(target, NGram(), [[1, 97]], 4)
    with pytest.raises(ValueError, match="min_ngram"):
        NGram(max_ngram=1, min_ngram=2)
