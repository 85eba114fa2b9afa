"""Gemma 4 through the family-agnostic paths: forward contract, speculative losslessness,
save / restore, the kernels at Gemma-4-31B shapes. (Presets and roofline byte counts:
test_bench.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import MTP, DraftModel, Eagle3, NGram, init_mtp_head
from jspec.models import Capture, forward, gemma4
from tests.tiny import TINY, TINY_GEMMA4, eagle3_head, tiny_gemma4

MAX_NEW = 16


def _abstract(config, dtype=jnp.float32):
    """Parameter shapes and dtypes only (no weights made)."""
    return jax.eval_shape(lambda: jspec.init_params(config, jax.random.key(0), dtype))


def test_cache_holds_only_layers_that_own_kv():
    model = _abstract(TINY_GEMMA4)
    kv = jax.eval_shape(lambda: model.init_cache(2, 32))
    # layers 0, 1 own K/V (sliding: 2 heads x 16, full: 1 head x 32); 2 and 3 reuse them.
    assert [k.shape for k in kv.k] == [(2, 2, 32, 16), (2, 1, 32, 32)]
    assert [model.config.kv_source(i) for i in range(4)] == [0, 1, 0, 1]


def test_forward_contract_matches_llama():
    """Incremental decoding equals one full pass; logits_rows / capture / compute_logits behave as for Llama."""
    model = tiny_gemma4(1)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, model.config.vocab_size)
    run = jax.jit(forward, static_argnames="capture")
    full, feats, kv = run(model, tokens, model.init_cache(2, 16), capture=Capture(residuals=(0, 3, 4), final_normed=True))
    assert full.dtype == jnp.float32 and full.shape == (2, 12, 97)
    assert [f.shape for f in feats] == [(2, 12, 64)] * 4
    assert (np.asarray(kv.lengths) == 12).all()
    assert np.abs(full).max() <= 30.0  # soft-capped

    logits, _, kv = jax.jit(lambda m, t, kv: forward(m, t, kv, compute_logits=False))(model, tokens[:, :7], model.init_cache(2, 16))
    assert logits is None
    step, _, kv = run(model, tokens[:, 7:9], kv, logits_rows=jnp.array([[0, 1], [1, 0]]))
    expected = np.stack([full[0, jnp.array([7, 8])], full[1, jnp.array([8, 7])]])
    np.testing.assert_allclose(step, expected, rtol=1e-5, atol=1e-5)
    last, _, _ = run(model, tokens[:, 9:], kv, logits_rows=jnp.array([[2], [0]]))
    np.testing.assert_allclose(last[:, 0], full[jnp.arange(2), jnp.array([11, 9])], rtol=1e-5, atol=1e-5)
    # Capturing a KV-shared layer's input keeps all rows through it: same logits, full feature.
    rows, (late,), _ = run(model, tokens, model.init_cache(2, 16), capture=Capture(residuals=(3,)), logits_rows=jnp.array([[5], [-1]]))
    np.testing.assert_allclose(rows[:, 0], full[jnp.arange(2), jnp.array([5, 11])], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(late, feats[1], rtol=1e-5, atol=1e-5)


# (seed, batch, k, drafter); one target config, so the cases share compiled programs (the
# HF parity tests cover the other config variants)
GREEDY_CASES = [(0, 3, 3, "draft"), (1, 3, 2, "ngram")]


def _drafter(kind, target, seed):
    if kind == "draft":  # a one-sliding-one-full-layer Gemma, no PLE
        return DraftModel(tiny_gemma4(seed + 100, num_layers=2, layer_types=("sliding_attention", "full_attention"),
                                      hidden_size_per_layer_input=0, num_kv_shared_layers=0))
    return NGram(max_ngram=3)


@pytest.mark.parametrize("seed, batch, k, kind", GREEDY_CASES)
def test_greedy_speculative_equals_greedy(seed, batch, k, kind):
    target = tiny_gemma4(seed)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 21, size=batch)
    if kind == "ngram":
        prompts = [list(np.tile(rng.integers(0, 97, size=3), 7)[:n]) for n in lengths]
    else:
        prompts = [list(rng.integers(0, 97, size=n)) for n in lengths]
    expected = jspec.generate(target, prompts, MAX_NEW)
    result = jspec.speculative_generate(target, _drafter(kind, target, seed), prompts, MAX_NEW, num_draft_tokens=k)
    assert result.tokens == expected


def test_hidden_state_drafters_refuse_a_gemma_target():
    target = _abstract(TINY_GEMMA4)
    llama = _abstract(TINY)
    heads = jax.eval_shape(lambda: (eagle3_head(0, llama), init_mtp_head(TINY, jax.random.key(0))))
    for drafter in (Eagle3(heads[0]), MTP(heads[1])):
        with pytest.raises(ValueError, match="Llama / Qwen targets only, not Gemma4ForCausalLM"):
            drafter.check_compatible(target)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_restore_is_bit_exact(tmp_path, dtype):
    model = jax.tree.map(lambda x: x.astype(dtype), tiny_gemma4())
    jspec.save(model, tmp_path / "m")
    restored = jspec.restore(tmp_path / "m")
    assert isinstance(restored, gemma4.Model) and restored.config == model.config
    assert jax.tree.structure(restored) == jax.tree.structure(model)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_forward_on_pallas_kernels_matches_xla():
    """Windowed, scale-1.0 attention of both layer geometries through the kernels (interpret mode)."""
    from tests.test_model_kernels import _prefill_then_decode

    model = tiny_gemma4(3)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, model.config.vocab_size)
    kernels = _prefill_then_decode(model, tokens, impl="pallas")
    for kernel, reference in zip(kernels, _prefill_then_decode(model, tokens, impl="xla"), strict=True):
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_gemma_4_31b_attention_lowers_for_cuda(kind):
    """The attention kernel at Gemma-4-31B verify shapes (sliding: 16 KV heads x 256, window
    1024; full: 4 KV heads x 512), scale 1.0, lowers for an abstract H100 (no GPU needed)."""
    from jspec.bench.presets import PRESETS
    from pallas_kernels.attention.decode_attention import decode_attention_pallas
    from tests._lowering import lower_for_cuda, triton_kernel_count

    c = PRESETS["gemma-4-31b"]
    index = c.layer_types.index(f"{kind}_attention")
    kv_heads, head_dim = c.attention_shape(index)
    batch, rows, max_len = 2, 5, 4096
    S = jax.ShapeDtypeStruct
    args = [
        S((batch, rows, c.num_heads, head_dim), jnp.bfloat16),
        S((batch, kv_heads, max_len, head_dim), jnp.bfloat16),
        S((batch, kv_heads, max_len, head_dim), jnp.bfloat16),
        S((batch,), jnp.int32),
        S((batch, rows), jnp.int32),
    ]

    def attend(q, k, v, lengths, positions):
        return decode_attention_pallas(
            q, k, v, lengths, q_positions=positions, window=c.window(index), scale=1.0, interpret=False
        )

    assert triton_kernel_count(lower_for_cuda(attend, *args)) >= 1
