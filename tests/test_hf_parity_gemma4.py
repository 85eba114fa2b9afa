"""The Gemma 4 loader: configs detected, dtypes cast, and checkpoints that do not match their
config rejected (logit and greedy parity with transformers: tests/test_hf_parity.py)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.models import gemma4


def test_prompts_exceed_the_sliding_window(hf_gemma4):
    # so that test_hf_parity's greedy comparison exercises the window
    spec = json.loads((hf_gemma4 / "prompts.json").read_text())
    window = jspec.load_hf(hf_gemma4 / "gemma4").config.sliding_window
    assert max(len(p) for p in spec["prompts"]) > window


def test_configs_detected(hf_gemma4):
    model = jspec.load_hf(hf_gemma4 / "gemma4")
    assert isinstance(model, gemma4.Model)
    c = model.config
    assert c.attention_k_eq_v and (c.num_global_kv_heads, c.global_head_dim) == (1, 32)
    assert c.full_rope.rope_type == "proportional" and c.hidden_size_per_layer_input == 0
    ple = jspec.load_hf(hf_gemma4 / "gemma4-ple")
    assert ple.config.num_kv_shared_layers == 2 and ple.ple is not None and ple.lm_head is not None
    assert len(ple.init_cache(1, 8).k) == 4  # the two KV-shared layers own no cache
    multimodal = jspec.load_hf(hf_gemma4 / "gemma4-multimodal")
    assert multimodal.config.architecture == "Gemma4ForConditionalGeneration"


def test_dtype_argument_casts_parameters(hf_gemma4):
    model = jspec.load_hf(hf_gemma4 / "gemma4-ple", dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(model)} == {jnp.dtype(jnp.bfloat16)}


def _copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "name, edit, match",
    [
        ("gemma4", lambda t: t.pop("model.layers.3.self_attn.q_norm.weight"), r"missing tensor.*layers\.3\.self_attn\.q_norm"),
        ("gemma4", lambda t: t.pop("model.layers.1.layer_scalar"), r"missing tensor.*layers\.1\.layer_scalar"),
        ("gemma4-ple", lambda t: t.pop("model.embed_tokens_per_layer.weight"), "missing tensor.*embed_tokens_per_layer"),
        # k_eq_v: a full layer must not have a v_proj
        ("gemma4", lambda t: t.update({"model.layers.2.self_attn.v_proj.weight": np.zeros((32, 64), np.float32)}),
         r"unexpected tensor.*layers\.2\.self_attn\.v_proj"),
        ("gemma4", lambda t: t.update({"model.mtp.weight": np.zeros((2,), np.float32)}), "unexpected tensor.*model.mtp"),
        ("gemma4-multimodal", lambda t: t.update({"model.lm.weight": np.zeros((2,), np.float32)}),
         r"unexpected tensor.*model\.lm\.weight"),
        ("gemma4", lambda t: t.update({"model.layers.2.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}),
         r"layers\.2\.self_attn\.k_proj.weight' has shape \(64, 64\), expected \(32, 64\)"),
    ],
)
def test_bad_checkpoint_is_rejected(hf_gemma4, tmp_path, name, edit, match):
    with pytest.raises(ValueError, match=match):
        jspec.load_hf(_copy(hf_gemma4 / name, tmp_path / "bad", edit))


def test_kv_shared_layers_may_carry_unused_kv_weights(hf_gemma4, tmp_path):
    """Released E2B / E4B checkpoints store K/V weights on KV-shared layers; HF ignores them."""
    extra = {"model.layers.5.self_attn.k_proj.weight": np.zeros((64, 64), np.float32)}
    model = jspec.load_hf(_copy(hf_gemma4 / "gemma4-ple", tmp_path / "extra", lambda t: t.update(extra)))
    assert model.layers[5].k_norm is None


def _text_config(hf_gemma4, **changes):
    cfg = json.loads((hf_gemma4 / "gemma4" / "config.json").read_text())
    return cfg | changes


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(enable_moe_block=True, num_experts=4), "enable_moe_block"),
        (dict(hidden_activation="silu"), "hidden_activation"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4}}), "rope_type='yarn'"),
        (dict(per_layer_config={"2": {"head_dim": 32}, "5": {"head_dim": 64}}), "per_layer_config"),
        (dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=10), "vocab_size_per_layer_input"),
        (dict(num_kv_shared_layers=5), "every layer type of a KV-shared layer"),
    ],
)
def test_unsupported_config_is_rejected(hf_gemma4, changes, match):
    with pytest.raises(ValueError, match=match):
        gemma4.from_hf_config(_text_config(hf_gemma4, **changes))


def test_released_config_form_is_read(hf_gemma4):
    """Hub config.json files give the full-layer geometry as global_head_dim /
    num_global_key_value_heads rather than transformers 5.23's per_layer_config."""
    cfg = _text_config(hf_gemma4, global_head_dim=32, num_global_key_value_heads=1)
    del cfg["per_layer_config"]
    assert gemma4.from_hf_config(cfg) == jspec.load_hf(hf_gemma4 / "gemma4").config
    wrapped = dict(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", text_config=cfg)
    assert gemma4.from_hf_config(wrapped).architecture == "Gemma4ForConditionalGeneration"
    with pytest.raises(ValueError, match="text_config"):
        gemma4.from_hf_config(dict(architectures=["Gemma4ForConditionalGeneration"]))
