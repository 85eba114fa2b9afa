"""The Gemma 4 assistant drafter (FrozenKVMTP): one draft round equals transformers 5.23's
SinglePositionMultiTokenCandidateGenerator (tokens, and logits within fp32 tolerance) for both
heads, after the prefill and after a fully accepted round, and with each option against
transformers' own assistant forward; checkpoints and targets that do not fit are rejected."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.drafters import FrozenKVMTP, assistant_config, init_assistant
from jspec.drafters.base import RoundContext
from jspec.drafters.frozen_kv_mtp.assistant import top_k_indices
from jspec.engine import pad_prompts, prefill
from jspec.models.gemma4 import FULL, SLIDING
from jspec.sampling import SamplingParams
from tests import hf_oracle
from tests.tiny import TINY, TINY_GEMMA4

CASES = ["assistant-tied", "assistant-centroid"]


@pytest.fixture(scope="module")
def assistant_dir(tmp_path_factory):
    """Targets with KV sharing + assistants made by transformers, and their draft rounds
    (tests/hf_reference/gemma4.py, cmd_gemma4_assistant)."""
    return hf_oracle.once_per_run(tmp_path_factory, "hf_gemma4_assistant",
                                  lambda out: hf_oracle.make("gemma4-assistant", out))


@jax.jit
def _target_state(target, tokens, lengths):
    """The target after a prefill of the right-padded prompts ``tokens [batch, width]``: its cache,
    the captured final-normed hidden of each last row, and its greedy next token (the bonus)."""
    kv = target.init_cache(tokens.shape[0], 64)
    logits, features, kv = prefill(target, tokens, lengths, kv, capture=jspec.Capture(final_normed=True))
    hidden = jnp.take_along_axis(features[0], (lengths - 1)[:, None, None], axis=1)[:, 0]
    return kv, hidden, jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="k")
def _propose(drafter, kv, hidden, bonus, k):
    ctx = RoundContext(None, kv.lengths, bonus, (hidden,), kv)
    return drafter.propose((), ctx, num_draft_tokens=k, params=SamplingParams(), key=jax.random.key(0))


@jax.jit
def _step_logits(drafter, kv, token, hidden):
    y, hidden = drafter.step(drafter.frozen_kv(kv, kv.lengths), token, hidden)
    return drafter.head_logits(y), hidden


def _check_round(drafter, kv, hidden, bonus, want_drafts, want_logits):
    """A ragged batch: row b against the reference of prompt b."""
    want_drafts, want_logits = np.stack(want_drafts), np.stack(want_logits)  # [batch, k], [batch, k, vocab]
    # The whole round (one scan) ...
    drafts, probs, _ = _propose(drafter, kv, hidden, bonus, want_drafts.shape[1])
    assert probs is None
    np.testing.assert_array_equal(drafts, want_drafts)
    # ... and its steps one by one, for the logits of every step.
    token = bonus
    for step in range(want_drafts.shape[1]):
        logits, hidden = _step_logits(drafter, kv, token, hidden)
        np.testing.assert_allclose(logits, want_logits[:, step], rtol=1e-4, atol=1e-4)
        token = jnp.asarray(want_drafts[:, step], jnp.int32)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("after", ["prefill", "full acceptance"])
def test_a_round_equals_transformers_candidates(assistant_dir, case, after):
    meta = json.loads((assistant_dir / "prompts.json").read_text())
    ref = np.load(assistant_dir / case / "reference.npz")
    target = jspec.load_hf(assistant_dir / case / "target")
    drafter = FrozenKVMTP.load(assistant_dir / case / "assistant").bind(target)
    assert (drafter.assistant.centroids is not None) == (case == "assistant-centroid")
    prompts = meta["prompts"]
    if after == "full acceptance":  # the round verified [bonus, continuation] and accepted all of it
        prompts = [p + [int(ref[f"bonus_{b}"])] + meta["continuation"] for b, p in enumerate(prompts)]
    suffix = "" if after == "prefill" else "2"
    kv, hidden, bonus = _target_state(target, *map(jnp.asarray, pad_prompts(prompts)))
    np.testing.assert_array_equal(bonus, [int(ref[f"bonus{suffix}_{b}"]) for b in range(len(prompts))])
    _check_round(drafter, kv, hidden, bonus, *_reference(ref, f"{suffix}", len(prompts)))


def _reference(ref, name, batch):
    return [ref[f"drafts{name}_{b}"] for b in range(batch)], [ref[f"logits{name}_{b}"] for b in range(batch)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("option", [dict(rope_position="last_committed"), dict(sliding_rows="window")])
def test_options_equal_transformers_assistant_with_that_setting(assistant_dir, case, option):
    """rope_position="last_committed": transformers' assistant at position p; sliding_rows="window":
    transformers' assistant shown only the last W rows of the target's sliding K/V."""
    meta = json.loads((assistant_dir / "prompts.json").read_text())
    ref = np.load(assistant_dir / case / "reference.npz")
    name = "last_committed" if "rope_position" in option else "window"
    target = jspec.load_hf(assistant_dir / case / "target")
    drafter = FrozenKVMTP.load(assistant_dir / case / "assistant", **option).bind(target)
    kv, hidden, bonus = _target_state(target, *map(jnp.asarray, pad_prompts(meta["prompts"])))
    _check_round(drafter, kv, hidden, bonus, *_reference(ref, f"_{name}", len(meta["prompts"])))


def test_both_config_layouts_load(assistant_dir):
    # transformers 5.23 writes per_layer_config (the tied case); released configs global_head_dim.
    tied = json.loads((assistant_dir / "assistant-tied" / "assistant" / "config.json").read_text())
    centroid = json.loads((assistant_dir / "assistant-centroid" / "assistant" / "config.json").read_text())
    assert "per_layer_config" in tied["text_config"] and "per_layer_config" not in centroid["text_config"]
    for case in CASES:
        text = FrozenKVMTP.load(assistant_dir / case / "assistant").assistant.config.text
        assert text.global_head_dim == 32 and text.num_kv_shared_layers == text.num_layers
    a = FrozenKVMTP.load(assistant_dir / "assistant-centroid" / "assistant", dtype=jnp.bfloat16).assistant
    assert a.token_ordering.shape == (16, 10) and a.token_ordering.dtype == jnp.int32
    assert {x.dtype for x in jax.tree.leaves(a) if x is not a.token_ordering} == {jnp.dtype(jnp.bfloat16)}


# --- checkpoints -------------------------------------------------------------------------


def _edited(src, dst, tensors=None, config=None):
    shutil.copytree(src, dst)
    if tensors is not None:
        path = dst / "model.safetensors"
        save_file(tensors(load_file(path)), path)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _without(*names):
    return lambda t: {k: v for k, v in t.items() if k not in names}


@pytest.mark.parametrize(
    "case, tensors, config, match",
    [
        ("assistant-tied", _without("pre_projection.weight"), None, r"missing tensor.*pre_projection\.weight"),
        ("assistant-tied", _without("model.layers.1.self_attn.q_norm.weight"), None,
         r"missing tensor.*layers\.1\.self_attn\.q_norm"),
        ("assistant-centroid", _without("masked_embedding.token_ordering"), None,
         r"missing tensor.*masked_embedding\.token_ordering"),
        ("assistant-tied", lambda t: t | {"post_projection.weight": np.zeros((64, 16), np.float32)}, None,
         r"post_projection\.weight' has shape \(64, 16\), expected \(64, 32\)"),
        ("assistant-tied", lambda t: t | {"model.extra.weight": np.zeros((2,), np.float32)}, None,
         r"unexpected tensor.*model\.extra\.weight"),
        ("assistant-centroid", lambda t: t | {"masked_embedding.token_ordering": np.full((160,), 160, np.int64)},
         None, r"token_ordering' must hold token ids in \[0, 160\)"),
        ("assistant-tied", None, lambda c: c.update(model_type="gemma4_text", architectures=["Gemma4ForCausalLM"]),
         "is not a Gemma 4 assistant"),
        ("assistant-tied", None, lambda c: c.pop("text_config"), "missing the field 'text_config'"),
        ("assistant-tied", None, lambda c: c.pop("backbone_hidden_size"), "missing the field 'backbone_hidden_size'"),
        ("assistant-tied", None, lambda c: c["text_config"].update(hidden_size_per_layer_input=8),
         "hidden_size_per_layer_input must be 0"),
        ("assistant-centroid", None, lambda c: c.update(num_centroids=7), "not a multiple of num_centroids 7"),
    ],
)
def test_bad_checkpoints_raise(assistant_dir, tmp_path, case, tensors, config, match):
    bad = _edited(assistant_dir / case / "assistant", tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match=match):
        FrozenKVMTP.load(bad)


def test_tolerated_checkpoint_variants(assistant_dir, tmp_path):
    src = assistant_dir / "assistant-centroid" / "assistant"
    # The multimodal prefix, unused K/V projections and a stored copy of the tied head.
    def variant(t):
        t = {("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v for k, v in t.items()}
        return t | {"model.language_model.layers.0.self_attn.k_proj.weight": np.zeros((32, 32), np.float32),
                    "lm_head.weight": t["model.language_model.embed_tokens.weight"]}

    moved = FrozenKVMTP.load(_edited(src, tmp_path / "prefixed", variant)).assistant
    same = FrozenKVMTP.load(src).assistant
    assert jax.tree.all(jax.tree.map(np.array_equal, moved, same))
    # Centroid tensors without use_ordered_embeddings, or use_ordered_embeddings without them:
    # the tied head (the tensors decide, as transformers builds no centroid head without them).
    off = _edited(src, tmp_path / "off", config=lambda c: c.update(use_ordered_embeddings=False))
    assert FrozenKVMTP.load(off).assistant.centroids is None
    gone = _edited(src, tmp_path / "gone",
                   _without("masked_embedding.centroids.weight", "masked_embedding.token_ordering"))
    assert FrozenKVMTP.load(gone).assistant.centroids is None


# --- targets that do not fit ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,k", [(2048, 32), (16, 4), (9, 9), (7, 1)])
def test_the_centroid_top_k_is_lax_top_k_with_its_ties(n, k, dtype):
    """The centroids the head keeps are ``lax.top_k``'s, in its order, ties (lower index first) included."""
    rng = np.random.default_rng(n + k)
    for scores in (rng.standard_normal((3, n)), rng.integers(0, 4, (3, n)).astype(np.float32)):  # 4 values: ties
        scores = jnp.asarray(scores, dtype)
        np.testing.assert_array_equal(top_k_indices(scores, k), jax.lax.top_k(scores, k)[1])


def _abstract(config):
    """A target of ``config`` as shapes only: what bind and its checks read."""
    return jax.eval_shape(lambda: jspec.init_params(config, jax.random.key(0)))


def _gemma4(**overrides):
    return _abstract(dataclasses.replace(TINY_GEMMA4, **overrides))


def test_bad_targets_and_options_raise():
    target = _gemma4()
    drafter = FrozenKVMTP(jax.jit(init_assistant, static_argnums=0)(
        assistant_config(target.config, hidden_size=32), jax.random.key(0)))
    with pytest.raises(ValueError, match="Gemma 4 targets only, not LlamaForCausalLM"):
        drafter.bind(_abstract(TINY))
    with pytest.raises(ValueError, match="backbone_hidden_size 64 != target hidden_size 96"):
        drafter.bind(_gemma4(hidden_size=96))
    with pytest.raises(ValueError, match="vocab_size 97 != target vocab_size 120"):
        drafter.bind(_gemma4(vocab_size=120, vocab_size_per_layer_input=120))
    only_full = _gemma4(layer_types=(FULL,) * 4)
    with pytest.raises(ValueError, match="no sliding_attention layer with its own K/V"):
        drafter.bind(only_full)
    with pytest.raises(ValueError, match="full_attention head_dim 32 != the target's 64"):
        drafter.bind(_gemma4(global_head_dim=64))
    shared_full = _gemma4(layer_types=(SLIDING, SLIDING, FULL, FULL), num_kv_shared_layers=1)
    assert drafter.bind(shared_full).kv_layers == ((SLIDING, 1), (FULL, 2))
    with pytest.raises(ValueError, match="rope_position must be one of"):
        FrozenKVMTP(drafter.assistant, rope_position="p+1")
    with pytest.raises(ValueError, match="sliding_rows must be one of"):
        FrozenKVMTP(drafter.assistant, sliding_rows=512)
    with pytest.raises(ValueError, match="call drafter.bind"):
        drafter.frozen_kv(target.init_cache(1, 8), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="every layer .* is KV-shared"):
        jspec.forward(drafter.assistant.model, jnp.zeros((1, 2), jnp.int32), target.init_cache(1, 8))
