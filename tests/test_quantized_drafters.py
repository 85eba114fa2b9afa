"""Quantized drafters on quantized targets: every drafter kind (a draft model, EAGLE-3, MTP, DFlash,
the Gemma 4 assistant) quantizes to int8 and to an int4 scheme; a drafter that drafts with the
target's embedding / LM head uses the target's quantized table, not a copy; speculative greedy
output equals the quantized target's plain greedy output token for token (fp32 scales); and under
``impl="invariant"`` the same holds bitwise in bf16."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import (DFlash, DraftModel, Eagle3, FrozenKVMTP, MTP, NGram, assistant_config,
                            init_assistant, init_mtp_head)
from jspec.quant import QuantizedWeight, Scheme
from tests.hidden_drafters import MAX_NEW, ragged_prompts
from tests.tiny import TINY, dflash, eagle3_head, tiny_gemma4, tiny_model

K = 3  # draft tokens a round


def _assistant(target, seed):
    config = assistant_config(target.config, hidden_size=32, num_layers=2, num_heads=2,
                              num_centroids=target.config.vocab_size, centroid_top_k=2)
    return FrozenKVMTP(init_assistant(config, jax.random.key(seed), scale=0.3))


# kind -> (target family, drafter for an unquantized target, its int4 scheme, the scheme it drafts with
# in speculation). The Llama target is quantized int8, the Gemma 4 one int4-g8-sym.
DRAFTERS = {
    "draft_model": ("llama", lambda t: DraftModel(tiny_model(7, tie_word_embeddings=True)), "int4-g32", "int4-g32"),
    "eagle3": ("llama", lambda t: Eagle3(eagle3_head(8, t, aux=(0, 1, 1))), "int4-g32", "int8"),
    "mtp": ("llama", lambda t: MTP(init_mtp_head(t.config, jax.random.key(3), scale=0.3)), "int4-g32-sym",
            "int4-g32-sym"),
    "dflash": ("llama", lambda t: dflash(t, seed=9), "int4-g32-sym", "int8"),
    "gemma4_assistant": ("gemma4", lambda t: _assistant(t, 5), "int4-g16", "int4-g16"),
}
TARGET_SCHEMES = {"llama": "int8", "gemma4": "int4-g8-sym"}
# Two layers (one of each kind, both owning their KV), no per-layer inputs: half the compile time of
# tests/tiny.py's Gemma 4; the assistant reads the same kinds of cache (tests/test_quantize.py covers
# a quantized Gemma 4 with everything).
SMALL_GEMMA4 = dict(num_layers=2, layer_types=("sliding_attention", "full_attention"), num_kv_shared_layers=0,
                    hidden_size_per_layer_input=0)


@pytest.fixture(scope="module")
def targets():
    """Per family: (unquantized target, quantized target, prompts, its plain greedy output), made and
    generated once for every drafter (one compiled plain generation per family)."""
    made = {}

    def get(family):
        if family not in made:
            target = tiny_model(0, tie_word_embeddings=True) if family == "llama" else tiny_gemma4(0, **SMALL_GEMMA4)
            quantized = jspec.quantize(target, TARGET_SCHEMES[family])
            prompts = ragged_prompts(np.random.default_rng(0), 2, target.config.vocab_size)
            made[family] = target, quantized, prompts, jspec.generate(quantized, prompts, MAX_NEW)
        return made[family]

    return get


def _borrowed_table(bound):
    """The embedding table a bound drafter takes from its target (None: a draft model, whose tables are
    its own)."""
    return bound.target.embed if isinstance(bound, DFlash) else getattr(bound, "embed", None)


def _is_quantized(x) -> bool:
    return isinstance(x, QuantizedWeight)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_quantized_drafter_on_a_quantized_target_is_lossless(targets, kind):
    family, make, int4, drafting = DRAFTERS[kind]
    target, quantized_target, prompts, plain = targets(family)
    drafter = make(target)
    for name in ("int8", int4):  # every drafter takes int8 and an int4 scheme (abstractly: nothing compiled)
        leaves = jax.tree.leaves(jax.eval_shape(lambda d: jspec.quantize(d, name), drafter), is_leaf=_is_quantized)
        assert {w.scheme for w in leaves if _is_quantized(w)} == {Scheme.parse(name)}
        # every matmul weight and table quantized; norms, biases and index tables kept
        assert not [w for w in leaves if not _is_quantized(w) and len(w.shape) == 2
                    and jnp.issubdtype(w.dtype, jnp.floating)]
    quantized = jspec.quantize(drafter, drafting)
    # Bound to the quantized target, a drafter that borrows the target's table drafts with that very
    # QuantizedWeight (the tied LM head included), not a copy quantized another way.
    table = _borrowed_table(quantized.bind(quantized_target))
    assert (table is quantized_target.embed) == (kind != "draft_model")
    result = jspec.speculative_generate(quantized_target, quantized, prompts, MAX_NEW, num_draft_tokens=K)
    assert result.tokens == plain
    assert (result.stats["drafted"] == result.stats["rounds"] * K).all()


def test_invariant_kernels_keep_speculation_on_a_quantized_target_bitwise_in_bf16():
    """bf16 weights with bf16 scales, small enough that logits nearly tie (tests/test_invariant.py):
    the quantized matmuls' invariant mode (dequantize, then the row-invariant kernel) gives every row
    the same bits in decode and verify calls. One layer and n-gram drafts keep the interpreted kernels
    few; under impl="xla" this very case differs from plain greedy (checked when it was written, jax
    0.12 on CPU), so it tells the modes apart."""
    config = dataclasses.replace(TINY, num_layers=1)
    target = jspec.quantize(jspec.init_params(config, jax.random.key(0), jnp.bfloat16, scale=0.05), "int8")
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]]
    plain = jspec.generate(target, prompts, 16, impl="invariant")
    result = jspec.speculative_generate(target, NGram(), prompts, 16, num_draft_tokens=K, impl="invariant")
    assert result.tokens == plain
    assert result.stats["accepted"].sum() > 0  # verify rows beyond the first were used
