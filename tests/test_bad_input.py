"""Bad input raises a clear ValueError before any compute."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize(
    "prompts, max_new, match",
    [
        ([[1, 2], []], 4, "prompt 1 is empty"),
        ([[1, 97]], 4, r"token id 97 outside the vocabulary \[0, 97\)"),
        ([[-1, 3]], 4, "token id -1 outside"),
        ([[1] * 250], 7, "exceeds the model's max_position_embeddings=256"),
        ([[1, 2]], -1, "max_new_tokens must be >= 0"),
        ([[1, 2]], 2.5, "max_new_tokens must be an int"),
        ([], 4, "non-empty list"),
        ([[[1, 2]]], 4, "flat list"),
        ([[1.5, 2]], 4, "integer token ids"),
    ],
)
def test_generate_rejects_bad_input(model, prompts, max_new, match):
    with pytest.raises(ValueError, match=match):
        jspec.generate(model, prompts, max_new)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_k=0), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
    ],
)
def test_generate_rejects_bad_sampling_params(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        jspec.generate(model, [[1, 2]], 3, **kwargs)


def test_zero_new_tokens_is_valid(model):
    assert jspec.generate(model, [[1, 2], [3]], 0) == [[], []]


@pytest.mark.parametrize(
    "ids, match",
    [([[1, 2], [3]], "equal-length"), ([[1, 200]], "outside the vocabulary"), ([[]], "non-empty")],
)
def test_score_rejects_bad_input(model, ids, match):
    with pytest.raises(ValueError, match=match):
        jspec.score(model, np.array(ids, dtype=object) if match == "equal-length" else ids)


def test_forward_rejects_bad_capture_and_rows(model):
    tokens = jnp.zeros((2, 3), jnp.int32)
    kv = model.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"logits_rows must be \[batch=2, n\] row indices, got shape \(2,\)"):
        jspec.forward(model, tokens, kv, logits_rows=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"Capture.residuals \[5\] out of range for a model with 2 layers"):
        jspec.forward(model, tokens, kv, capture=jspec.Capture(residuals=(0, 5)))
    with pytest.raises(ValueError, match="Capture.residuals must be layer indices >= 0"):
        jspec.Capture(residuals=(-1,))


def test_speculative_generate_rejects_a_non_drafter(model):
    with pytest.raises(ValueError, match="drafter must implement jspec.drafters.Drafter, got str"):
        jspec.speculative_generate(model, "ngram", [[1, 2]], 4)


# --- checkpoints -------------------------------------------------------------------------


@pytest.fixture
def llama_dir(hf_models, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_models / "llama3", dst)
    return dst


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(llama_dir):
    _edit_tensors(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.layers.1.mlp.up_proj.weight'\]"):
        jspec.load_hf(llama_dir)


def test_unexpected_tensor_is_named(llama_dir):
    _edit_tensors(llama_dir, lambda t: t.update({"model.layers.0.mystery.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected tensor\(s\) \['model.layers.0.mystery.weight'\]"):
        jspec.load_hf(llama_dir)


def test_misshaped_tensor_is_named(llama_dir):
    def shrink(t):
        t["model.layers.2.self_attn.k_proj.weight"] = t["model.layers.2.self_attn.k_proj.weight"][:-1]

    _edit_tensors(llama_dir, shrink)
    with pytest.raises(ValueError, match=r"'model.layers.2.self_attn.k_proj.weight' has shape \(31, 64\), expected \(32, 64\)"):
        jspec.load_hf(llama_dir)


def test_tied_embeddings_without_lm_head_is_missing_for_untied_config(llama_dir):
    _edit_tensors(llama_dir, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        jspec.load_hf(llama_dir)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(architectures=["MistralForCausalLM"]), "architectures"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type='yarn'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(vocab_size=None), "vocab_size"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    ],
)
def test_unsupported_config_is_named(llama_dir, changes, match):
    _edit_config(llama_dir, **changes)
    with pytest.raises(ValueError, match=match):
        jspec.load_hf(llama_dir)


def test_missing_shard_and_config(llama_dir, hf_models, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(hf_models / "llama3-sharded", sharded)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="names the shard"):
        jspec.load_hf(sharded)
    (llama_dir / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json not found"):
        jspec.load_hf(llama_dir)
