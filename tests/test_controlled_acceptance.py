"""Controlled acceptance (the benchmarks' verification rule): a round accepts a drawn number of
drafts, each with probability alpha, so measured acceptance follows the geometric expectation
whatever the weights and the precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import engine, speculative
from jspec.bench.controlled import ControlledAcceptance, expected_acceptance_length
from jspec.drafters import DraftModel
from jspec.sampling import SamplingParams
from jspec.tree import TreeShape
from tests.tiny import tiny_model


def _accepted_per_round(alpha, k, rounds, batch=4):
    rule = ControlledAcceptance(jnp.float32(alpha))
    logits, drafts = jnp.zeros((batch, k + 1, 11)), jnp.zeros((batch, k), jnp.int32)
    return np.stack([np.asarray(rule(None, logits, drafts, jnp.full((batch,), r))[0]) for r in range(rounds)])


@pytest.mark.parametrize("alpha, k", [(0.5, 2), (0.6, 6), (0.8, 4), (0.9, 8)])
def test_the_mean_acceptance_length_tracks_the_geometric_expectation(alpha, k):
    counts = _accepted_per_round(alpha, k, rounds=80)  # [rounds, batch]
    assert counts.min() >= 0 and counts.max() <= k
    measured = 1 + counts.mean()
    assert abs(measured / expected_acceptance_length(alpha, k) - 1) < 0.02
    # The counts keep the geometric shape: full acceptance as often as alpha**k.
    assert abs((counts == k).mean() - alpha**k) < 0.05


def test_alpha_one_accepts_every_draft_and_alpha_zero_none():
    assert (_accepted_per_round(1.0, 3, rounds=10) == 3).all()
    assert (_accepted_per_round(0.0, 3, rounds=10) == 0).all()


def test_the_token_after_the_accepted_drafts_is_the_targets_argmax():
    logits = jax.random.normal(jax.random.key(0), (3, 5, 11))
    num_accepted, next_token = ControlledAcceptance(jnp.float32(0.7))(
        None, logits, jnp.zeros((3, 4), jnp.int32), jnp.arange(3))
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    np.testing.assert_array_equal(next_token, argmax[np.arange(3), np.asarray(num_accepted)])


def test_speculative_loop_measures_the_expected_acceptance():
    """A draft model on a tiny target (whose own drafts are rarely right) at alpha 0.8, k = 4:
    the on-device loop's rounds accept what the rule draws, one compile for every alpha."""
    target, draft = tiny_model(0), tiny_model(1, num_layers=1)
    batch, context, new_tokens, k = 2, 8, 129, 4
    prompts = jax.random.randint(jax.random.key(2), (batch, context), 0, target.config.vocab_size)
    capacity = engine.cache_length(context, context + new_tokens + k + 1)

    def measured(alpha):
        _, generated, rounds, accepted = speculative.speculative_on_device(
            target, DraftModel(draft).bind(target), prompts, jnp.full((batch,), context), jax.random.key(0),
            jnp.int32(new_tokens), loop=speculative.Loop(SamplingParams(), (), k, capacity, capacity),
            acceptance=ControlledAcceptance(jnp.float32(alpha)))
        assert (np.asarray(generated) == new_tokens).all()
        rounds, accepted = np.asarray(rounds).sum(), np.asarray(accepted).sum()
        return (accepted + rounds) / rounds

    assert abs(measured(0.8) / expected_acceptance_length(0.8, k) - 1) < 0.03
    assert measured(1.0) == k + 1


def test_tree_rounds_refuse_an_acceptance_rule():
    with pytest.raises(ValueError, match="tree"):
        speculative.speculative_round(None, None, None, num_draft_tokens=3, params=SamplingParams(), eos_ids=(),
                                      max_new_tokens=8, tree=TreeShape(2, 2, 3),
                                      acceptance=ControlledAcceptance(jnp.float32(0.5)))
