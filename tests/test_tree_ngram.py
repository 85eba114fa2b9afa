"""N-gram draft trees: the trie of the best distinct earlier continuations of the sequence's
suffix, branch-major, cut or padded to the node count; lossless in tree speculative decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import NGram
from jspec.drafters.base import RoundContext
from jspec.sampling import SamplingParams
from jspec.tree import TreeShape
from tests.stats import assert_matches_distribution
from tests.test_speculative import SAMPLING_VOCAB, _exact_joint
from tests.tiny import tiny_model

MAX_NEW = 14


def _context(histories, lengths):
    """A round's context over ragged ``histories`` (zero-padded); ``lengths[b]`` indexes the root."""
    width = max(len(h) for h in histories) + 8
    history = jnp.array([h + [0] * (width - len(h)) for h in histories], jnp.int32)
    lengths = jnp.array(lengths, jnp.int32)
    return RoundContext(history, lengths, history[jnp.arange(len(lengths)), lengths], (), None)


def _tree(histories, shape, **ngram):
    """``(tokens, parents, depths)`` of the tree each sequence (its whole history, last token the root) gets."""
    ctx = _context(histories, [len(h) - 1 for h in histories])
    tree, state = NGram(**ngram).propose_tree((), ctx, shape=shape, params=SamplingParams(), key=None)
    assert state == ()
    return tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()


def test_repeated_ngrams_with_different_continuations_branch_at_the_root():
    seq = [5, 6, 7, 8, 9, 1, 6, 7, 4, 6, 7]  # "6 7" was followed by 8 9 1, later by 4 6 7
    # Branch 0 is the chain's (the latest match), branch 1 the earlier one; branch-major order.
    assert _tree([seq], TreeShape(2, 3, 6), max_ngram=2) == (
        [[7, 4, 6, 7, 8, 9, 1]], [[-1, 0, 1, 2, 0, 4, 5]], [[0, 1, 2, 3, 1, 2, 3]])
    assert _tree([seq], TreeShape(2, 3, 6), max_ngram=2, match="earliest") == (
        [[7, 8, 9, 1, 4, 6, 7]], [[-1, 0, 1, 2, 0, 4, 5]], [[0, 1, 2, 3, 1, 2, 3]])
    # Fewer nodes: the latest branch loses its deepest nodes first.
    assert _tree([seq], TreeShape(2, 3, 4), max_ngram=2) == ([[7, 4, 6, 7, 8]], [[-1, 0, 1, 2, 0]], [[0, 1, 2, 3, 1]])


def test_shared_prefixes_merge_and_missing_branches_are_padded_with_unacceptable_repeats():
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]  # "1 2" -> 3 8 1 (latest) and 3 9 1: they share the 3
    tokens, parents, depths = _tree([seq], TreeShape(3, 3, 7), max_ngram=2)
    # Only two distinct matches: the two last nodes are children of the root repeating node 1's token.
    assert tokens == [[2, 3, 8, 1, 9, 1, 3, 3]]
    assert parents == [[-1, 0, 1, 2, 1, 4, 0, 0]]
    assert depths == [[0, 1, 2, 3, 2, 3, 1, 1]]


def test_a_longer_ngram_ranks_first_and_a_continuation_past_the_text_repeats_the_root():
    seq = [4, 5, 4, 5, 4]  # "5 4" -> 5 4 then unknown (the root, 4); the shorter "4" at the start -> 5 4 5
    assert _tree([seq], TreeShape(2, 3, 4), max_ngram=2) == (
        [[4, 5, 4, 4, 5]], [[-1, 0, 1, 2, 2]], [[0, 1, 2, 3, 3]])


def test_matches_whose_continuation_copies_a_branch_are_skipped():
    seq = [2, 7, 1, 2, 3, 1, 2, 3, 1, 2]  # both "1 2" continue 3 1 2; the shorter "2" at the start -> 7 1 2
    assert _tree([seq], TreeShape(2, 3, 6), max_ngram=2) == (
        [[2, 3, 1, 2, 7, 1, 2]], [[-1, 0, 1, 2, 0, 4, 5]], [[0, 1, 2, 3, 1, 2, 3]])


def test_no_match_drafts_the_chains_root_repeats_then_padding():
    assert _tree([[1, 2, 3]], TreeShape(2, 2, 4)) == ([[3, 3, 3, 3, 3]], [[-1, 0, 1, 0, 0]], [[0, 1, 2, 1, 1]])


def test_a_batch_gets_one_tree_per_sequence():
    first, second = [5, 6, 7, 8, 9, 1, 6, 7, 4, 6, 7], [1, 2, 3, 9, 1, 2, 3, 8, 1, 2]
    assert _tree([first, second], TreeShape(2, 3, 6), max_ngram=2) == (
        [[7, 4, 6, 7, 8, 9, 1], [2, 3, 8, 1, 9, 1, 3]],
        [[-1, 0, 1, 2, 0, 4, 5], [-1, 0, 1, 2, 1, 4, 0]],
        [[0, 1, 2, 3, 1, 2, 3], [0, 1, 2, 3, 2, 3, 1]],
    )


@pytest.mark.parametrize("match", ["latest", "earliest"])
def test_a_one_branch_tree_is_the_chain(match):
    rng = np.random.default_rng(0)
    histories = [list(rng.integers(0, 4, size=n)) for n in (3, 9, 16, 25)]
    ctx = _context(histories, [len(h) - 1 for h in histories])
    drafter = NGram(max_ngram=3, match=match)
    chain, _, _ = drafter.propose((), ctx, num_draft_tokens=5, params=SamplingParams(), key=None)
    for shape in (TreeShape(1, 5, 5), TreeShape(1, 5, 3), TreeShape(3, 5, 5)):
        tree, _ = jax.jit(drafter.propose_tree, static_argnames="shape")((), ctx, shape=shape, params=None, key=None)
        # topk=1, or as many nodes as the depth: branch 0 (the chain) fills the tree.
        np.testing.assert_array_equal(tree.tokens[:, 1:], chain[:, : shape.num_nodes])
        np.testing.assert_array_equal(tree.depths[:, 1:], np.arange(1, shape.num_nodes + 1)[None].repeat(4, 0))


def _prompts(rng, batch):
    """Ragged prompts over a 5-token alphabet: many repeated n-grams with different continuations."""
    return [list(rng.integers(0, 5, size=n)) for n in rng.integers(4, 24, size=batch)]


# (seed, batch, topk, depth, num_draft_tokens)
GREEDY_CASES = [
    (0, 1, 2, 2, 3),
    (1, 3, 2, 3, 5),
    (2, 2, 3, 3, 9),
    (3, 3, 3, 4, 14),  # more nodes than the trie's 12: padding
    (4, 2, 2, 4, 3),  # fewer nodes than levels
]


@pytest.mark.parametrize("seed, batch, topk, depth, nodes", GREEDY_CASES)
def test_greedy_ngram_tree_speculative_equals_greedy(seed, batch, topk, depth, nodes):
    target = tiny_model(seed)
    prompts = _prompts(np.random.default_rng(seed), batch)
    result = jspec.speculative_generate(target, NGram(max_ngram=3), prompts, MAX_NEW, num_draft_tokens=nodes,
                                        topk=topk, depth=depth)
    assert result.tokens == jspec.generate(target, prompts, MAX_NEW)
    assert (result.stats["accepted"] <= result.stats["rounds"] * min(depth, nodes)).all()


def test_ngram_tree_accepts_at_least_what_its_chain_accepts_on_repetitive_prompts():
    """The tree holds the chain's drafts (branch 0) and other matches' continuations. A small
    vocabulary makes the target's own output repeat n-grams with different continuations."""
    target = tiny_model(3, vocab_size=12)
    prompts = [list(p) for p in np.random.default_rng(3).integers(0, 5, size=(3, 20))]
    chain = jspec.speculative_generate(target, NGram(), prompts, 32, num_draft_tokens=4)
    tree = jspec.speculative_generate(target, NGram(), prompts, 32, num_draft_tokens=8, topk=2, depth=4)
    assert tree.tokens == chain.tokens
    chain_length, tree_length = chain.stats["mean_acceptance_length"], tree.stats["mean_acceptance_length"]
    assert (tree_length >= chain_length).all() and tree_length.sum() > chain_length.sum()


def test_sampled_ngram_tree_speculative_has_the_target_distribution():
    target = tiny_model(11, vocab_size=SAMPLING_VOCAB)
    prompt = [1, 5, 1, 6, 2, 5, 2, 3, 1]  # after most first tokens, two matches with different continuations
    params = SamplingParams(temperature=1.0)
    result = jspec.speculative_generate(target, NGram(max_ngram=2), [prompt] * 6_000, 3, num_draft_tokens=4, topk=2,
                                        depth=2, key=jax.random.key(5), temperature=1.0)
    tokens = np.array(result.tokens)
    index = (tokens * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(target, prompt, params))
