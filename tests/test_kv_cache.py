"""KV cache: per-sequence writes, truncation by length, stale rows never read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec import forward
from jspec.kv import KVCache, write_rows
from tests.tiny import tiny_model


def test_write_rows_lands_at_each_sequences_own_offset():
    buf = jnp.zeros((3, 2, 10, 4))
    rows = jnp.arange(3 * 2 * 3 * 4, dtype=jnp.float32).reshape(3, 2, 3, 4) + 1
    offsets = jnp.array([0, 4, 7])
    out = np.asarray(write_rows(buf, rows, offsets))
    for b, off in enumerate([0, 4, 7]):
        np.testing.assert_array_equal(out[b, :, off : off + 3], rows[b])
        untouched = np.delete(out[b], np.arange(off, off + 3), axis=1)
        assert (untouched == 0).all()


def test_truncate_only_lowers_lengths_and_keeps_buffers():
    kv = KVCache.zeros(2, 3, 2, 8, 4, jnp.float32).advance(jnp.array([5, 6, 7]))
    cut = kv.truncate(jnp.array([2, 9, 7]))
    np.testing.assert_array_equal(cut.lengths, [2, 6, 7])
    assert cut.k[0] is kv.k[0] and cut.v[1] is kv.v[1]


def _poison(kv: KVCache) -> KVCache:
    """NaN every row at or past each sequence's length."""
    rows = jnp.arange(kv.max_len)[None, None, :, None]
    stale = rows >= kv.lengths[:, None, None, None]
    nan = lambda buf: jnp.where(stale, jnp.nan, buf)  # noqa: E731
    return KVCache(k=tuple(map(nan, kv.k)), v=tuple(map(nan, kv.v)), lengths=kv.lengths)


def test_stale_rows_are_never_read():
    model = tiny_model()
    prompt = jax.random.randint(jax.random.key(1), (2, 9), 0, model.config.vocab_size)
    kv = model.init_cache(2, 32)
    _, _, kv = forward(model, prompt, kv, compute_logits=False)
    # Ragged: sequence 0 rejects its last 4 rows, as after a partly rejected draft.
    kv = kv.truncate(jnp.array([5, 9]))
    step = jnp.array([[3, 4, 5], [6, 7, 8]])
    clean, _, _ = forward(model, step, kv)
    poisoned, _, _ = forward(model, step, _poison(kv))
    assert np.isfinite(np.asarray(poisoned)).all()
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(poisoned))


def test_truncated_cache_continues_like_a_fresh_prefill():
    model = tiny_model()
    tokens = jax.random.randint(jax.random.key(2), (1, 12), 0, model.config.vocab_size)
    # Write 12 rows, keep 7, then continue with rows 7..11: same logits as one pass over all 12.
    _, _, kv = forward(model, tokens, model.init_cache(1, 16), compute_logits=False)
    kv = kv.truncate(jnp.array([7]))
    continued, _, kv = forward(model, tokens[:, 7:], kv)
    full, _, _ = forward(model, tokens, model.init_cache(1, 16))
    np.testing.assert_allclose(np.asarray(continued), np.asarray(full[:, 7:]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kv.lengths, [12])


def test_move_rows_turns_an_accepted_tree_path_into_a_chain():
    """Rows base + path[j] land at base + j in every layer (K and V); rows before base and the
    other sequences' rows are untouched; lengths are kept."""
    kv = KVCache.zeros(2, 2, 1, 12, 3, jnp.float32)
    rows = jnp.arange(12, dtype=jnp.float32)[None, None, :, None]
    marked = jnp.broadcast_to(rows + 100 * jnp.arange(2)[:, None, None, None], (2, 1, 12, 3))
    kv = KVCache(k=(marked, marked + 1000), v=(marked + 2000, marked + 3000), lengths=jnp.array([9, 7]))
    base, path = jnp.array([2, 4]), jnp.array([[0, 2, 5], [0, 1, 3]])
    moved = kv.move_rows(base, path)
    assert np.array_equal(np.asarray(moved.lengths), [9, 7])
    expected = {0: [0, 1, 2, 4, 7, 5, 6, 7, 8, 9, 10, 11], 1: [0, 1, 2, 3, 4, 5, 7, 7, 8, 9, 10, 11]}
    for layer_before, layer_after in zip(kv.k + kv.v, moved.k + moved.v):
        for b in (0, 1):
            np.testing.assert_array_equal(layer_after[b, 0, :, 0], layer_before[b, 0, expected[b], 0])
