"""The acceptance rules on their own, against exact computations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import verify
from tests.stats import assert_matches_distribution

VOCAB = 6


def test_greedy_accepts_the_matching_prefix_and_emits_the_target_token():
    # target argmax per row: [3, 1, 4, 1]
    logits = jax.nn.one_hot(jnp.array([[3, 1, 4, 1], [3, 1, 4, 1], [3, 1, 4, 1]]), VOCAB)
    drafts = jnp.array([[3, 1, 4], [3, 2, 4], [0, 1, 4]])
    num_accepted, next_token = verify.greedy(logits, drafts)
    assert num_accepted.tolist() == [3, 1, 0]
    assert next_token.tolist() == [1, 1, 3]


def _random_dists(key, shape):
    return jax.nn.softmax(2.0 * jax.random.normal(key, shape + (VOCAB,)), axis=-1)


@pytest.mark.parametrize("one_hot_q", [False, True])
def test_first_emitted_token_has_the_target_distribution(one_hot_q):
    """Drafts drawn from q, then rejection sampling: token 1 ~ p_1 exactly, whatever q is."""
    k, trials = 3, 200_000
    kp, kq, kd, ka = jax.random.split(jax.random.key(0), 4)
    p = _random_dists(kp, (k + 1,))
    q = _random_dists(kq, (k,))
    if one_hot_q:
        # A deterministic drafter: always the same tokens, q one-hot at them.
        drafts = jnp.broadcast_to(jnp.array([2, 0, 5]), (trials, k))
        q_batch = None
    else:
        drafts = jax.random.categorical(kd, jnp.log(q), shape=(trials, k))
        q_batch = jnp.broadcast_to(q, (trials, k, VOCAB))
    num_accepted, next_token = verify.rejection_sample(ka, jnp.broadcast_to(p, (trials, k + 1, VOCAB)), drafts, q_batch)
    first = np.where(np.asarray(num_accepted) >= 1, np.asarray(drafts[:, 0]), np.asarray(next_token))
    assert_matches_distribution(first, np.asarray(p[0]))
    # Acceptance of d_1 happens with probability sum_y min(p_1, q_1)(y).
    q1 = jax.nn.one_hot(2, VOCAB) if one_hot_q else q[0]
    expected_rate = float(jnp.sum(jnp.minimum(p[0], q1)))
    assert abs(float(jnp.mean(num_accepted >= 1)) - expected_rate) < 0.005


def test_after_all_accepted_the_bonus_comes_from_the_last_row():
    k, trials = 2, 100_000
    p = _random_dists(jax.random.key(3), (k + 1,))
    drafts = jnp.zeros((trials, k), jnp.int32)
    p = p.at[:k].set(jax.nn.one_hot(0, VOCAB))  # the target certainly accepts both drafts
    num_accepted, next_token = verify.rejection_sample(jax.random.key(4), jnp.broadcast_to(p, (trials, k + 1, VOCAB)), drafts)
    assert (np.asarray(num_accepted) == k).all()
    assert_matches_distribution(np.asarray(next_token), np.asarray(p[k]))


def test_equal_p_and_q_accepts_everything():
    k, trials = 4, 10_000
    p = _random_dists(jax.random.key(5), (k + 1,))
    drafts = jax.random.categorical(jax.random.key(6), jnp.log(p[:k]), shape=(trials, k))
    num_accepted, _ = verify.rejection_sample(
        jax.random.key(7), jnp.broadcast_to(p, (trials, k + 1, VOCAB)), drafts, jnp.broadcast_to(p[:k], (trials, k, VOCAB))
    )
    assert (np.asarray(num_accepted) == k).all()
