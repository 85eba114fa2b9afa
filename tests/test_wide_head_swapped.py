"""The wide-head kernel with the query rows on WGMMA's N axis against the jnp reference: in the
Mosaic GPU interpreter on CPU, compiled on a GPU. Cache rows past each length hold NaN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention.wide_head_swapped import (decode_attention_swapped, default_row_groups, default_splits, group_rows,
                                              supports)
from tests.test_wide_head_decode import _case, check_against_the_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu" and jax.__version_info__ < (0, 12),
                                reason="the Mosaic GPU interpreter needs jax >= 0.12")

CASES = [  # (name, shapes, kernel kwargs)
    # 72 rows (Gemma 4 31B verifying 8 drafts, GQA 8): two row groups of 5 queries (the second's
    # fifth a copy of the fourth), q copied per query; ragged, splits
    ("nine_queries_group_eight", dict(batch=2, num_q=9, num_q_heads=16, num_kv_heads=2, max_len=256, head_dim=512,
                                      lengths=[250, 40]), dict(k_splits=2)),
    # The same rows in one N of 72, no split
    ("nine_queries_one_row_group", dict(batch=2, num_q=9, num_q_heads=16, num_kv_heads=2, max_len=128,
                                        head_dim=512, lengths=[128, 70]), dict(k_splits=1, row_groups=1)),
    # E4B's full layers verifying 4 drafts (20 rows, GQA 4): q transposed and padded by XLA; splits
    ("e4b_five_queries", dict(batch=3, num_q=5, num_q_heads=8, num_kv_heads=2, max_len=320, head_dim=512,
                              lengths=[320, 70, 129]), dict(k_splits=3)),
    # ... in three row groups of 8 (XLA pads the rows to 24): no split
    ("e4b_three_row_groups", dict(batch=2, num_q=5, num_q_heads=8, num_kv_heads=2, max_len=128, head_dim=512,
                                  lengths=[128, 65]), dict(k_splits=1, row_groups=3)),
    # GQA 4 at head_dim 256: one CTA a head (no second column chunk); no split
    ("group_four_one_consumer", dict(batch=2, num_q=5, num_q_heads=8, num_kv_heads=2, max_len=192, head_dim=256,
                                     lengths=[192, 3]), dict(k_splits=1)),
    # Frozen-KV drafting: queries at one position before the cache's end; a padding query (-1) sees nothing
    ("drafts_at_one_position", dict(batch=2, num_q=3, num_q_heads=8, num_kv_heads=1, max_len=256, head_dim=512,
                                    lengths=[200, 64], positions=[[150, 150, -1], [63, 63, 63]]),
     dict(k_splits=3, slots=4)),
]


@pytest.mark.parametrize("name, shapes, kernel_kw", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_the_reference(name, shapes, kernel_kw):
    check_against_the_reference(decode_attention_swapped, name, shapes, kernel_kw)


def test_shapes_it_cannot_run_are_refused():
    assert group_rows(9, 32, 4, 1) == 72 and group_rows(9, 32, 4, 2) == 40 and group_rows(5, 8, 2, 1) == 24
    assert [default_row_groups(q, 32, 4) for q in (1, 5, 9, 33)] == [1, 1, 2, 7]  # whole queries of 8 rows
    assert [default_row_groups(q, 8, 2) for q in (1, 5, 9, 16)] == [1, 1, 1, 2]
    assert supports(9, 32, 4, 4096, 512, jnp.bfloat16) and supports(33, 64, 8, 4096, 512, jnp.bfloat16)
    assert not supports(9, 32, 4, 4096, 128, jnp.bfloat16)  # head_dim not a multiple of 256
    assert not supports(9, 32, 4, 4000, 512, jnp.bfloat16)  # max_len not a multiple of 64
    q, k, v, lengths, positions = _case(0, batch=1, num_q=1, num_q_heads=8, num_kv_heads=1, max_len=100,
                                        head_dim=256, lengths=[50])
    with pytest.raises(ValueError, match="max_len a multiple of 64"):
        decode_attention_swapped(q, k, v, lengths, q_positions=positions)
    q, k, v, lengths, positions = _case(0, batch=1, num_q=3, num_q_heads=8, num_kv_heads=1, max_len=128,
                                        head_dim=256, lengths=[50])
    with pytest.raises(ValueError, match="row_groups=4"):  # 3 queries of 8 rows: a fourth group has none
        decode_attention_swapped(q, k, v, lengths, q_positions=positions, row_groups=4)
    assert default_splits(1, 4, 32768) == 33 and default_splits(32, 4, 32768) == 1


def test_lowers_for_cuda_at_31b_full_layers():
    """The ring and q fit one CTA's 227 KiB beside p, which the interpreter does not check; the two
    column chunks' CTAs lower as a cluster."""
    from tests._lowering import lower_for_cuda

    q = jnp.zeros((1, 9, 32, 512), jnp.bfloat16)
    cache = jnp.zeros((1, 4, 32768, 512), jnp.bfloat16)
    text = lower_for_cuda(lambda *args: decode_attention_swapped(*args, q_positions=32760 + jnp.arange(9)[None],
                                                                 interpret=False),
                          q, cache, cache, jnp.array([32769]))
    assert "mosaic_gpu" in text
