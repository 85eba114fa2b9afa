"""MTP / NextN drafter: parity with transformers' MtpLayer around the target's decoder layer
in the DeepSeek-V3 and Qwen3-Next tensor layouts, greedy losslessness, catch-up correctness,
checkpoint validation."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.drafters import MTP, MTPHead, init_mtp_head
from tests import hf_oracle
from tests.hidden_drafters import check_catch_up, check_greedy_lossless, check_parity
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return hf_oracle.make("mtp", tmp_path_factory.mktemp("mtp"))


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
