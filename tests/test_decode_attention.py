"""Decode / frozen-KV attention: the Pallas kernel (interpret mode on CPU) against the jnp reference.

Every case poisons the cache rows past each sequence's length with NaN (a kernel that reads
them without masking leaks NaN into the output); the interpreter itself fills the kernel's
output buffers with NaN before the call, so an element the kernel forgets to write shows up too.
"""

from __future__ import annotations

import functools
import importlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention, decode_attention_reference
from pallas_kernels.dispatch import warm_up_interpret
from pallas_kernels.attention.decode_attention import decode_attention_pallas, visibility_mask


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    warm_up_interpret()


def _tree_mask(rng, batch, num_q):
    """Random trees over the tail rows: node c's parent is an earlier node; mask = ancestor-or-self."""
    masks, depths = [], []
    for _ in range(batch):
        parent = [-1] + [int(rng.integers(0, c)) for c in range(1, num_q)]
        anc = np.eye(num_q, dtype=bool)
        depth = np.zeros(num_q, np.int32)
        for c in range(1, num_q):
            anc[c] = anc[parent[c]]
            anc[c, c] = True
            depth[c] = depth[parent[c]] + 1
        masks.append(anc)
        depths.append(depth)
    return np.stack(masks), np.stack(depths)


def make_case(
    seed, *, batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, tree=False, lengths=None, poison=np.nan,
    same_kv=False,
):
    """Random inputs, rows past each length poisoned; ``same_kv``: one buffer as K and V (k_eq_v)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, num_q, num_q_heads, head_dim))
    k = rng.standard_normal((batch, num_kv_heads, max_len, head_dim))
    v = k if same_kv else rng.standard_normal((batch, num_kv_heads, max_len, head_dim))
    if lengths is None:
        lengths = rng.integers(num_q, max_len + 1, size=batch)
        lengths[0] = max_len
        if batch > 1:
            lengths[-1] = max(num_q, 1)
    lengths = np.asarray(lengths)
    for b in range(batch):
        k[b, :, lengths[b] :] = poison
        v[b, :, lengths[b] :] = poison  # (the same rows again when v is k)
    tail_mask = None
    if tree:
        tail_mask, depth = _tree_mask(rng, batch, num_q)
        positions = lengths[:, None] - num_q + depth
    else:
        positions = lengths[:, None] - num_q + np.arange(num_q)[None, :]
    return dict(
        q=jnp.asarray(q, dtype),
        k=jnp.asarray(k, dtype),
        v=jnp.asarray(v, dtype),
        kv_lengths=jnp.asarray(lengths, jnp.int32),
        q_positions=jnp.asarray(positions, jnp.int32),
        tail_mask=None if tail_mask is None else jnp.asarray(tail_mask),
    )


@functools.partial(jax.jit, static_argnames=("window", "scale", "impl"))
def _run(q, k, v, kv_lengths, q_positions, tail_mask, *, window=None, scale=None, impl="pallas"):
    return decode_attention(
        q, k, v, kv_lengths, q_positions=q_positions, tail_mask=tail_mask, window=window, scale=scale, impl=impl
    )


def _tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)


def _check(case, dtype, **kw):
    args = (case["q"], case["k"], case["v"], case["kv_lengths"], case["q_positions"], case["tail_mask"])
    out = _run(*args, impl="pallas", **kw)
    ref = _run(*args, impl="xla", **kw)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN leaked into the kernel output"
    assert np.isfinite(np.asarray(ref, np.float32)).all(), "NaN leaked into the reference output"
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **_tol(dtype))
    return out


CASES = {
    # name: (case kwargs, call kwargs)
    "decode_d64_gqa4_f32": (
        dict(batch=3, num_q=1, num_q_heads=8, num_kv_heads=2, max_len=200, head_dim=64, dtype=jnp.float32), {}
    ),
    "decode_64_sequence_heads_block_k_32_bf16": (  # batch x KV heads >= 64: the block_k 32 tiling
        dict(batch=4, num_q=1, num_q_heads=64, num_kv_heads=16, max_len=150, head_dim=128, dtype=jnp.bfloat16), {}
    ),
    "verify_d128_gqa8_bf16": (
        dict(batch=2, num_q=5, num_q_heads=8, num_kv_heads=1, max_len=333, head_dim=128, dtype=jnp.bfloat16), {}
    ),
    "window_scale_d256_mha_f32": (
        dict(batch=1, num_q=3, num_q_heads=2, num_kv_heads=2, max_len=160, head_dim=256, dtype=jnp.float32),
        dict(window=50, scale=0.1),
    ),
    "tree_window_d64_gqa4_bf16": (
        dict(batch=4, num_q=6, num_q_heads=8, num_kv_heads=2, max_len=100, head_dim=64, dtype=jnp.bfloat16, tree=True),
        dict(window=40),
    ),
    "tree_33_nodes_two_words_f32": (
        dict(batch=2, num_q=33, num_q_heads=2, num_kv_heads=2, max_len=80, head_dim=64, dtype=jnp.float32, tree=True),
        {},
    ),
    "prefill_many_m_blocks_f32": (
        dict(batch=2, num_q=40, num_q_heads=4, num_kv_heads=1, max_len=96, head_dim=64, dtype=jnp.float32),
        dict(window=24),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    case_kw, call_kw = CASES[name]
    case = make_case(zlib.crc32(name.encode()) % 1000, **case_kw)
    _check(case, case_kw["dtype"], **call_kw)


def test_lengths_one_and_max_and_frozen_kv_invariance():
    """Length 1 and max_len in one batch; changing rows past the lengths changes nothing."""
    kw = dict(batch=2, num_q=1, num_q_heads=4, num_kv_heads=1, max_len=130, head_dim=64, dtype=jnp.float32)
    a = make_case(7, lengths=[1, 130], **kw)
    b = make_case(7, lengths=[1, 130], poison=1e4, **kw)
    out_a = _check(a, jnp.float32)
    args = (b["q"], b["k"], b["v"], b["kv_lengths"], b["q_positions"], b["tail_mask"])
    np.testing.assert_array_equal(np.asarray(_run(*args, impl="pallas")), np.asarray(out_a))
    # Length 1: the only visible row is row 0, so the output is v[:, :, 0] exactly.
    np.testing.assert_allclose(np.asarray(out_a[0, 0]), np.asarray(jnp.repeat(a["v"][0, :, 0], 4, axis=0)), rtol=1e-6)


@pytest.mark.parametrize("k_splits", [8, 3, 2, 1])
def test_every_output_written_and_blind_queries_zero(k_splits):
    """Every output element is written (the interpreter NaN-fills outputs before the call), by a
    sequence's only program or by the merge of its split programs: a query that sees no row and a
    sequence with no rows at all give exactly 0."""
    case = make_case(3, batch=3, num_q=2, num_q_heads=4, num_kv_heads=2, max_len=64, head_dim=64, dtype=jnp.float32,
                     lengths=[64, 37, 0])
    q_positions = case["q_positions"].at[1, 0].set(-1)  # sees nothing
    args = (case["q"], case["k"], case["v"], case["kv_lengths"])
    out = jax.jit(functools.partial(decode_attention_pallas, block_k=16, k_splits=k_splits))(
        *args, q_positions=q_positions
    )
    ref = decode_attention_reference(*args, q_positions=q_positions)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[1, 0]), 0.0)
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_split_kernel_with_tree_and_window():
    """The multi-split path (log-sum-exp merge) with the tree mask, a window and two M blocks."""
    kw = dict(batch=2, num_q=6, num_q_heads=12, num_kv_heads=1, max_len=150, head_dim=64, dtype=jnp.float32, tree=True)
    case = make_case(11, **kw)
    args = (case["q"], case["k"], case["v"], case["kv_lengths"])
    fn = jax.jit(functools.partial(decode_attention_pallas, window=60, block_m=64, block_k=16, k_splits=4))
    out = fn(*args, q_positions=case["q_positions"], tail_mask=case["tail_mask"])
    ref = decode_attention_reference(*args, q_positions=case["q_positions"], tail_mask=case["tail_mask"], window=60)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def test_visibility_rule_tail_mask():
    """Tail rows follow the tree mask (not j <= p); earlier rows follow the causal + window rule."""
    lengths = jnp.array([6])
    positions = jnp.array([[4, 4, 5]])  # two siblings at depth 1, one child at depth 2
    tail = jnp.array([[[1, 0, 0], [0, 1, 0], [1, 0, 1]]], bool)
    vis = np.asarray(visibility_mask(lengths, positions, 8, tail_mask=tail, window=3))
    expected = np.array(
        [
            [0, 0, 1, 1, 0, 0, 0, 0],  # p=4, window 3: row 2 only before the tail; tail [1, 0, 0]
            [0, 0, 1, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 1, 0, 0],  # p=5: row 2 out of the window; tail col 0 (p=4) and itself
        ],
        bool,
    )
    np.testing.assert_array_equal(vis[0], expected)


def test_auto_is_reference_on_cpu():
    case = make_case(5, batch=1, num_q=1, num_q_heads=2, num_kv_heads=1, max_len=32, head_dim=64, dtype=jnp.float32)
    args = (case["q"], case["k"], case["v"], case["kv_lengths"])
    out = decode_attention(*args, q_positions=case["q_positions"])
    ref = decode_attention_reference(*args, q_positions=case["q_positions"])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    with pytest.raises(ValueError):
        decode_attention(*args, q_positions=case["q_positions"], impl="triton")


def test_auto_rule_on_gpu():
    from pallas_kernels.attention.decode_attention import use_pallas

    bf = jnp.bfloat16
    assert use_pallas(1, 1, 32, 8, 131072, 128, bf)
    assert use_pallas(8, 5, 32, 8, 4096, 128, bf)
    # tiny caches too: one launch per layer beats the reference's several inside the model
    assert use_pallas(1, 1, 32, 8, 640, 128, bf) and use_pallas(1, 5, 32, 8, 640, 128, bf)  # 8B at context 512
    assert use_pallas(1, 1, 9, 3, 192, 64, bf) and use_pallas(1, 5, 9, 3, 192, 64, bf)  # SmolLM2-135M, context 128
    assert use_pallas(1, 1, 8, 2, 640, 256, bf) and use_pallas(1, 5, 8, 2, 640, 512, bf)  # Gemma 4 E4B, context 512
    assert not use_pallas(1, 1, 32, 8, 131072, 128, jnp.float32)
    # Gemma 4: head_dim 256 / 512 drafting and verifying, up to 4 M blocks of 16 rows at head_dim 512
    assert use_pallas(1, 1, 32, 4, 32768, 512, bf) and use_pallas(8, 5, 32, 4, 4096, 512, bf)
    assert use_pallas(8, 9, 8, 2, 32768, 512, bf) and use_pallas(32, 9, 32, 16, 32768, 256, bf)
    assert not use_pallas(8, 9, 32, 4, 32768, 512, bf)  # 31B, 9 rows x GQA 8 = 5 M blocks: not Triton ...


def test_auto_gives_past_64_wide_rows_to_the_wide_kernel_not_the_reference(monkeypatch):
    """... but the wide-head kernel's 64-row M tiles (31B verifying 8 drafts: 72 rows), unless a
    window or a tree mask keeps them on the reference; 40 rows go to the N-axis kernel."""
    da = importlib.import_module("pallas_kernels.attention.decode_attention")  # the package re-exports the function
    monkeypatch.setattr(da, "on_gpu", lambda: True)
    taken = []
    monkeypatch.setattr(da, "decode_attention_wide", lambda *a, **kw: taken.append("wide"))
    monkeypatch.setattr(da, "decode_attention_swapped", lambda *a, **kw: taken.append("swapped"))
    monkeypatch.setattr(da, "decode_attention_reference", lambda *a, **kw: taken.append("reference"))
    batch, num_q, max_len = 1, 9, 4096
    q = jax.ShapeDtypeStruct((batch, num_q, 32, 512), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((batch, 4, max_len, 512), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    positions = jax.ShapeDtypeStruct((batch, num_q), jnp.int32)
    da.decode_attention(q, kv, kv, lengths, q_positions=positions)
    da.decode_attention(q, kv, kv, lengths, q_positions=positions, window=1024)
    five = jax.ShapeDtypeStruct((batch, 5, 32, 512), jnp.bfloat16)  # 40 rows
    da.decode_attention(five, kv, kv, lengths, q_positions=jax.ShapeDtypeStruct((batch, 5), jnp.int32))
    assert taken == ["wide", "reference", "swapped"]


def test_wide_heads_up_to_40_rows_go_to_the_n_axis_kernel():
    """head_dim 512 without window or tree mask, up to 40 query rows x GQA group and from 8k
    (sequence x KV head x cache row) triples: the kernel with the rows on WGMMA's N axis; 72 rows
    the M-axis kernel; a window, a tree mask or a small cache the Triton kernel / the reference."""
    from pallas_kernels.attention.decode_attention import wide_head_kernel

    bf = jnp.bfloat16
    assert wide_head_kernel(1, 1, 32, 4, 4096, 512, bf) == "swapped"  # 31B decode: 8 rows
    assert wide_head_kernel(8, 5, 32, 4, 32768, 512, bf) == "swapped"  # 31B verifying 4 drafts: 40
    assert wide_head_kernel(1, 9, 8, 2, 4096, 512, bf) == "swapped"  # E4B verifying 8 drafts: 36
    assert wide_head_kernel(1, 9, 32, 4, 4096, 512, bf) == "wide"  # 72 rows
    assert wide_head_kernel(1, 5, 32, 4, 4096, 512, bf, window=1024) is None
    assert wide_head_kernel(1, 5, 32, 4, 4096, 512, bf, tail_mask=jnp.ones((1, 5, 5), bool)) is None
    assert wide_head_kernel(1, 1, 8, 2, 2048, 512, bf) is None  # 4096 triples
    assert wide_head_kernel(1, 1, 32, 16, 4096, 256, bf) is None  # sliding layers' head_dim


def test_one_row_tiling_keeps_the_cache_streaming():
    """One query row (GQA 4, Llama-3.1-8B heads): ~16k cache rows in flight over the GPU, on as few
    programs as that takes (the H100 sweeps in benchmarks/decode_attention_tiling_h100.json)."""
    from pallas_kernels.attention.decode_tiling import _ROWS_IN_FLIGHT, tiling

    expected = {1: (32, 32), 8: (64, 2), 16: (64, 1), 32: (32, 1)}  # batch: (block_k, k_splits)
    for batch, (block_k, k_splits) in expected.items():
        cfg = tiling(batch, 1, 32, 8, 16384, 128)
        assert (cfg["block_k"], cfg["k_splits"], cfg["num_stages"]) == (block_k, k_splits, 3), batch
        in_flight = batch * 8 * cfg["k_splits"] * cfg["block_k"] * (cfg["num_stages"] - 1)
        assert _ROWS_IN_FLIGHT <= in_flight <= 2 * _ROWS_IN_FLIGHT, batch
    assert tiling(1, 1, 32, 8, 2048, 128)["k_splits"] == 16  # at least 4 blocks per split


def test_a_short_cache_is_read_one_block_per_program():
    """When every (sequence, KV head) pair's cache fits one wave of 64-row blocks (132 programs),
    each program reads one block: small models' decode is bound by latency there (H100:
    benchmarks/decode_attention_small_h100.json). Longer caches and wide heads keep the rule."""
    from pallas_kernels.attention.decode_tiling import tiling

    for heads, context, splits in (((9, 3, 64), 512, 8), ((9, 3, 64), 2048, 32), ((32, 8, 64), 1024, 16)):
        for num_q in (1, 5) if heads[1] == 3 else (1,):  # SmolLM2's 5 rows x GQA 3 still fit a 16-row block
            cfg = tiling(1, num_q, *heads[:2], context, heads[2])
            assert (cfg["block_k"], cfg["k_splits"]) == (64, splits), (heads, context, num_q)
    assert tiling(1, 1, 9, 3, 4096, 64)["block_k"] == 32  # 192 blocks: past one wave
    assert tiling(2, 1, 32, 8, 1024, 64)["block_k"] == 32  # 256 blocks over the batch
    assert tiling(1, 1, 8, 2, 512, 256)["block_k"] == 32  # head_dim 256 keeps its own rule


def test_gemma4_tiling_is_a_function_of_head_dim_and_window():
    """head_dim >= 256: 16-row M blocks whatever the rows x group (larger blocks spill registers);
    head_dim 512: block_k 32 with 2 stages; a window sizes the splits for the rows it lets the
    queries see, not for the cache length."""
    from pallas_kernels.attention.decode_tiling import tiling

    for num_q, expected in ((1, (16, 32, 2, 4)), (5, (64, 16, 3, 8)), (9, (16, 32, 2, 4))):
        full = tiling(1, num_q, 32, 4, 32768, 512)  # 31B full layers: 8, 40, 72 M rows
        assert (full["block_m"], full["block_k"], full["num_stages"], full["num_warps"]) == expected
    assert tiling(8, 9, 8, 2, 32768, 512)["block_m"] == 64  # E4B, 9 rows: 36 M rows in one block
    assert tiling(8, 5, 8, 2, 32768, 512)["block_m"] == 16  # E4B, 5 rows: two 16-row blocks
    for num_q in (1, 5, 9):
        assert tiling(8, num_q, 32, 16, 32768, 256, window=1024)["block_m"] == 16
    assert tiling(1, 1, 32, 16, 131072, 256, window=1024) == tiling(1, 1, 32, 16, 4096, 256, window=1024)
    # E4B sliding layers at batch 1: 16 blocks of 32 rows in the window, one split each (64 without it)
    assert tiling(1, 1, 8, 2, 131072, 256)["k_splits"] == 64
    assert tiling(1, 1, 8, 2, 131072, 256, window=512)["k_splits"] == 16
    assert tiling(1, 9, 32, 8, 4096, 128)["block_m"] == 64  # head_dim 128 keeps the larger blocks
    assert tiling(1, 5, 32, 4, 4096, 512, block_m=64, num_warps=8)["block_m"] == 64  # given knobs are kept


GEMMA4_CASES = {
    # name: (case kwargs, call kwargs); heads scaled down, GQA groups and head_dims as in Gemma 4
    "full_d512_gqa8_1row_k_eq_v": (dict(batch=3, num_q=1, num_q_heads=8, num_kv_heads=1, max_len=90, head_dim=512,
                                        same_kv=True), {}),
    "full_d512_gqa8_9rows_k_eq_v": (dict(batch=2, num_q=9, num_q_heads=8, num_kv_heads=1, max_len=70, head_dim=512,
                                         same_kv=True), {}),
    "full_d512_gqa4_5rows_split": (dict(batch=3, num_q=5, num_q_heads=8, num_kv_heads=2, max_len=120, head_dim=512),
                                   dict(k_splits=3)),
    "full_d512_gqa8_5rows_one_64_row_block_split": (  # 40 rows: one 64-row M block, block_k 16
        dict(batch=3, num_q=5, num_q_heads=8, num_kv_heads=1, max_len=120, head_dim=512), dict(k_splits=2)),
    "sliding_d256_gqa2_9rows_window": (dict(batch=3, num_q=9, num_q_heads=4, num_kv_heads=2, max_len=150, head_dim=256),
                                       dict(window=40, scale=1.0)),
    "sliding_d256_gqa4_2rows_window_split": (dict(batch=2, num_q=2, num_q_heads=4, num_kv_heads=1, max_len=200,
                                                  head_dim=256), dict(window=48, k_splits=4)),
}


@pytest.mark.parametrize("name", list(GEMMA4_CASES))
def test_gemma4_shapes_match_reference(name):
    """Gemma 4's attention shapes (head_dim 512 full / 256 sliding layers, GQA 2..8, 1..9 query rows,
    one buffer as K and V, windows, split programs) against the reference: ragged lengths, NaN
    past them, every output written."""
    case_kw, call_kw = GEMMA4_CASES[name]
    case = make_case(zlib.crc32(name.encode()) % 1000, dtype=jnp.float32, **case_kw)
    args = (case["q"], case["k"], case["v"], case["kv_lengths"])
    out = jax.jit(functools.partial(decode_attention_pallas, **call_kw))(*args, q_positions=case["q_positions"])
    rule = {name: call_kw[name] for name in ("window", "scale") if name in call_kw}  # the rest is tiling
    ref = decode_attention_reference(*args, q_positions=case["q_positions"], **rule)
    assert np.isfinite(np.asarray(out)).all(), "NaN leaked into the kernel output"
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("rows", [1, 5, 16, 128])
def test_default_tiling_fits_shared_memory(head_dim, rows):
    from pallas_kernels.attention.decode_tiling import _SMEM_BUDGET, _default_config, _smem_bytes

    block_m = max(16, min(1 << (rows * 8 - 1).bit_length(), 64))
    cfg = _default_config(1, 4, 1, 8192, head_dim, block_m)
    assert _smem_bytes(block_m, cfg["block_k"], head_dim, cfg["num_stages"]) <= _SMEM_BUDGET
    assert cfg["num_stages"] >= 1


@pytest.mark.parametrize(
    "lengths, k_splits, window",
    [
        ([300, 2, 17, 1], 3, None),  # one long sequence takes most of the 12 split programs
        ([300, 300, 300], 4, None),  # uniform: 4 splits each, as a static split would give
        ([1, 1, 300, 64], 2, 40),  # a window: only the last 40 rows of each sequence are shared out
        ([144, 16, 16, 16], 1, None),  # 4 programs of 3 blocks: the last reads three whole sequences
        ([0, 300, 0, 0, 37], 2, None),  # chunks cross sequence boundaries; empty sequences get zeros
    ],
)
@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_work_split_over_a_ragged_batch(lengths, k_splits, window, merge_in_kernel):
    """The batch's KV blocks are shared out by length; every sequence's output is still exact,
    whether the last program to arrive merges a sequence's partials or a second kernel does."""
    case = make_case(
        13, batch=len(lengths), num_q=1, num_q_heads=4, num_kv_heads=2, max_len=300, head_dim=64,
        dtype=jnp.float32, lengths=lengths,
    )
    args = (case["q"], case["k"], case["v"], case["kv_lengths"])
    fn = jax.jit(functools.partial(decode_attention_pallas, window=window, block_k=16, k_splits=k_splits,
                                   merge_in_kernel=merge_in_kernel))
    out = fn(*args, q_positions=case["q_positions"])
    ref = decode_attention_reference(*args, q_positions=case["q_positions"], window=window)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)
