"""The Mosaic GPU wide-head decode-attention kernel against the jnp reference: in the Mosaic GPU
interpreter on CPU, compiled on a GPU. Cache rows past each length hold NaN."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.decode_attention import decode_attention_reference
from pallas_kernels.attention.wide_head_decode import decode_attention_wide
from pallas_kernels.attention.wide_head_tiling import (default_block_kv, default_share_scores, default_slots, default_splits,
                                             supports)
from pallas_kernels.attention.wide_head_merge import merge_splits, merge_splits_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu" and jax.__version_info__ < (0, 12),
                                reason="the Mosaic GPU interpreter needs jax >= 0.12")


def _case(seed, *, batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, lengths, positions=None):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, num_q, num_q_heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, num_kv_heads, max_len, head_dim), jnp.bfloat16) for key in keys[1:])
    lengths = jnp.asarray(lengths, jnp.int32)
    past = jnp.arange(max_len)[None, None, :, None] >= lengths[:, None, None, None]
    k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
    if positions is None:  # the last num_q rows of each length (verify / decode)
        positions = lengths[:, None] - num_q + jnp.arange(num_q, dtype=jnp.int32)[None, :]
    return q, k, v, lengths, jnp.asarray(positions, jnp.int32)


CASES = [  # (name, shapes, kernel kwargs)
    ("one_consumer_ragged", dict(batch=3, num_q=2, num_q_heads=8, num_kv_heads=2, max_len=256, head_dim=256,
                                 lengths=[256, 100, 2]), {}),
    ("two_consumers_splits", dict(batch=2, num_q=5, num_q_heads=16, num_kv_heads=2, max_len=384, head_dim=512,
                                  lengths=[383, 70]), dict(k_splits=3)),
    ("full_m_tile_ring", dict(batch=1, num_q=8, num_q_heads=8, num_kv_heads=1, max_len=512, head_dim=256,
                              lengths=[450]), dict(k_splits=2, slots=3)),
    # 72 rows (Gemma 4 31B verifying 8 drafts): two M tiles, the second one's queries later than the first's.
    ("two_m_tiles", dict(batch=2, num_q=9, num_q_heads=16, num_kv_heads=2, max_len=256, head_dim=512,
                         lengths=[250, 40]), dict(k_splits=2)),
    # 32-row K/V blocks (a deeper ring at the same bytes); the last block of each length cut inside a block.
    ("thirty_two_row_blocks", dict(batch=2, num_q=5, num_q_heads=16, num_kv_heads=2, max_len=320, head_dim=512,
                                   lengths=[301, 45]), dict(block_kv=32, k_splits=3)),
    # The same rows with each consumer computing the scores over the whole head_dim (no exchange).
    ("scores_not_shared", dict(batch=2, num_q=9, num_q_heads=16, num_kv_heads=2, max_len=256, head_dim=512,
                               lengths=[250, 40]), dict(k_splits=2, block_kv=32, share_scores=False)),
    # Frozen-KV drafting: every query at one position before the cache's end; a padding query (-1) sees nothing.
    ("drafts_at_one_position", dict(batch=2, num_q=3, num_q_heads=4, num_kv_heads=1, max_len=256, head_dim=256,
                                    lengths=[200, 64], positions=[[150, 150, -1], [63, 63, 63]]), dict(k_splits=4)),
]


def check_against_the_reference(kernel, name, shapes, kernel_kw):
    """``kernel`` (the signature of :func:`decode_attention_wide`) on a NaN-poisoned ragged case."""
    q, k, v, lengths, positions = _case(zlib.crc32(name.encode()) % 1000, **shapes)  # the same in every process
    got = kernel(q, k, v, lengths, q_positions=positions, **kernel_kw)
    want = decode_attention_reference(q, k, v, lengths, q_positions=positions)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name, shapes, kernel_kw", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_the_reference(name, shapes, kernel_kw):
    check_against_the_reference(decode_attention_wide, name, shapes, kernel_kw)


def test_a_query_that_sees_nothing_gets_zeros():
    q, k, v, lengths, _ = _case(7, batch=1, num_q=2, num_q_heads=4, num_kv_heads=1, max_len=128, head_dim=256,
                                lengths=[128])
    got = decode_attention_wide(q, k, v, lengths, q_positions=jnp.array([[-1, 5]]), k_splits=2)
    np.testing.assert_array_equal(np.asarray(got[0, 0], np.float32), 0.0)


def test_shapes_it_cannot_run_are_refused():
    assert supports(5, 32, 4, 4096, 512, jnp.bfloat16)  # Gemma 4 31B full layers, 5 query rows
    assert supports(9, 32, 4, 4096, 512, jnp.bfloat16)  # 72 rows: two M tiles
    assert not supports(1, 8, 2, 4096, 128, jnp.bfloat16)
    assert not supports(1, 8, 2, 4000, 512, jnp.bfloat16)
    assert not supports(1, 8, 2, 4096, 512, jnp.float32)
    q, k, v, lengths, positions = _case(0, batch=1, num_q=2, num_q_heads=8, num_kv_heads=1, max_len=128,
                                        head_dim=256, lengths=[128])
    with pytest.raises(ValueError, match="max_len a multiple of block_kv"):
        decode_attention_wide(q, k[:, :, :100], v[:, :, :100], lengths, q_positions=positions)
    with pytest.raises(ValueError, match="shared memory"):
        decode_attention_wide(q[:, :1], k, v, lengths, q_positions=positions[:, :1], slots=1)
    with pytest.raises(ValueError, match="shared memory"):  # 64-row blocks leave no room for the exchange
        decode_attention_wide(*_case(0, batch=1, num_q=1, num_q_heads=8, num_kv_heads=1, max_len=128, head_dim=512,
                                     lengths=[128])[:4], q_positions=positions[:, :1], block_kv=64, share_scores=True)


def test_multicast_is_refused_at_64_row_blocks():
    q = jnp.zeros((1, 9, 32, 512), jnp.bfloat16)
    cache = jnp.zeros((1, 4, 512, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="multicast=True needs 32-row blocks"):
        decode_attention_wide(q, cache, cache, jnp.array([512]), q_positions=jnp.arange(9)[None], block_kv=64,
                              multicast=True)


def test_a_fuller_m_tile_takes_32_row_blocks_in_a_ring_of_eight():
    assert default_block_kv(5, 32, 4) == 32 and default_block_kv(9, 32, 4) == 32  # 40, 72 rows
    assert default_block_kv(5, 8, 2) == 64 and default_block_kv(9, 8, 2) == 32  # E4B: 20, 36 rows
    assert default_slots(32, 10) == 8 and default_slots(64, 5) == 5
    assert default_share_scores(32, 2) and not default_share_scores(64, 2) and not default_share_scores(32, 1)


def test_default_splits_aim_at_one_cta_per_sm():
    assert default_splits(1, 4, 32768, 64) == 33
    assert default_splits(8, 4, 32768, 64) == 4
    assert default_splits(32, 4, 32768, 64) == 1
    assert default_splits(1, 4, 256, 64) == 1  # at least 4 blocks per split
    assert default_splits(1, 4, 32768, 64, tiles=2) == 16  # the M tiles of a head share the SMs too


@pytest.mark.parametrize("num_q, num_q_heads, num_kv_heads, head_dim, block_kv", [
    (1, 32, 4, 512, 64),  # Gemma 4 31B full layers: decode / one draft row
    (9, 32, 4, 512, 64),  # 31B verifying 8 drafts: two M tiles
    (5, 32, 4, 512, 32),  # 31B verifying 4 drafts in 32-row blocks
    (5, 32, 16, 256, 64),  # 31B sliding layers
])
def test_default_ring_fits_shared_memory_when_lowered_for_cuda(num_q, num_q_heads, num_kv_heads, head_dim, block_kv):
    """The whole Mosaic GPU lowering against an abstract H100 (no GPU): the default ring, q, limits
    and barriers fit one CTA's 227 KiB, which the interpreter does not check."""
    from tests._lowering import lower_for_cuda

    q = jnp.zeros((1, num_q, num_q_heads, head_dim), jnp.bfloat16)
    cache = jnp.zeros((1, num_kv_heads, 4096, head_dim), jnp.bfloat16)
    lengths, positions = jnp.array([4000]), 3990 + jnp.arange(num_q)[None]
    text = lower_for_cuda(lambda *args: decode_attention_wide(*args, q_positions=positions, block_kv=block_kv,
                                                              interpret=False),
                          q, cache, cache, lengths)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("batch, num_kv_heads, tiles, k_splits, num_q, group", [
    (2, 2, 1, 3, 5, 8),  # 40 rows of one tile, a split count short of a power of two
    (1, 4, 2, 2, 9, 8),  # 72 rows: the second tile's queries
    (3, 1, 1, 5, 2, 4),
])
def test_the_one_launch_merge_matches_its_reference(batch, num_kv_heads, tiles, k_splits, num_q, group):
    """Splits that saw nothing of a row (lse -inf) weigh nothing; a row no split saw comes out zero."""
    keys = jax.random.split(jax.random.key(k_splits), 2)
    shape = (batch, num_kv_heads * tiles, k_splits, 64)
    partials = jax.random.normal(keys[0], (*shape, 512), jnp.bfloat16)
    lse = 8 * jax.random.normal(keys[1], shape, jnp.float32)
    lse = lse.at[:, :, 0, :group].set(-jnp.inf).at[0, 0, :, group:2 * group].set(-jnp.inf)
    kw = dict(num_q=num_q, num_kv_heads=num_kv_heads, group=group, dtype=jnp.bfloat16)
    got = np.asarray(merge_splits(partials, lse, interpret=True, **kw), np.float32)
    want = np.asarray(merge_splits_reference(partials, lse, **kw), np.float32)
    assert got.shape == (batch, num_q, num_kv_heads * group, 512)
    np.testing.assert_allclose(got, want, atol=1e-2, rtol=1e-2)
    np.testing.assert_array_equal(got[0, 1, :group], 0.0)


def test_the_merge_names_partials_of_the_wrong_shape():
    with pytest.raises(ValueError, match="partials"):  # tile rows not a multiple of 8
        merge_splits(jnp.zeros((1, 2, 3, 12, 512)), jnp.zeros((1, 2, 3, 12)), num_q=1, num_kv_heads=2, group=8,
                     dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        merge_splits(jnp.zeros((1, 2, 3, 32, 512)), jnp.zeros((1, 2, 3, 32)), num_q=5, num_kv_heads=2, group=8,
                     dtype=jnp.bfloat16)


def test_the_one_launch_merge_lowers_for_cuda():
    from tests._lowering import lower_for_cuda, triton_kernel_count

    q = jnp.zeros((1, 5, 32, 512), jnp.bfloat16)
    cache = jnp.zeros((1, 4, 32768, 512), jnp.bfloat16)
    text = lower_for_cuda(lambda *args: decode_attention_wide(*args, q_positions=32760 + jnp.arange(5)[None],
                                                              interpret=False),
                          q, cache, cache, jnp.array([32765]))
    assert triton_kernel_count(text) == 1
