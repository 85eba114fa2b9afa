"""jspec reproduces HF transformers on tiny random checkpoints that transformers itself wrote."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jspec

ARCHS = ["llama3", "qwen2", "qwen3"]
# gemma4: k_eq_v, full head_dim 32 vs sliding 16, proportional RoPE, window 4 (the prompts exceed it).
# gemma4-ple: PLE, KV-shared layers with double-wide MLPs, untied head.
# gemma4-multimodal: Gemma4ForConditionalGeneration layout (model.language_model.*).
GEMMA4_CASES = ["gemma4", "gemma4-ple", "gemma4-multimodal"]
# (fixture that writes the checkpoints, checkpoint name)
CHECKPOINTS = [("hf_models", name) for name in ARCHS] + [("hf_gemma4", name) for name in GEMMA4_CASES]


def _reference(hf_models, name):
    return np.load(hf_models / name / "reference.npz")


@pytest.mark.parametrize("fixture, name", CHECKPOINTS)
def test_score_logits_match_hf(request, fixture, name):
    root = request.getfixturevalue(fixture)
    model = jspec.load_hf(root / name)
    ref = _reference(root, name)
    logits = np.asarray(jspec.score(model, ref["score_ids"]))
    expected = ref["score_logits"]
    assert logits.shape == expected.shape
    rel = np.abs(logits - expected).max() / np.abs(expected).max()
    assert rel < 1e-4


@pytest.mark.parametrize("fixture, name", CHECKPOINTS)
def test_greedy_generate_matches_hf_on_ragged_batch(request, fixture, name):
    root = request.getfixturevalue(fixture)
    model = jspec.load_hf(root / name)
    spec = json.loads((root / "prompts.json").read_text())
    generated = jspec.generate(model, spec["prompts"], spec["max_new_tokens"])
    expected = _reference(root, name)["generated"].tolist()
    assert generated == expected


@pytest.mark.parametrize("name", ARCHS)
def test_sharded_checkpoint_loads_the_same(hf_models, name):
    single = jspec.load_hf(hf_models / name)
    sharded = jspec.load_hf(hf_models / f"{name}-sharded")
    assert (hf_models / f"{name}-sharded" / "model.safetensors.index.json").exists()
    for a, b in zip(jax_leaves(single), jax_leaves(sharded), strict=True):
        np.testing.assert_array_equal(a, b)
    assert single.config == sharded.config


def test_architecture_flags_detected(hf_models):
    assert jspec.load_hf(hf_models / "llama3").config.rope_scaling is not None
    assert jspec.load_hf(hf_models / "qwen2").config.qkv_bias
    qwen3 = jspec.load_hf(hf_models / "qwen3").config
    assert qwen3.qk_norm and qwen3.head_dim == 32


def test_dtype_argument_casts_parameters(hf_models):
    import jax.numpy as jnp

    model = jspec.load_hf(hf_models / "llama3", dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax_leaves(model)} == {jnp.dtype(jnp.bfloat16)}


def jax_leaves(model):
    import jax

    return jax.tree_util.tree_leaves(model)
