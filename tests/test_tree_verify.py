"""Tree verification: greedy paths on hand-built trees, the chain special case, and exact
sampling of a Markov target through speculative rounds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import tree_verify, verify
from tests.stats import assert_matches_distribution

VOCAB = 8
# Tree A: root -> {1, 2}; 1 -> {3, 4}; 3 -> 5 (maximum depth 3).
PARENTS_A = [-1, 0, 0, 1, 1, 3]
TOKENS_A = [7, 3, 5, 2, 4, 6]
# Tree B: root -> {1, 2} with the same token 4; 2 -> 3; 1 -> {4, 5}.
PARENTS_B = [-1, 0, 0, 2, 1, 1]
TOKENS_B = [0, 4, 4, 1, 2, 3]


def _greedy(argmax_rows, tokens, parents, depth):
    """``tree_verify.greedy`` on logits whose row i has its argmax at ``argmax_rows[..., i]``."""
    logits = jax.nn.one_hot(jnp.array(argmax_rows), VOCAB)
    path, num_accepted, next_token = tree_verify.greedy(logits, jnp.array(tokens), jnp.array(parents), depth=depth)
    return path.tolist(), num_accepted.tolist(), next_token.tolist()


@pytest.mark.parametrize(
    "argmax_rows, path, num_accepted, next_token",
    [
        ([1, 0, 0, 0, 0, 0], [0, 0, 0, 0], 0, 1),  # the root's argmax is no child's token
        ([3, 7, 0, 6, 1, 2], [0, 1, 0, 0], 1, 7),  # node 1 accepted, its argmax 7 matches neither child
        ([5, 4, 0, 6, 1, 2], [0, 2, 0, 0], 1, 0),  # node 2 is a leaf: bonus from its row
        ([3, 2, 0, 6, 1, 2], [0, 1, 3, 5], 3, 2),  # the full path to the deepest leaf, then its bonus
    ],
)
def test_greedy_follows_the_argmax_down_tree_a(argmax_rows, path, num_accepted, next_token):
    assert _greedy([argmax_rows], [TOKENS_A], [PARENTS_A], depth=3) == ([path], [num_accepted], [next_token])


def test_greedy_on_two_different_trees_in_one_batch():
    # B: the root's argmax 4 is the token of nodes 1 and 2; the lower index (1) is taken, whose
    # argmax 3 leads to node 5, a leaf with argmax 6. Through node 2 it would have gone to node 3.
    argmax_rows = [[3, 2, 0, 6, 1, 2], [4, 3, 1, 0, 0, 6]]
    path, num_accepted, next_token = _greedy(argmax_rows, [TOKENS_A, TOKENS_B], [PARENTS_A, PARENTS_B], depth=3)
    assert path == [[0, 1, 3, 5], [0, 1, 5, 0]]
    assert num_accepted == [3, 2]
    assert next_token == [2, 6]


def test_greedy_stops_at_the_depth_bound_with_the_bonus_of_the_last_node():
    assert _greedy([[3, 2, 0, 6, 1, 2]], [TOKENS_A], [PARENTS_A], depth=1) == ([[0, 1]], [1], [2])


def test_greedy_on_a_chain_equals_chain_greedy():
    batch, k, vocab = 256, 4, 3
    logits = jax.random.normal(jax.random.key(0), (batch, k + 1, vocab))
    rng = np.random.default_rng(0)
    # Mostly the target's argmax, so that every acceptance length occurs.
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    drafts = np.where(rng.random((batch, k)) < 0.7, argmax[:, :k], rng.integers(0, vocab, (batch, k)))
    tokens = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.array(drafts, jnp.int32)], axis=1)
    parents = jnp.broadcast_to(jnp.arange(-1, k), (batch, k + 1))
    path, num_accepted, next_token = tree_verify.greedy(logits, tokens, parents, depth=k)
    chain_accepted, chain_next = verify.greedy(logits, tokens[:, 1:])
    assert set(np.asarray(num_accepted).tolist()) == set(range(k + 1))
    np.testing.assert_array_equal(num_accepted, chain_accepted)
    np.testing.assert_array_equal(next_token, chain_next)
    steps = np.arange(k + 1)
    np.testing.assert_array_equal(path, np.where(steps <= np.asarray(num_accepted)[:, None], steps, 0))


_jit_rejection_sample = jax.jit(tree_verify.rejection_sample, static_argnames="depth")


def _sample_one_level(p_root, child_tokens, depth=1, trials=20_000):
    """``rejection_sample`` on ``trials`` copies of a root with the children ``child_tokens``."""
    vocab, n = len(p_root), len(child_tokens)
    probs = jnp.concatenate([jnp.array([p_root]), jnp.full((n, vocab), 1 / vocab)])
    tokens = jnp.array([[0, *child_tokens]] * trials)
    parents = jnp.array([[-1] + [0] * n] * trials)
    probs = jnp.broadcast_to(probs, (trials, n + 1, vocab))
    out = _jit_rejection_sample(jax.random.key(1), probs, tokens, parents, depth=depth)
    return tuple(np.asarray(x) for x in out)


def test_a_duplicate_of_a_rejected_sibling_is_never_accepted():
    p_root = [0.1, 0.2, 0.5, 0.2]
    path, num_accepted, next_token = _sample_one_level(p_root, [2, 2, 3])
    # Node 1 (token 2) is accepted with p(2); node 2 repeats it and never is; node 3 is accepted
    # with r(3) = p(3) / (1 - p(2)) after node 1's rejection, p(3) in all.
    assert_matches_distribution(path[:, 1], [0.3, 0.5, 0.0, 0.2])
    # After both rejections the residual is p without tokens 2 and 3, renormalised.
    assert_matches_distribution(next_token[num_accepted == 0], [1 / 3, 2 / 3, 0.0, 0.0])
    children = np.array([0, 2, 2, 3])
    first = np.where(num_accepted == 1, children[path[:, 1]], next_token)
    assert_matches_distribution(first, p_root)


def test_children_holding_all_the_mass_are_always_accepted():
    path, num_accepted, _ = _sample_one_level([0.0, 0.5, 0.5, 0.0], [1, 1, 2])
    assert (num_accepted == 1).all()
    assert set(path[:, 1].tolist()) == {1, 3}


def test_at_depth_zero_no_child_is_tried_and_the_token_comes_from_the_root_row():
    p_root = [0.1, 0.2, 0.5, 0.2]
    path, num_accepted, next_token = _sample_one_level(p_root, [2, 2, 3], depth=0)
    assert path.shape == (20_000, 1) and (num_accepted == 0).all()
    assert_matches_distribution(next_token, p_root)


# Exactness: a Markov target (row of node i = TARGET[token i]) generates L tokens from START through
# speculative rounds over a draft tree built from a draft table; the joint of the L tokens must be
# the chain's. ``branching[level]`` lists the draft-table ranks of each node's children at that level.
SIM_VOCAB, L, START, SAMPLES = 4, 3, 0, 20_000
TARGET = np.random.default_rng(1).dirichlet(np.full(SIM_VOCAB, 0.7), SIM_VOCAB)
OTHER_DRAFT = np.random.default_rng(2).dirichlet(np.full(SIM_VOCAB, 0.7), SIM_VOCAB)


def _tree_shape(branching):
    """Static ``parents`` and per-node draft-table ``ranks`` of the tree, breadth first."""
    parents, ranks, frontier = [-1], [0], [0]
    for level_ranks in branching:
        next_frontier = []
        for node in frontier:
            for rank in level_ranks:
                next_frontier.append(len(parents))
                parents.append(node)
                ranks.append(rank)
        frontier = next_frontier
    return parents, ranks


@functools.partial(jax.jit, static_argnames="branching")
def _simulate(key, draft_order, branching):
    """First ``L`` emitted tokens ``[SAMPLES, L]`` and the first round's ``num_accepted``.

    ``draft_order [vocab, vocab]``: the draft's tokens after each token, best first."""
    parents, ranks = _tree_shape(branching)
    depth = len(branching)
    target = jnp.array(TARGET, jnp.float32)
    rows = jnp.arange(SAMPLES)[:, None]

    def round_(carry, round_key):
        last, emitted, count = carry
        node_tokens = [last]
        for parent, rank in zip(parents[1:], ranks[1:]):
            node_tokens.append(draft_order[node_tokens[parent], rank])
        tokens = jnp.stack(node_tokens, axis=1)
        parents_batch = jnp.broadcast_to(jnp.array(parents), tokens.shape)
        path, num_accepted, next_token = tree_verify.rejection_sample(
            round_key, target[tokens], tokens, parents_batch, depth=depth
        )
        # This round's tokens: the a accepted drafts, then next_token at index a.
        out = jnp.concatenate([jnp.take_along_axis(tokens, path[:, 1:], axis=1), tokens[:, :1]], axis=1)
        out = out.at[rows, num_accepted[:, None]].set(next_token[:, None])  # [SAMPLES, depth+1]
        offset = jnp.arange(emitted.shape[1])[None] - count[:, None]
        new = (offset >= 0) & (offset <= num_accepted[:, None])
        emitted = jnp.where(new, jnp.take_along_axis(out, jnp.clip(offset, 0, depth), axis=1), emitted)
        return (next_token, emitted, count + num_accepted + 1), num_accepted

    init = (
        jnp.full((SAMPLES,), START, jnp.int32),
        jnp.zeros((SAMPLES, L + depth + 1), jnp.int32),
        jnp.zeros((SAMPLES,), jnp.int32),
    )
    # A round emits >= 1 token, so L rounds reach L tokens.
    (_, emitted, _), num_accepted = jax.lax.scan(round_, init, jax.random.split(key, L))
    return emitted[:, :L], num_accepted[0]


@pytest.mark.parametrize(
    "draft_table, branching",
    [
        (OTHER_DRAFT, ((0, 1), (0, 1))),  # top-2 of another table, depth 2
        (TARGET, ((0, 1), (0, 1))),  # the target's argmax first: full paths are frequent
        (TARGET, ((0, 0, 1), (1, 0, 1))),  # duplicate sibling tokens at both levels
    ],
    ids=["other-draft", "target-draft", "duplicates"],
)
def test_speculative_rounds_sample_the_target_chain_exactly(draft_table, branching):
    draft_order = jnp.array(np.argsort(-draft_table, axis=1, kind="stable"))
    emitted, first_accepted = _simulate(jax.random.key(3), draft_order, branching)
    emitted, first_accepted = np.asarray(emitted), np.asarray(first_accepted)
    joint = TARGET[START][:, None, None] * TARGET[:, :, None] * TARGET[None, :, :]  # [x1, x2, x3]
    assert_matches_distribution(np.ravel_multi_index(emitted.T, (SIM_VOCAB,) * L), joint.ravel())
    # Every branch of the walk occurs: rejection at the root, partial paths, full paths (bonus).
    assert set(first_accepted.tolist()) == set(range(len(branching) + 1))


@pytest.mark.parametrize("fn", ["greedy", "rejection_sample"])
@pytest.mark.parametrize(
    "rows_shape, tokens_shape, parents_shape, depth, match",
    [
        ((2, 4, VOCAB), (2, 3), (2, 3), 2, r"tokens shape \(2, 3\) does not match the target rows"),
        ((2, 4, VOCAB), (1, 4), (1, 4), 2, "tokens shape"),
        ((2, 4, VOCAB), (2, 4), (2, 3), 2, r"parents shape \(2, 3\) does not match tokens shape \(2, 4\)"),
        ((4, VOCAB), (4,), (4,), 2, r"target rows must be \[batch, n\+1, vocab\]"),
        ((2, 4, VOCAB), (2, 4), (2, 4), 4, r"depth must be an int in \[0, 3\]"),
    ],
)
def test_bad_shapes_raise(fn, rows_shape, tokens_shape, parents_shape, depth, match):
    rows = jnp.zeros(rows_shape)
    tokens, parents = jnp.zeros(tokens_shape, jnp.int32), jnp.zeros(parents_shape, jnp.int32)
    with pytest.raises(ValueError, match=match):
        if fn == "greedy":
            tree_verify.greedy(rows, tokens, parents, depth=depth)
        else:
            tree_verify.rejection_sample(jax.random.key(0), rows, tokens, parents, depth=depth)
