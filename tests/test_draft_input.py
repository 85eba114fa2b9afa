"""A greedy draft step's token and next layer input in one launch: the Pallas kernel (interpret mode
on CPU) against its reference, and the reference against the composition it stands for."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._dispatch import warm_up_interpret
from pallas_kernels.draft_input import draft_input, draft_input_pallas, draft_input_reference
from pallas_kernels.gather_rows import rms_norm


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    warm_up_interpret()


@functools.partial(jax.jit, static_argnames=("impl",))
def _run(logits, hidden, embed, embed_norm, hidden_norm, d2t, *, impl):
    return draft_input(logits, hidden, embed, embed_norm, hidden_norm, 1e-5, d2t=d2t, impl=impl)


def _inputs(batch, draft_vocab, vocab, width, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        logits=jnp.asarray(rng.standard_normal((batch, draft_vocab)), jnp.float32),
        hidden=jnp.asarray(3 * rng.standard_normal((batch, width)), dtype),
        embed=jnp.asarray(rng.standard_normal((vocab, width)), dtype),
        embed_norm=jnp.asarray(1 + rng.standard_normal(width), dtype),
        hidden_norm=jnp.asarray(1 + rng.standard_normal(width), dtype),
        d2t=jnp.asarray(np.sort(rng.choice(vocab, draft_vocab, replace=False)) - np.arange(draft_vocab), jnp.int32),
    )


@pytest.mark.parametrize("batch,draft_vocab,vocab,width,dtype,mapped", [
    (2, 5000, 7000, 96, jnp.bfloat16, True),  # two logit chunks, the last partial; H not a power of two
    (3, 300, 300, 64, jnp.float32, False),  # one partial chunk, no draft-to-target map
    (1, 4096, 6000, 4100, jnp.bfloat16, True),  # exactly one chunk; rows of two chunks
])
def test_kernel_matches_reference(batch, draft_vocab, vocab, width, dtype, mapped):
    x = _inputs(batch, draft_vocab, vocab, width, dtype)
    if not mapped:
        x["d2t"] = None
    tokens, layer_input = _run(**x, impl="pallas")
    want_tokens, want_input = _run(**x, impl="xla")
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    assert layer_input.shape == (batch, 2 * width) and layer_input.dtype == want_input.dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(layer_input, np.float32), np.asarray(want_input, np.float32), **tol)


def test_ties_and_all_minus_inf_pick_the_first_index_as_argmax():
    x = _inputs(4, 5000, 7000, 64, jnp.bfloat16, seed=1)
    logits = x["logits"]
    logits = logits.at[0, [10, 4500]].set(50.0)  # a tie across chunks: the earlier chunk's
    logits = logits.at[1, [4200, 4900]].set(50.0)  # a tie within the last, partial chunk
    logits = logits.at[2].set(-jnp.inf)  # nothing to pick: index 0
    logits = logits.at[3, 4999].set(50.0)  # the very last logit
    x["logits"] = logits
    tokens, _ = _run(**x, impl="pallas")
    ids = np.asarray([10, 4200, 0, 4999])
    np.testing.assert_array_equal(np.asarray(tokens), ids + np.asarray(x["d2t"])[ids])
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(_run(**x, impl="xla")[0]))


def test_reference_is_the_composition():
    x = _inputs(2, 50, 80, 16, jnp.float32)
    tokens, layer_input = draft_input_reference(**{k: v for k, v in x.items() if k != "d2t"}, eps=1e-5, d2t=x["d2t"])
    ids = np.argmax(np.asarray(x["logits"]), axis=-1)
    np.testing.assert_array_equal(np.asarray(tokens), ids + np.asarray(x["d2t"])[ids])
    want = jnp.concatenate([rms_norm(x["embed"][tokens], x["embed_norm"], 1e-5),
                            rms_norm(x["hidden"], x["hidden_norm"], 1e-5)], axis=-1)
    np.testing.assert_array_equal(np.asarray(layer_input), np.asarray(want))


def test_bad_shapes_raise():
    x = _inputs(2, 50, 80, 16, jnp.float32)
    with pytest.raises(ValueError, match="draft_input needs"):
        draft_input(x["logits"], x["hidden"][:, :8], x["embed"], x["embed_norm"], x["hidden_norm"], 1e-5)
    with pytest.raises(ValueError, match="draft_input needs"):
        draft_input(x["logits"], x["hidden"], x["embed"], x["embed_norm"], x["hidden_norm"], 1e-5, d2t=x["d2t"][:3])
    table = jax.ShapeDtypeStruct((2**20, 2**11), jnp.bfloat16)  # 2^31 elements: past int32 offsets
    row = jax.ShapeDtypeStruct((2**11,), jnp.bfloat16)
    hidden = jax.ShapeDtypeStruct((2, 2**11), jnp.bfloat16)
    with pytest.raises(ValueError, match="int32 offsets"):
        jax.eval_shape(functools.partial(draft_input_pallas, eps=1e-5), x["logits"], hidden, table, row, row)
