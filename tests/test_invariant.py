"""``impl="invariant"``: a row's result is bitwise the same whatever is computed with it (other
rows, other sequences, the cache's capacity), so speculative greedy output equals plain greedy
output bitwise in bf16. Kernels in interpret mode on CPU; the tiny target's weights are small so
that its logits nearly tie and a rounding difference would change a token."""

from __future__ import annotations

import importlib
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import forward, with_kernels
from jspec.drafters import MTP, DraftModel, Eagle3, FrozenKVMTP, NGram, assistant_config, init_assistant, init_mtp_head
from jspec.models.gemma4 import FULL, SLIDING
from pallas_kernels.attention.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.attention.invariant_attention import decode_attention_invariant
from pallas_kernels.matmul.skinny_matmul import invariant_config, skinny_matmul, skinny_matmul_pallas, skinny_matmul_reference
from tests._lowering import lower_for_cuda, triton_kernel_count
from tests.tiny import TINY, TINY_GEMMA4, dflash, eagle3_head

INVARIANT = "invariant"
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]]  # ragged


def _bf16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, tree)


@pytest.fixture(scope="module")
def target():
    # With weights this small, bf16 rounding differences between the default paths' decode and
    # verify calls change greedy tokens (checked when this test was written, jax 0.12 on CPU).
    return jspec.init_params(TINY, jax.random.key(0), jnp.bfloat16, scale=0.05)


@pytest.mark.parametrize("w_transposed", [False, True], ids=["w_kn", "w_nk"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k, n", [(200, 150), (64, 97), (1024, 64)])
def test_matmul_rows_do_not_depend_on_the_rows_beside_them(dtype, k, n, w_transposed):
    """Also with split-K (1024 x 64: the one-row tiling splits K in 4 (bf16) / 8 (fp32)), for a
    weight stored [N, K] (a tied LM head reading the embedding table as stored), and for row tiles
    that share a program (150 rows: three 64-row tiles)."""
    assert (invariant_config(k, n, jnp.dtype(dtype).itemsize, w_transposed=w_transposed).split_k > 1) == (k == 1024)
    x = jax.random.normal(jax.random.key(0), (150, k), dtype)
    w = jax.random.normal(jax.random.key(1), (k, n), dtype)
    stored = w.T if w_transposed else w
    matmul = lambda x: np.asarray(skinny_matmul(x, stored, impl=INVARIANT, w_transposed=w_transposed))  # noqa: E731
    every_row = matmul(x)
    np.testing.assert_allclose(every_row.astype(np.float32), np.asarray(skinny_matmul_reference(x, w), np.float32),
                               rtol=2e-2, atol=2e-2)
    # decode, verify, batch x rows, any M; past 64 rows several row tiles share a program
    for start, rows in [(0, 1), (5, 1), (3, 5), (10, 20), (36, 1), (70, 80), (149, 1)]:
        np.testing.assert_array_equal(matmul(x[start:start + rows]), every_row[start:start + rows])


def _attention_case(*, batch=2, num_q=3, num_q_heads=4, num_kv_heads=2, max_len=256, head_dim=32):
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (batch, num_q, num_q_heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (batch, num_kv_heads, max_len, head_dim), jnp.bfloat16) for key in keys[1:])
    lengths = jnp.array([200, 70][:batch])
    past = jnp.arange(max_len)[None, None, :, None] >= lengths[:, None, None, None]
    k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)  # rows past the length hold NaN
    positions = lengths[:, None] - num_q + jnp.arange(num_q)[None]
    return q, k, v, lengths, positions


@pytest.mark.parametrize("window", [None, 40])
def test_attention_rows_do_not_depend_on_rows_batch_or_capacity(window):
    q, k, v, lengths, positions = _attention_case()
    attend = lambda q, k, v, lengths, positions: np.asarray(decode_attention_invariant(  # noqa: E731
        q, k, v, lengths, q_positions=positions, window=window, split_rows=64))  # 4 splits at fixed positions
    every_row = attend(q, k, v, lengths, positions)
    reference = decode_attention_reference(q, k, v, lengths, q_positions=positions, window=window)
    np.testing.assert_allclose(every_row.astype(np.float32), np.asarray(reference, np.float32), atol=1e-2)
    np.testing.assert_array_equal(attend(q[:, -1:], k, v, lengths, positions[:, -1:]), every_row[:, -1:])  # alone
    np.testing.assert_array_equal(attend(q[1:], k[1:], v[1:], lengths[1:], positions[1:]), every_row[1:])  # batch
    wider = [jnp.pad(x, ((0, 0), (0, 0), (0, 192), (0, 0)), constant_values=jnp.nan) for x in (k, v)]
    np.testing.assert_array_equal(attend(q, *wider, lengths, positions), every_row)  # 7 splits, the same sums


def test_attention_query_that_sees_nothing_gets_zeros():
    q, k, v, lengths, _ = _attention_case(batch=1, num_q=2)
    out = decode_attention_invariant(q, k, v, lengths, q_positions=jnp.array([[-1, 5]]))
    np.testing.assert_array_equal(np.asarray(out[0, 0], np.float32), 0.0)


def _tree_case(num_q=6, **kw):
    """A random tree over the last ``num_q`` cache rows: node i's parent is some earlier node, it
    sees its ancestors and itself, and sits at position base + its depth."""
    q, k, v, lengths, _ = _attention_case(num_q=num_q, **kw)
    rng = np.random.default_rng(0)
    batch = q.shape[0]
    mask = np.zeros((batch, num_q, num_q), bool)
    depth = np.zeros((batch, num_q), np.int32)
    for b in range(batch):
        for i in range(num_q):
            parent = rng.integers(0, i) if i else -1
            mask[b, i] = mask[b, parent] if i else False
            mask[b, i, i] = True
            depth[b, i] = depth[b, parent] + 1 if i else 0
    positions = jnp.asarray(lengths[:, None] - num_q + depth)
    return q, k, v, lengths, positions, jnp.asarray(mask)


@pytest.mark.parametrize("window", [None, 40])
def test_tree_attention_matches_the_reference_and_rows_do_not_depend_on_the_batch_or_capacity(window):
    q, k, v, lengths, positions, mask = _tree_case()
    attend = lambda q, k, v, lengths, positions, mask: np.asarray(decode_attention(  # noqa: E731
        q, k, v, lengths, q_positions=positions, tail_mask=mask, window=window, impl=INVARIANT))
    every_row = attend(q, k, v, lengths, positions, mask)
    reference = decode_attention_reference(q, k, v, lengths, q_positions=positions, tail_mask=mask, window=window)
    np.testing.assert_allclose(every_row.astype(np.float32), np.asarray(reference, np.float32), atol=1e-2)
    np.testing.assert_array_equal(attend(q[1:], k[1:], v[1:], lengths[1:], positions[1:], mask[1:]), every_row[1:])
    wider = [jnp.pad(x, ((0, 0), (0, 0), (0, 192), (0, 0)), constant_values=jnp.nan) for x in (k, v)]
    np.testing.assert_array_equal(attend(q, *wider, lengths, positions, mask), every_row)


def _pairwise_dot(a, b, dtype):
    """a @ b in fp32 whose products are added in pairs, then pairs of pairs (as a tensor core groups
    them), not one after another as XLA:CPU adds them, where a zero product anywhere changes nothing."""
    terms = a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :]  # [m, k, n]
    while terms.shape[1] > 1:
        terms = terms[:, 0::2] + terms[:, 1::2]
    return terms[:, 0]


@pytest.fixture
def pairwise_dots(monkeypatch):
    monkeypatch.setattr(importlib.import_module("pallas_kernels.attention.invariant_attention"), "_dot", _pairwise_dot)
    jax.clear_caches()  # no program traced with the other dot
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("window", [None, 40])
def test_a_tree_node_attends_bitwise_as_its_chain_would(window, pairwise_dots):
    """Node i's output equals the last row of a chain verify over its path (its ancestors and
    itself written one after another after the prefix, as plain decoding caches them), and the
    chain rows of the path equal the tree rows of the same nodes. Lengths 200 / 70 put the tail
    across a block and (batch 0) right before a split boundary. With pairwise-added dots: reading
    the ancestors in their tree slots (masking the rest) adds the same products in other pairs."""
    q, k, v, lengths, positions, mask = _tree_case(num_q=9)
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))  # outputs in fp32: bf16 would round a last-bit change away
    attend = lambda q, k, v, lengths, positions, mask=None: np.asarray(decode_attention(  # noqa: E731
        q, k, v, lengths, q_positions=positions, tail_mask=mask, window=window, impl=INVARIANT))
    tree = attend(q, k, v, lengths, positions, mask)
    num_q = mask.shape[-1]
    for b in range(q.shape[0]):
        tail_start = int(lengths[b]) - num_q
        for i in range(num_q):
            path = np.flatnonzero(np.asarray(mask[b, i]))  # ancestors and itself, in depth order
            rows = np.r_[np.arange(tail_start), tail_start + path]
            chain_k, chain_v = (x[b:b + 1, :, rows] for x in (k, v))
            chain_positions = jnp.asarray(tail_start + np.arange(len(path)))[None]
            chain = attend(q[b:b + 1, path], chain_k, chain_v, jnp.array([len(rows)]), chain_positions)
            np.testing.assert_array_equal(chain[0], tree[b, path])


@pytest.mark.parametrize("max_len, head_dim, num_q, window", [
    (4096, 128, 5, None),  # Llama 8B verify
    (4000, 80, 3, None),  # a cache of whole blocks but no power of two, head_dim padded
    (131072, 512, 9, None),  # Gemma 4 31B full layers
    (32768, 256, 1, 1024),  # Gemma 4 sliding layers
])
def test_invariant_kernels_lower_for_cuda(max_len, head_dim, num_q, window):
    def attend(q, k, v, lengths, positions):
        return decode_attention_invariant(q, k, v, lengths, q_positions=positions, window=window, interpret=False)

    s = jax.ShapeDtypeStruct
    cache = s((2, 8, max_len, head_dim), jnp.bfloat16)
    text = lower_for_cuda(attend, s((2, num_q, 32, head_dim), jnp.bfloat16), cache, cache, s((2,), jnp.int32),
                          s((2, num_q), jnp.int32))
    assert triton_kernel_count(text) == 2  # the splits, then their merge
    tree = lambda q, k, v, lengths, positions, mask: decode_attention_invariant(  # noqa: E731
        q, k, v, lengths, q_positions=positions, tail_mask=mask, window=window, interpret=False)
    text = lower_for_cuda(tree, s((2, num_q, 32, head_dim), jnp.bfloat16), cache, cache, s((2,), jnp.int32),
                          s((2, num_q), jnp.int32), s((2, num_q, num_q), jnp.bool_))
    assert triton_kernel_count(text) == 2
    text = lower_for_cuda(lambda x, w: skinny_matmul_pallas(x, w, config=invariant_config(4096, 6144), interpret=False),
                          s((100, 4096), jnp.bfloat16), s((4096, 6144), jnp.bfloat16))
    assert triton_kernel_count(text) == 1
    tied_head = lambda x, embed: skinny_matmul_pallas(  # noqa: E731
        x, embed, config=invariant_config(2048, 128256, w_transposed=True), interpret=False, w_transposed=True)
    text = lower_for_cuda(tied_head, s((5, 2048), jnp.bfloat16), s((128256, 2048), jnp.bfloat16))
    assert triton_kernel_count(text) == 1 and "transpose" not in text.split("tt.func")[0]  # no copy of the table


def test_a_rows_logits_are_the_same_alone_among_verify_rows_and_in_a_batch(target):
    step = jax.jit(forward)
    target = with_kernels(target, INVARIANT)
    tokens = jax.random.randint(jax.random.key(1), (3, 12), 0, TINY.vocab_size)
    batch_prefill, _, _ = step(target, tokens, target.init_cache(3, 128))
    for b, n in enumerate([12, 7, 9]):  # each prompt alone, in a cache of another capacity
        alone, _, _ = step(target, tokens[b:b + 1, :n], target.init_cache(1, 256))
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batch_prefill[b, :n]))
    _, _, cache = step(target, tokens[:, :8], target.init_cache(3, 128))
    verify, _, _ = step(target, tokens[:, 8:12], cache)  # 4 verify rows
    for i in range(4):  # one decode row at a time, logits of the last row only (the decode step's path)
        decoded, _, cache = forward(target, tokens[:, 8 + i:9 + i], cache, logits_rows=jnp.zeros((3, 1), jnp.int32))
        np.testing.assert_array_equal(np.asarray(decoded[:, 0]), np.asarray(verify[:, i]))
        np.testing.assert_array_equal(np.asarray(decoded[:, 0]), np.asarray(batch_prefill[:, 8 + i]))


def test_a_prompts_output_does_not_depend_on_its_batch(target):
    together = jspec.generate(target, PROMPTS, 16, impl=INVARIANT)
    assert together == [jspec.generate(target, [prompt], 16, impl=INVARIANT)[0] for prompt in PROMPTS]


def _drafters(target):
    return {
        "draft-model": DraftModel(jspec.init_params(TINY, jax.random.key(1), jnp.bfloat16, scale=0.05)),
        "ngram": NGram(),
        "eagle3": Eagle3(_bf16(eagle3_head(3, target, aux=(0, 1, 1)))),
        "mtp": MTP(_bf16(init_mtp_head(target.config, jax.random.key(4), scale=0.3))),
        "dflash": dflash(target),
    }


@pytest.mark.parametrize("name", ["draft-model", "ngram", "eagle3", "mtp", "dflash"])
def test_speculative_greedy_equals_plain_greedy_bitwise_in_bf16(target, name):
    plain = jspec.generate(target, PROMPTS, 24, impl=INVARIANT)
    result = jspec.speculative_generate(target, _drafters(target)[name], PROMPTS, 24, num_draft_tokens=3,
                                        impl=INVARIANT)
    assert result.tokens == plain


def test_tree_speculative_greedy_equals_plain_greedy_bitwise_in_bf16(target):
    plain = jspec.generate(target, PROMPTS, 16, impl=INVARIANT)
    for drafter in (DraftModel(target), _drafters(target)["draft-model"]):  # self: every draft right
        result = jspec.speculative_generate(target, drafter, PROMPTS, 16, num_draft_tokens=5, topk=2, depth=3,
                                            impl=INVARIANT)
        assert result.tokens == plain


def test_a_heads_drafts_do_not_depend_on_the_batch(target):
    """The EAGLE-3 head's own norms and matmuls are invariant too: each prompt accepts the same
    drafts alone as in the batch."""
    drafter = _drafters(target)["eagle3"]
    together = jspec.speculative_generate(target, drafter, PROMPTS, 16, num_draft_tokens=3, impl=INVARIANT)
    for b, prompt in enumerate(PROMPTS):
        alone = jspec.speculative_generate(target, drafter, [prompt], 16, num_draft_tokens=3, impl=INVARIANT)
        assert alone.tokens[0] == together.tokens[b]
        assert alone.stats["accepted"][0] == together.stats["accepted"][b]


def test_self_drafting_accepts_every_draft_in_bf16(target):
    k = 3
    result = jspec.speculative_generate(target, DraftModel(target), PROMPTS, 24, num_draft_tokens=k,
                                        impl=INVARIANT)
    assert result.tokens == jspec.generate(target, PROMPTS, 24, impl=INVARIANT)
    # Every round accepts all k drafts; only a sequence's last round may be cut by max_new_tokens.
    assert (result.stats["accepted"] >= k * (result.stats["rounds"] - 1)).all()


def test_gemma4_with_its_assistant_is_exact_in_bf16():
    """Gemma 4 (sliding and full layers, KV sharing, k_eq_v, per-layer inputs, soft-capped logits)
    drafted by its assistant, which reads the target's cache: speculative == plain greedy bitwise.
    (Self-drafting's every-draft acceptance is pinned on the Llama target above: on CPU each drafter
    here is a ~20-30 s compile.)"""
    target = jspec.init_params(TINY_GEMMA4, jax.random.key(0), jnp.bfloat16, scale=0.05)
    config = assistant_config(target.config, hidden_size=32, layer_types=(SLIDING, FULL), num_heads=2,
                              num_centroids=None, centroid_top_k=32)
    assistant = FrozenKVMTP(_bf16(init_assistant(config, jax.random.key(5), scale=0.3)))
    result = jspec.speculative_generate(target, assistant, PROMPTS, 20, num_draft_tokens=3, impl=INVARIANT)
    assert result.tokens == jspec.generate(target, PROMPTS, 20, impl=INVARIANT)



def test_the_same_row_check_fails_under_xla_on_this_cpu():
    """The row-invariance checks above tell the modes apart on CPU: XLA's own fp32 matmul gives a
    row other bits when it is computed among other rows (one row: a matrix-vector product; several:
    the matrix product's tiling), so the same comparison finds differing rows under impl="xla" and
    none under "invariant". (Tests whose outputs are bf16 or tokens can pass under "xla" here: bf16
    rounds these last-bit differences away on small shapes; the kernels' invariance itself is pinned
    by the interpret-mode tests above.) Should XLA:CPU's matmul become row-invariant, the first
    assert says so."""
    x = jax.random.normal(jax.random.key(0), (150, 1024), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (1024, 64), jnp.float32)

    def differing_slices(impl):
        every_row = np.asarray(skinny_matmul(x, w, impl=impl))
        return [(start, rows) for start, rows in [(0, 1), (3, 5), (10, 20)]  # decode, verify, a batch of rows
                if not np.array_equal(np.asarray(skinny_matmul(x[start:start + rows], w, impl=impl)),
                                      every_row[start:start + rows])]

    assert differing_slices("xla"), "XLA:CPU's fp32 matmul gave every row the same bits among any rows"
    assert differing_slices(INVARIANT) == []
