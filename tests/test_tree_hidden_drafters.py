"""Draft trees (``topk > 1``) from the hidden-state drafters (EAGLE-3, MTP): lossless greedy and
sampled tree speculation, and a tree whose every fed node's children are the top-k of the chain
drafter's distribution along that node's path (draft-side tree attention and positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import MTP, Eagle3, init_mtp_head
from jspec.drafters.base import RoundContext
from jspec.engine import pad_prompts
from jspec.sampling import SamplingParams
from jspec.speculative import start
from jspec.tree import TreeShape, max_nodes
from tests.stats import assert_matches_distribution
from tests.test_speculative import SAMPLING_VOCAB, _exact_joint, _prompts
from tests.tiny import eagle3_head, tiny_model

MAX_NEW = 12


def _drafter(kind, target, seed):
    if kind == "eagle3":  # a reduced draft vocabulary: the tree's log-probs are -inf off it
        return Eagle3(eagle3_head(seed, target, draft_vocab=min(40, target.config.vocab_size - 2), aux=(0, 1, 1)))
    return MTP(init_mtp_head(target.config, jax.random.key(seed), scale=0.3))  # post-norm recycling


# (seed, batch, topk, depth, num_draft_tokens, target overrides); a 12-token vocabulary makes
# accepted paths (and so commits along a tree's path) common.
GREEDY_CASES = [
    (0, 1, 2, 4, 3, {}),  # fewer nodes than levels: a path holds at most 3 drafts
    (1, 3, 2, 3, 6, dict(vocab_size=12)),
    (2, 2, 3, 2, 5, dict(vocab_size=12, qk_norm=True)),
]


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@pytest.mark.parametrize("seed, batch, topk, depth, nodes, overrides", GREEDY_CASES)
def test_greedy_tree_speculative_equals_greedy(kind, seed, batch, topk, depth, nodes, overrides):
    target = tiny_model(seed, **overrides)
    prompts = _prompts(np.random.default_rng(seed), batch, target.config.vocab_size)
    expected = jspec.generate(target, prompts, MAX_NEW)
    result = jspec.speculative_generate(target, _drafter(kind, target, seed + 50), prompts, MAX_NEW,
                                        num_draft_tokens=nodes, topk=topk, depth=depth)
    assert result.tokens == expected
    stats = result.stats
    assert (stats["accepted"] <= stats["rounds"] * min(depth, nodes)).all()
    if target.config.vocab_size == 12:
        assert stats["accepted"].sum() > 0  # some rounds commit along a tree's path


def test_sampled_tree_speculative_has_the_target_distribution():
    target = tiny_model(11, vocab_size=SAMPLING_VOCAB)
    drafter = Eagle3(eagle3_head(14, target, draft_vocab=6, aux=(0, 1, 1)))  # q is zero outside 6 tokens
    prompt, sampling = [1, 5, 1, 5, 2], dict(temperature=0.8, top_k=5)
    result = jspec.speculative_generate(target, drafter, [prompt] * 6_000, 3, num_draft_tokens=5, topk=3, depth=2,
                                        key=jax.random.key(5), **sampling)
    tokens = np.array(result.tokens)
    index = (tokens * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(target, prompt, SamplingParams(**sampling)))


TREE = TreeShape(2, 4, max_nodes(2, 4))  # every candidate kept


@pytest.fixture(scope="module", params=["eagle3", "mtp"])
def first_round(request):
    """A bound drafter; its state and a first round's context over ragged prompts; the full tree
    ``TREE``, the state ``propose_tree`` returns, and the greedy chain of ``TREE.depth`` drafts
    with the state ``propose`` returns from the same state."""
    target = tiny_model(3)
    drafter = _drafter(request.param, target, 53).bind(target)
    tokens, lengths = pad_prompts(_prompts(np.random.default_rng(3), 3, target.config.vocab_size))
    params = SamplingParams()

    @jax.jit
    def run(tokens, lengths):
        state = start(target, drafter, tokens, lengths, jax.random.key(0), params=params, eos_ids=(), capacity=64,
                      max_len=64)
        ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
        key = jax.random.key(1)
        tree, tree_state = drafter.propose_tree(state.draft_state, ctx, shape=TREE, params=params, key=key)
        chain, _, chain_state = drafter.propose(state.draft_state, ctx, num_draft_tokens=TREE.depth, params=params,
                                                key=key)
        return state.draft_state, tree, tree_state, chain, chain_state

    return drafter, *run(jnp.asarray(tokens), jnp.asarray(lengths))


def _path(tree, b, node):
    """Draft tokens from the root (excluded) down to ``node`` of sequence ``b``."""
    tokens = []
    while node > 0:
        tokens.append(int(tree.tokens[b, node]))
        node = int(tree.parents[b, node])
    return tokens[::-1]


def test_tree_children_are_the_top_k_of_the_chain_along_their_path(first_round):
    """With every candidate kept, the children of each fed node (and of the root), in node order,
    are the ``topk`` most likely tokens, best first, of the chain drafter fed that node's path
    (``run_rows`` without a tree mask, as ``propose`` feeds): each node saw exactly its ancestors,
    at the chain's positions."""
    drafter, dstate, tree, *_ = first_round

    @jax.jit
    def chain_top_k(dstate, rows, paths):  # paths [n, l] fed one by one after sequence rows[n]'s committed rows
        kv, hidden = jax.tree.map(lambda a: a[rows], (dstate.kv, dstate.hidden))
        for i in range(paths.shape[1]):
            x, kv = drafter.run_rows(kv, paths[:, i : i + 1], drafter.recycle(hidden)[:, None], from_target=False)
            hidden = x[:, 0]
        return jax.lax.top_k(drafter.log_probs(hidden), TREE.topk)[1]

    parents, depths = np.asarray(tree.parents), np.asarray(tree.depths)
    batch = parents.shape[0]
    fed = [(b, node) for b in range(batch) for node in range(1 + TREE.num_nodes) if (parents[b] == node).any()]
    assert len(fed) == batch * (1 + (TREE.depth - 1) * TREE.topk)  # root + topk frontier nodes per level
    for depth in range(TREE.depth):  # one batched chain per path length
        level = [(b, node) for b, node in fed if depths[b, node] == depth]
        rows = jnp.asarray([b for b, _ in level])
        paths = jnp.asarray([_path(tree, b, node) for b, node in level], jnp.int32).reshape(len(level), depth)
        want = np.asarray(chain_top_k(dstate, rows, paths))
        for (b, node), top in zip(level, want):
            np.testing.assert_array_equal(tree.tokens[b, parents[b] == node], top, err_msg=f"{b=} {node=}")


def test_tree_best_children_follow_the_greedy_chain(first_round):
    """The best child of each node, from the root down as far as the frontiers kept it (at least
    two levels: every level-1 node is fed), spells chain ``propose``'s greedy drafts."""
    _, _, tree, _, chain, _ = first_round
    parents = np.asarray(tree.parents)
    for b in range(parents.shape[0]):
        node, best = 0, []
        while (parents[b] == node).any():
            node = int(np.argmax(parents[b] == node))  # the first child is the best
            best.append(int(tree.tokens[b, node]))
        assert len(best) >= 2
        assert best == np.asarray(chain[b, : len(best)]).tolist()


def test_propose_tree_leaves_the_state_propose_leaves(first_round):
    """Both return a ``HeadState`` with the round's hidden and the committed rows untouched; the
    rows past them (drafts, tree nodes) are what ``commit`` rolls back, so it needs no tree case."""
    _, dstate, _, tree_state, _, chain_state = first_round
    assert jax.tree.structure(tree_state) == jax.tree.structure(chain_state)
    np.testing.assert_array_equal(tree_state.hidden, chain_state.hidden)
    for b, n in enumerate(np.asarray(dstate.kv.lengths)):
        for got in (tree_state.kv, chain_state.kv):
            np.testing.assert_array_equal(got.k[0][b, :, :n], dstate.kv.k[0][b, :, :n])
            np.testing.assert_array_equal(got.v[0][b, :, :n], dstate.kv.v[0][b, :, :n])


def test_topk_beyond_the_draft_vocabulary_is_rejected():
    target = tiny_model(0, vocab_size=SAMPLING_VOCAB)
    drafter = Eagle3(eagle3_head(1, target, draft_vocab=2, aux=(0, 1, 1)))
    with pytest.raises(ValueError, match="topk=3 exceeds the draft vocabulary size 2"):
        jspec.speculative_generate(target, drafter, [[1, 2]], 4, num_draft_tokens=4, topk=3, depth=2)
