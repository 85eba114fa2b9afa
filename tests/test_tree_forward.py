"""A target forward over a draft tree (``tree_mask``) gives every node the logits and K/V it would
get as the last token of its own root-to-node chain, for every model family."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.execution import with_kernels
from jspec.models import forward
from tests.tiny import tiny_gemma4, tiny_model

# Two sequences with different trees over 6 nodes (node 0 = root; parents before children).
PARENTS = np.array([[-1, 0, 0, 1, 1, 3],  # root -> {1, 2}; 1 -> {3, 4}; 3 -> 5
                    [-1, 0, 1, 2, 0, 4]])  # a chain of 3 and a branch of 2


def _paths(parents):
    """Root-to-node paths (node ids) of every node."""
    paths = []
    for i, parent in enumerate(parents):
        paths.append([0] if parent < 0 else paths[parent] + [i])
    return paths


def _mask(parents):
    n = parents.shape[1]
    mask = np.zeros((parents.shape[0], n, n), bool)
    for b in range(parents.shape[0]):
        for i, path in enumerate(_paths(parents[b])):
            mask[b, i, path] = True
    return mask


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_tree_rows_match_their_chains(family):
    model = tiny_model(3, qk_norm=True) if family == "llama" else tiny_gemma4(4, sliding_window=4)
    model = with_kernels(model, "xla")
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prefix_lengths = np.array([7, 3])
    prompt = jnp.asarray(rng.integers(0, vocab, size=(2, 7)), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, vocab, size=PARENTS.shape), jnp.int32)
    kv = model.init_cache(2, 32)
    _, _, kv = forward(model, prompt, kv, compute_logits=False)
    kv = kv.truncate(jnp.asarray(prefix_lengths, jnp.int32))

    logits, _, tree_kv = jax.jit(lambda t, m, kv: forward(model, t, kv, tree_mask=m))(
        tokens, jnp.asarray(_mask(PARENTS)), kv)
    assert np.array_equal(np.asarray(tree_kv.lengths), prefix_lengths + PARENTS.shape[1])
    for b in range(2):
        for i, path in enumerate(_paths(PARENTS[b])):
            chain = tokens[b : b + 1, np.array(path)]
            one = jax.tree.map(lambda x: x[b : b + 1] if x.ndim else x, kv)
            chain_logits, _, chain_kv = forward(model, chain, one)
            np.testing.assert_allclose(logits[b, i], chain_logits[0, -1], atol=2e-5, rtol=2e-5)
            # The node's K/V row (written at prefix + i) is the one its chain writes at prefix + depth.
            row, chain_row = prefix_lengths[b] + i, prefix_lengths[b] + len(path) - 1
            for layer_k, chain_k in zip(tree_kv.k, chain_kv.k):
                np.testing.assert_allclose(layer_k[b, :, row], chain_k[0, :, chain_row], atol=2e-5, rtol=2e-5)


def test_tree_mask_of_the_wrong_shape_is_refused():
    model = tiny_model(0)
    kv = model.init_cache(1, 16)
    with pytest.raises(ValueError, match="tree_mask must be"):
        forward(model, jnp.zeros((1, 3), jnp.int32), kv, tree_mask=jnp.ones((1, 3, 2), bool))
