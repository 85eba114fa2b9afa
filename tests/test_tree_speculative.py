"""Tree speculative decoding (``topk > 1``) is lossless: greedy output equals plain greedy token
for token, sampled output has exactly the target distribution; a drafter equal to the target
whose tree keeps the greedy chain accepts the whole depth every round."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jspec
from jspec.drafters import DraftModel, NGram
from jspec.sampling import SamplingParams
from jspec.tree import max_nodes
from tests.stats import assert_matches_distribution
from tests.test_speculative import SAMPLING_VOCAB, _exact_joint, _prompts
from tests.tiny import tiny_gemma4, tiny_model

MAX_NEW = 14

# (seed, batch, topk, depth, num_draft_tokens, drafter, target overrides)
GREEDY_CASES = [
    (0, 1, 2, 2, 3, "draft", {}),
    (1, 3, 2, 3, 5, "draft", dict(qkv_bias=True)),
    (2, 2, 3, 3, 8, "draft", dict(qk_norm=True, num_kv_heads=1)),
    (3, 3, 3, 2, 4, "self", {}),
    (4, 2, 2, 4, 7, "self", dict(tie_word_embeddings=True)),
    (5, 2, 2, 4, 3, "draft", {}),  # fewer nodes than levels: a path holds at most 3 drafts
]


@pytest.mark.parametrize("seed, batch, topk, depth, nodes, kind, overrides", GREEDY_CASES)
def test_greedy_tree_speculative_equals_greedy(seed, batch, topk, depth, nodes, kind, overrides):
    target = tiny_model(seed, **overrides)
    drafter = DraftModel(target if kind == "self" else tiny_model(seed + 100, num_layers=1, num_heads=2,
                                                                   num_kv_heads=1, head_dim=16))
    prompts = _prompts(np.random.default_rng(seed), batch, target.config.vocab_size)
    expected = jspec.generate(target, prompts, MAX_NEW)
    result = jspec.speculative_generate(target, drafter, prompts, MAX_NEW, num_draft_tokens=nodes, topk=topk,
                                        depth=depth)
    assert result.tokens == expected
    stats = result.stats
    assert (stats["accepted"] <= stats["rounds"] * depth).all()


def test_greedy_tree_on_a_gemma4_target_equals_greedy():
    target = tiny_gemma4(5)
    drafter = DraftModel(tiny_gemma4(105, num_layers=2, layer_types=("sliding_attention", "full_attention"),
                                     num_kv_shared_layers=0))
    prompts = _prompts(np.random.default_rng(5), 2, target.config.vocab_size)
    result = jspec.speculative_generate(target, drafter, prompts, MAX_NEW, num_draft_tokens=5, topk=2, depth=3)
    assert result.tokens == jspec.generate(target, prompts, MAX_NEW)


@pytest.mark.parametrize("topk", [2, 3])
def test_self_drafting_tree_that_keeps_the_greedy_chain_accepts_the_whole_depth(topk):
    """At depth 2 the frontier is every child of the root, and keeping every candidate keeps the
    greedy chain (deeper, a frontier of topk may drop it: a less likely parent can have a more
    confident child)."""
    target, depth = tiny_model(6), 2
    nodes = max_nodes(topk, depth)
    result = jspec.speculative_generate(target, DraftModel(target), [[3, 1, 4, 1, 5]], 1 + 4 * (depth + 1),
                                        num_draft_tokens=nodes, topk=topk, depth=depth)
    np.testing.assert_allclose(result.stats["mean_acceptance_length"], depth + 1)


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=5)])
def test_sampled_tree_speculative_has_the_target_distribution(sampling):
    target = tiny_model(11, vocab_size=SAMPLING_VOCAB)
    drafter = DraftModel(tiny_model(12, vocab_size=SAMPLING_VOCAB, num_layers=1))
    prompt = [1, 5, 1, 5, 2]
    result = jspec.speculative_generate(target, drafter, [prompt] * 6_000, 3, num_draft_tokens=4, topk=2, depth=2,
                                        key=jax.random.key(5), **sampling)
    tokens = np.array(result.tokens)
    index = (tokens * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(target, prompt, SamplingParams(**sampling)))


def test_tree_arguments_are_checked():
    target, drafter = tiny_model(0), DraftModel(tiny_model(1, num_layers=1))
    with pytest.raises(ValueError, match="depth"):
        jspec.speculative_generate(target, drafter, [[1, 2]], 4, num_draft_tokens=4, topk=2)
    with pytest.raises(ValueError, match="num_nodes"):
        jspec.speculative_generate(target, drafter, [[1, 2]], 4, num_draft_tokens=20, topk=2, depth=3)

    class ChainOnly:  # the Drafter protocol's members, no propose_tree
        capture = NGram().capture
        check_compatible = bind = max_positions = prefill = propose = commit = staticmethod(lambda *a, **kw: None)

    with pytest.raises(ValueError, match="drafts chains only"):
        jspec.speculative_generate(target, ChainOnly(), [[1, 2]], 4, num_draft_tokens=4, topk=2, depth=2)
