"""Every drafter implements the one protocol of ``jspec.drafters.base`` the same way, and keeps
its cache discipline: ``propose`` never shortens a cache, ``commit`` alone rolls back."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import (
    MTP, DraftModel, Drafter, Eagle3, FrozenKVMTP, NGram, assistant_config, init_assistant, init_mtp_head,
)
from jspec.drafters.base import RoundContext
from jspec.engine import pad_prompts
from jspec.kv import KVCache
from jspec.sampling import SamplingParams
from jspec.speculative import speculative_round, start
from tests.tiny import eagle3_head, tiny_gemma4, tiny_model

K = 3


def _drafter(kind, target):
    return {
        "draft": lambda: DraftModel(tiny_model(1, num_layers=1)),
        "self": lambda: DraftModel(target),  # accepts every draft: the all-accepted commit
        "ngram": lambda: NGram(max_ngram=2),
        "eagle3": lambda: Eagle3(eagle3_head(2, target, aux=(0, 1, 1))),
        "mtp": lambda: MTP(init_mtp_head(target.config, jax.random.key(3), scale=0.3)),
        "frozen_kv_mtp": lambda: FrozenKVMTP(
            init_assistant(assistant_config(target.config, hidden_size=32), jax.random.key(4), scale=0.3)
        ),
    }[kind]()


def _draft_cache(dstate) -> KVCache | None:
    caches = [x for x in jax.tree.leaves(dstate, is_leaf=lambda x: isinstance(x, KVCache)) if isinstance(x, KVCache)]
    return caches[0] if caches else None


@pytest.mark.parametrize("kind", ["draft", "self", "ngram", "eagle3", "mtp", "frozen_kv_mtp"])
def test_drafter_implements_the_protocol_and_rolls_back_only_in_commit(kind):
    target = tiny_gemma4(0) if kind == "frozen_kv_mtp" else tiny_model(0)  # the Gemma 4 assistant needs its family
    drafter = _drafter(kind, target)
    assert isinstance(drafter, Drafter)
    assert dataclasses.is_dataclass(drafter) and dataclasses.fields(drafter)  # a registered dataclass pytree
    bound = drafter.bind(target)
    assert type(bound) is type(drafter) and isinstance(bound.capture, jspec.Capture)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(bound))  # settings are static
    assert jax.tree.structure(jax.tree.map(lambda x: x, bound)) == jax.tree.structure(bound)

    tokens, lengths = pad_prompts([[5, 17, 42, 8, 9], [7, 1], [3, 3, 3, 3, 3, 3, 3, 3, 3]])
    params = SamplingParams()
    state = start(target, bound, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                  params=params, eos_ids=(), capacity=128, max_len=128)
    round_ = jax.jit(functools.partial(speculative_round, target, bound, num_draft_tokens=K, params=params,
                                       eos_ids=(), max_new_tokens=jnp.int32(64)))
    # The draft cache holds every committed token (own caches of hidden-state heads) or every one
    # but the last (a draft model, which re-feeds it with the root).
    lag = 1 if isinstance(bound, DraftModel) else 0
    for _ in range(3):
        cache = _draft_cache(state.draft_state)
        if cache is not None:
            np.testing.assert_array_equal(cache.lengths, state.target_kv.lengths - lag)
            ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
            _, _, proposed = bound.propose(state.draft_state, ctx, num_draft_tokens=K, params=params,
                                           key=jax.random.key(1))
            assert (np.asarray(_draft_cache(proposed).lengths) >= np.asarray(cache.lengths)).all()
        state = round_(state)
    if kind == "self":
        np.testing.assert_array_equal(state.accepted, 3 * K)
