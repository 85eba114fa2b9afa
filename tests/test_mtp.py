"""MTP / NextN drafter: parity with transformers' MtpLayer around the target's decoder layer
in the DeepSeek-V3 and Qwen3-Next tensor layouts, greedy losslessness, catch-up correctness,
checkpoint validation, export (``save_head``) and the HF config it writes."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.drafters import MTP, MTPHead, init_mtp_head
from jspec.drafters.mtp import save_head
from jspec.models.llama import RopeScaling, from_hf_config, to_hf_config
from jspec.models.llama.weights import is_mtp_tensor
from tests import hf_oracle
from tests.hidden_drafters import check_catch_up, check_greedy_lossless, check_parity
from tests.tiny import TINY, tiny_model


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return hf_oracle.once_per_run(tmp_path_factory, "hf_mtp", lambda out: hf_oracle.make("mtp", out))


@pytest.mark.parametrize("case, layout", [("mtp-deepseek", "deepseek"), ("mtp-qwen", "qwen3_next")])
def test_mtp_layer_parity_with_transformers(mtp_dir, case, layout):
    target = jspec.load_hf(mtp_dir / case)  # the MTP tensors in the same checkpoint are skipped
    drafter = MTP.load(mtp_dir / case)
    assert isinstance(drafter.head, MTPHead) and drafter.head.layout == layout
    assert drafter.capture == jspec.Capture(final_normed=True)
    pre_norm = MTP.load(mtp_dir / case, input_hidden="pre_norm")
    assert pre_norm.capture == jspec.Capture(residuals=(target.config.num_layers,))
    check_parity(target, drafter, mtp_dir / case)


def test_load_hf_mtp_is_a_deprecated_alias(mtp_dir):
    with pytest.warns(DeprecationWarning, match="MTP.load"):
        head = jspec.load_hf_mtp(mtp_dir / "mtp-deepseek")
    assert jax.tree.all(jax.tree.map(np.array_equal, head, MTP.load(mtp_dir / "mtp-deepseek").head))


# (seed, batch, k, eos, target overrides, drafter options)
GREEDY_CASES = [
    (0, 2, 1, True, dict(), dict()),
    (1, 3, 3, False, dict(tie_word_embeddings=True, qkv_bias=True), dict(input_hidden="pre_norm", recycled_hidden="pre_norm")),
    (2, 4, 5, False, dict(vocab_size=12, qk_norm=True, head_dim=32), dict(recycled_hidden="pre_norm")),
]


@pytest.mark.parametrize("seed, batch, k, eos, overrides, options", GREEDY_CASES)
def test_greedy_speculative_equals_greedy(seed, batch, k, eos, overrides, options):
    target = tiny_model(seed, **overrides)
    head = init_mtp_head(target.config, jax.random.key(seed + 50), scale=0.3)
    check_greedy_lossless(target, MTP(head, **options), seed, batch, k, eos)


@pytest.mark.parametrize("options", [dict(), dict(input_hidden="pre_norm", recycled_hidden="pre_norm")])
def test_catch_up_equals_draft_from_scratch(options):
    target = tiny_model(7, qk_norm=True)
    check_catch_up(target, MTP(init_mtp_head(target.config, jax.random.key(8), scale=0.3), **options))


def _rewrite(src, dst, tensors):
    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    save_file(tensors(load_file(path)), path)
    return dst


def test_bad_checkpoints_raise(mtp_dir, tmp_path):
    good = mtp_dir / "mtp-deepseek"
    bad = _rewrite(good, tmp_path / "none", lambda t: {k: v for k, v in t.items() if not k.startswith("model.layers.3.")})
    with pytest.raises(ValueError, match="has no MTP layer"):
        MTP.load(bad)
    bad = _rewrite(good, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != "model.layers.3.hnorm.weight"})
    with pytest.raises(ValueError, match=r"missing tensor.*model.layers.3.hnorm.weight"):
        MTP.load(bad)
    bad = _rewrite(good, tmp_path / "two", lambda t: t | {"model.layers.4.eh_proj.weight": t["model.layers.3.eh_proj.weight"]})
    with pytest.raises(ValueError, match="2 MTP layers; only one is supported"):
        MTP.load(bad)
    bad = _rewrite(good, tmp_path / "shape", lambda t: t | {"model.layers.3.eh_proj.weight": t["model.layers.3.eh_proj.weight"][:, :64]})
    with pytest.raises(ValueError, match="'model.layers.3.eh_proj.weight' has shape"):
        MTP.load(bad)
    cfg = json.loads((mtp_dir / "mtp-qwen" / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    # A head loaded for one target does not draft for a different one.
    head = MTP.load(good).head
    with pytest.raises(ValueError, match="MTP head does not match the target"):
        jspec.speculative_generate(tiny_model(0), MTP(head), [[1, 2]], 4)
    with pytest.raises(ValueError, match="input_hidden must be one of"):
        MTP(head, input_hidden="post")


# One config of each family the HF config.json can describe.
FAMILIES = {
    "llama3": dataclasses.replace(TINY, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64)),
    "qwen2": dataclasses.replace(TINY, qkv_bias=True, tie_word_embeddings=True, architecture="Qwen2ForCausalLM"),
    "qwen3": dataclasses.replace(TINY, qk_norm=True, rms_norm_eps=1e-6, architecture="Qwen3ForCausalLM"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_config_is_the_inverse_of_from_hf_config(family):
    config = FAMILIES[family]
    hf = json.loads(json.dumps(to_hf_config(config)))  # plain JSON
    assert from_hf_config(hf) == config


def test_to_hf_config_refuses_flags_its_architecture_does_not_have():
    with pytest.raises(ValueError, match="do not match LlamaForCausalLM"):
        to_hf_config(dataclasses.replace(TINY, qkv_bias=True))


@pytest.mark.parametrize("family, dtype", [("llama3", jnp.float32), ("qwen2", jnp.bfloat16), ("qwen3", jnp.float32)])
def test_a_saved_head_loads_back_exactly(family, dtype, tmp_path):
    head = init_mtp_head(FAMILIES[family], jax.random.key(1), dtype)
    save_head(head, tmp_path / "head", metadata=dict(steps=3))
    loaded = MTP.load(tmp_path / "head").head
    assert loaded.config == head.config and loaded.layout == "deepseek" and loaded.eh_proj.dtype == dtype
    _assert_equal_leaves(head, loaded)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["jspec"] == dict(steps=3)
    L = head.config.num_layers  # only the MTP layer's tensors, at the index after the target's layers
    assert all(name.startswith(f"model.layers.{L}.") for name in load_file(tmp_path / "head" / "model.safetensors"))


@pytest.mark.parametrize("case", ["mtp-deepseek", "mtp-qwen"])
def test_a_saved_head_dropped_beside_the_target_weights_loads_from_the_target_directory(mtp_dir, case, tmp_path):
    """The target checkpoint with its MTP tensors replaced by the exported file (renamed, as a
    second shard): the target loads as before and the MTP head is the exported one."""
    head = MTP.load(mtp_dir / case).head
    save_head(head, tmp_path / "head")
    cfg = json.loads((mtp_dir / case / "config.json").read_text())
    own = _rewrite(mtp_dir / case, tmp_path / "target",
                   lambda t: {k: v for k, v in t.items() if not is_mtp_tensor(k, cfg)})
    shutil.copy(tmp_path / "head" / "model.safetensors", own / "mtp.safetensors")
    loaded = MTP.load(own).head
    assert loaded.layout == "deepseek" and loaded.config == head.config
    _assert_equal_leaves(head, loaded)
    _assert_equal_leaves(jspec.load_hf(mtp_dir / case), jspec.load_hf(own))


def _assert_equal_leaves(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
