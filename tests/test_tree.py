"""Draft trees: parent pointers -> depths and tree-attention mask, and EAGLE-2 expansion + rerank
against a straightforward numpy reference over a Markov draft table."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import tree
from jspec.tree import DraftTree

VOCAB = 6


def test_from_parents_gives_depths_and_ancestor_mask():
    parents = jnp.array([[-1, 0, 0, 1, 1, 3],  # root -> {1, 2}; 1 -> {3, 4}; 3 -> 5
                         [-1, 0, 1, 2, 0, 4]])  # a chain 1-2-3 and a branch 4-5
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    t = jax.jit(DraftTree.from_parents)(tokens, parents)
    assert t.num_nodes == 5
    np.testing.assert_array_equal(t.tokens, tokens)
    np.testing.assert_array_equal(t.parents, parents)
    np.testing.assert_array_equal(t.depths, [[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 1, 2]])
    expected_mask = [
        [[1, 0, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0],
         [1, 0, 1, 0, 0, 0],
         [1, 1, 0, 1, 0, 0],
         [1, 1, 0, 0, 1, 0],
         [1, 1, 0, 1, 0, 1]],
        [[1, 0, 0, 0, 0, 0],
         [1, 1, 0, 0, 0, 0],
         [1, 1, 1, 0, 0, 0],
         [1, 1, 1, 1, 0, 0],
         [1, 0, 0, 0, 1, 0],
         [1, 0, 0, 0, 1, 1]],
    ]
    assert t.mask.dtype == jnp.bool_
    np.testing.assert_array_equal(t.mask, np.array(expected_mask, bool))


def test_a_chain_is_causal():
    parents = jnp.arange(-1, 4, dtype=jnp.int32)[None]  # parents[i] = i - 1
    t = jax.jit(DraftTree.from_parents)(jnp.zeros((1, 5), jnp.int32), parents)
    np.testing.assert_array_equal(t.depths, [[0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(t.mask[0], np.tril(np.ones((5, 5), bool)))


# --- expansion ---------------------------------------------------------------------------------


def _best(values, k):
    """Indices of the k largest values, the lower index first among equals (as lax.top_k)."""
    return np.argsort(-values, kind="stable")[:k]


def reference_expand(root_logprobs, table, topk, depth, num_nodes):
    """EAGLE-2 for one sequence whose draft gives ``table[token]`` as the log-probs after ``token``.

    Returns the kept nodes' (tokens, parents, depths), root excluded, parents as node ids.
    """
    candidates = [(t, root_logprobs[t], -1) for t in _best(root_logprobs, topk)]  # (token, score, parent cand)
    frontier = list(range(topk))
    for _ in range(1, depth):
        level = []
        for f in frontier:
            token, score, _ = candidates[f]
            level += [(t, np.float32(score + table[token, t]), f) for t in _best(table[token], topk)]
        first = len(candidates)
        candidates += level
        frontier = [first + i for i in _best(np.array([c[1] for c in level]), topk)]
    kept = sorted(_best(np.array([c[1] for c in candidates]), num_nodes))
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    tokens, parents, depths = [], [], [0]
    for c in kept:
        parent = candidates[c][2]
        tokens.append(candidates[c][0])
        parents.append(0 if parent < 0 else node_of[parent])
        depths.append(depths[parents[-1]] + 1)
    return tokens, parents, depths[1:]


def markov_step(table):
    """A step_fn whose drafter gives ``table[b, token]`` after ``token``; the carry counts calls."""

    def step(calls, tokens, parent_slot, level):
        return table[jnp.arange(table.shape[0])[:, None], tokens], calls + 1

    return step


def _expand(root_logprobs, root_token, step_fn, carry, **shape):
    """``tree.expand`` under ``jax.jit`` (step_fn and the shape static): (tree, carry, fed_row)."""
    out = jax.jit(functools.partial(tree.expand, step_fn=step_fn, **shape))(
        root_logprobs=root_logprobs, root_token=root_token, carry=carry)
    return jax.tree.map(np.asarray, out)


def _random_problem(seed, batch=2):
    kr, kt = jax.random.split(jax.random.key(seed))
    root_logprobs = jax.nn.log_softmax(2.0 * jax.random.normal(kr, (batch, VOCAB)))
    table = jax.nn.log_softmax(2.0 * jax.random.normal(kt, (batch, VOCAB, VOCAB)))
    return root_logprobs, table


def _assert_matches_reference(t, root_token, root_logprobs, table, topk, depth, num_nodes):
    assert t.tokens.shape == (root_token.shape[0], num_nodes + 1)
    np.testing.assert_array_equal(t.tokens[:, 0], root_token)
    np.testing.assert_array_equal(t.parents[:, 0], -1)
    for b in range(root_token.shape[0]):
        tokens, parents, depths = reference_expand(
            np.asarray(root_logprobs[b]), np.asarray(table[b]), topk, depth, num_nodes)
        np.testing.assert_array_equal(t.tokens[b, 1:], tokens)
        np.testing.assert_array_equal(t.parents[b, 1:], parents)
        np.testing.assert_array_equal(t.depths[b, 1:], depths)


@pytest.mark.parametrize(
    "topk, depth, num_nodes",
    [(1, 4, 4), (1, 4, 2), (2, 1, 2), (2, 3, 5), (2, 3, 10), (3, 3, 7), (3, 2, 1)],
)
def test_expand_matches_the_reference(topk, depth, num_nodes):
    root_logprobs, table = _random_problem(topk * 100 + depth * 10 + num_nodes)
    root_token = jnp.array([4, 1], jnp.int32)
    t, calls, _ = _expand(root_logprobs, root_token, markov_step(table), jnp.int32(0),
                       topk=topk, depth=depth, num_nodes=num_nodes)
    assert int(calls) == depth - 1
    _assert_matches_reference(t, root_token, root_logprobs, table, topk, depth, num_nodes)
    # The mask is the ancestor closure of the returned parents.
    np.testing.assert_array_equal(t.mask, DraftTree.from_parents(t.tokens, t.parents).mask)


def test_topk_one_is_the_greedy_chain():
    root_logprobs, table = _random_problem(7)
    t, _, _ = _expand(root_logprobs, jnp.array([0, 0]), markov_step(table), jnp.int32(0), topk=1, depth=5, num_nodes=5)
    np.testing.assert_array_equal(t.parents, np.broadcast_to(np.arange(-1, 5), (2, 6)))
    root_logprobs, table = np.asarray(root_logprobs), np.asarray(table)
    for b in range(2):
        token = np.argmax(root_logprobs[b])
        for i in range(1, 6):
            assert t.tokens[b, i] == token
            token = np.argmax(table[b, token])


def test_depth_one_keeps_the_top_children_of_the_root_and_never_steps():
    def step(*_):
        raise AssertionError("step_fn called with depth == 1")

    root_logprobs = jnp.log(jnp.array([[0.1, 0.4, 0.05, 0.3, 0.1, 0.05]]))
    t, _, fed_row = _expand(root_logprobs, jnp.array([2]), step, None, topk=3, depth=1, num_nodes=3)
    np.testing.assert_array_equal(t.tokens, [[2, 1, 3, 0]])
    np.testing.assert_array_equal(t.parents, [[-1, 0, 0, 0]])
    np.testing.assert_array_equal(fed_row, [[-1, -1, -1, -1]])


def test_score_ties_never_keep_a_child_without_its_parent():
    """Children of draft probability exactly 1 (log-prob 0) tie their parents' scores; the rerank
    cuts inside such tie groups and must keep parents first."""
    root_logprobs = jnp.full((2, VOCAB), -5.0).at[0, jnp.array([0, 3])].set(-1.0).at[1, jnp.array([1, 5])].set(-0.5)
    successor = (jnp.arange(VOCAB) + 1) % VOCAB
    certain = jax.nn.one_hot(successor, VOCAB, dtype=bool)  # token t -> t + 1 with probability 1
    table = jnp.stack([jnp.where(certain, 0.0, -3.0), jnp.where(certain, 0.0, -jnp.inf)])
    root_np, table_np = np.asarray(root_logprobs), np.asarray(table)
    root_token = jnp.array([2, 2], jnp.int32)
    for num_nodes in (3, 5, 8):
        t, _, _ = _expand(root_logprobs, root_token, markov_step(table), jnp.int32(0), topk=2, depth=3,
                          num_nodes=num_nodes)
        _assert_matches_reference(t, root_token, root_logprobs, table, 2, 3, num_nodes)
        # Each draft is one of the top-2 children of its parent's token: no parent was dropped.
        for b in range(2):
            for i in range(1, num_nodes + 1):
                parent = t.parents[b, i]
                parent_logprobs = root_np[b] if parent == 0 else table_np[b, t.tokens[b, parent]]
                assert t.tokens[b, i] in _best(parent_logprobs, 2)
        if num_nodes == 5:
            # Six candidates score -1 in sequence 0 (levels 1-3 along 0->1->2 and 3->4->5); five
            # keep the first five.
            np.testing.assert_array_equal(t.tokens[0], [2, 0, 3, 1, 4, 2])
            np.testing.assert_array_equal(t.parents[0], [-1, 0, 0, 1, 2, 3])


def _recorded_expansion(topk, depth):
    """Expand a random Markov problem keeping every candidate, with a step_fn that records the
    frontier tokens, parent slots and levels it receives (in its carry), and the root-to-node token
    path of every node (``paths[b][tokens along the path] = node id``)."""
    root_logprobs, table = _random_problem(11)

    def recording_step(log, tokens, parent_slot, level):
        seen_tokens, seen_slots, seen_levels = log
        log = (seen_tokens.at[level - 1].set(tokens), seen_slots.at[level - 1].set(parent_slot),
               seen_levels.at[level - 1].set(level))
        return table[jnp.arange(2)[:, None], tokens], log

    empty = (jnp.zeros((depth - 1, 2, topk), jnp.int32),) * 2 + (jnp.zeros(depth - 1, jnp.int32),)
    num_nodes = tree.max_nodes(topk, depth)  # keep everything, so every frontier node is in the tree
    t, seen, fed_row = _expand(root_logprobs, jnp.array([0, 0]), recording_step, empty,
                               topk=topk, depth=depth, num_nodes=num_nodes)
    paths = []
    for b in range(2):
        node_paths = {(): 0}
        for i in range(1, num_nodes + 1):
            parent_path = next(p for p, n in node_paths.items() if n == int(t.parents[b, i]))
            node_paths[parent_path + (int(t.tokens[b, i]),)] = i
        paths.append(node_paths)
    return t, seen, fed_row, paths


def _frontier_paths(seen_tokens, seen_slots, b):
    """Per level, the token path of each frontier row, following parent slots back to level 1."""
    levels = [[(int(tok),) for tok in seen_tokens[0, b]]]
    for level in range(1, seen_tokens.shape[0]):
        levels.append([levels[-1][int(s)] + (int(tok),) for tok, s in zip(seen_tokens[level, b], seen_slots[level, b])])
    return levels


def test_parent_slot_points_at_the_parent_row_of_the_previous_frontier():
    topk, depth = 3, 4
    _, (seen_tokens, seen_slots, seen_levels), _, paths = _recorded_expansion(topk, depth)
    np.testing.assert_array_equal(seen_levels, np.arange(1, depth))
    np.testing.assert_array_equal(seen_slots[0], 0)  # level 1: the parent is the root
    assert (np.asarray(seen_slots[1:]) != np.arange(topk)).any()  # the fixture does reorder rows
    for b in range(2):
        # Each frontier row's path through the parent slots is a root-to-node path of the tree.
        for level_paths in _frontier_paths(seen_tokens, seen_slots, b):
            assert all(p in paths[b] for p in level_paths)


def test_fed_row_names_where_each_node_was_fed():
    topk, depth = 3, 4
    t, (seen_tokens, seen_slots, _), fed_row, paths = _recorded_expansion(topk, depth)
    for b in range(2):
        expected = np.full(t.num_nodes + 1, -1)
        for level, level_paths in enumerate(_frontier_paths(seen_tokens, seen_slots, b)):
            for row, path in enumerate(level_paths):
                expected[paths[b][path]] = level * topk + row
        np.testing.assert_array_equal(fed_row[b], expected)
    # Every row fed to the drafter is one node; the last level is never fed.
    assert sorted(fed_row[0][fed_row[0] >= 0].tolist()) == list(range((depth - 1) * topk))
    assert (fed_row[t.depths == depth] == -1).all()


def test_tree_shape_is_none_for_a_chain_and_checks_a_tree():
    assert tree.tree_shape(1, None, 4) is None
    assert tree.tree_shape(1, 4, 4) is None
    shape = tree.tree_shape(2, 3, 5)
    assert shape == tree.TreeShape(topk=2, depth=3, num_nodes=5) and shape.fed_rows == 4
    hash(shape)  # a static argument of the jitted round
    for args, problem in [((2, None, 5), "depth"), ((1, 3, 4), "chain"), ((2, 3, 11), "exceeds"), ((0, 3, 4), "topk")]:
        with pytest.raises(ValueError, match=problem):
            tree.tree_shape(*args)


@pytest.mark.parametrize(
    "shape, problem",
    [
        ({"topk": 0, "depth": 2, "num_nodes": 1}, "topk"),
        ({"topk": 2, "depth": 0, "num_nodes": 1}, "depth"),
        ({"topk": 2, "depth": 2, "num_nodes": 0}, "num_nodes"),
        ({"topk": 2, "depth": 3, "num_nodes": 11}, "exceeds the 10 candidates"),
        ({"topk": 7, "depth": 1, "num_nodes": 1}, "vocabulary"),
        ({"topk": 2.0, "depth": 1, "num_nodes": 1}, "topk"),
    ],
)
def test_bad_arguments_raise_before_any_step(shape, problem):
    def step(*_):
        raise AssertionError("step_fn called")

    with pytest.raises(ValueError, match=problem):
        tree.expand(jnp.zeros((2, VOCAB)), jnp.zeros(2, jnp.int32), step, None, **shape)


def test_root_token_must_match_the_batch():
    with pytest.raises(ValueError, match="root_token"):
        tree.expand(jnp.zeros((2, VOCAB)), jnp.zeros(3, jnp.int32), None, None, topk=1, depth=1, num_nodes=1)
