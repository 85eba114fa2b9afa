"""DFlash: the published checkpoint layout loads, the block forward and the rounds equal the
authors' loop written out in torch (tests/hf_reference/dflash.py), speculation is lossless on every
target family, chains and trees (from the block's per-slot distributions), and bad input is named
before any compute."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.drafters import DFlash
from jspec.drafters.base import CommitContext, PrefillContext, RoundContext
from jspec.drafters.dflash import load_head, save_head
from jspec.drafters.dflash.head import init_context_kv
from jspec.engine import pad_prompts, prefill
from jspec.models import forward
from jspec.sampling import SamplingParams
from jspec.speculative import speculative_round, start
from tests.hidden_drafters import check_greedy_lossless
from tests.tiny import dflash, tiny_gemma4, tiny_model

# --- against the authors' loop -----------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("k",))
def _round(target, drafter, state, *, k):
    return speculative_round(target, drafter, state, num_draft_tokens=k, params=SamplingParams(), eos_ids=(),
                             max_new_tokens=jnp.int32(1000))


@jax.jit
def _block_logits(drafter, draft_state, root):
    return drafter.block_logits(draft_state, root)


@pytest.mark.parametrize("case", ["dflash", "dflash-v5", "dflash-sliding"])
def test_rounds_equal_the_authors_loop(hf_dflash, case):
    """Round for round: the draft's block logits, the drafts accepted and the tokens emitted equal the
    reference's, every round reading the context the earlier rounds committed."""
    target = jspec.load_hf(hf_dflash / "target")
    drafter = DFlash.load(hf_dflash / case).bind(target)
    ref = np.load(hf_dflash / case / "reference.npz")
    info = json.loads((hf_dflash / "prompts.json").read_text())
    assert drafter.config.target_layer_ids == tuple(ref["target_layer_ids"])
    k = drafter.config.block_size - 1
    for i, prompt in enumerate(info["prompts"]):
        tokens, lengths = pad_prompts([prompt])
        state = start(target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                      params=SamplingParams(), eos_ids=(), capacity=256, max_len=256)
        per_round = ref[f"per_round_{i}"]
        for r, want in enumerate(per_round):
            np.testing.assert_allclose(_block_logits(drafter, state.draft_state, state.root)[0], ref[f"logits_{i}"][r],
                                       rtol=1e-4, atol=1e-4)
            accepted = int(state.accepted[0])
            state = _round(target, drafter, state, k=k)
            assert int(state.accepted[0]) - accepted + 1 == want, f"prompt {i}, round {r}"
        emitted = np.asarray(state.history[0, len(prompt):len(prompt) + len(ref[f"tokens_{i}"])])
        np.testing.assert_array_equal(emitted, ref[f"tokens_{i}"])


def test_loads_either_rope_form_and_prefix_and_saves_back_bit_exactly(hf_dflash, tmp_path):
    head = load_head(hf_dflash / "dflash-v5")
    assert head.config.layer.rope_theta == 5000.0 and head.config.target_layer_ids == (1,)  # the default ids
    sliding = load_head(hf_dflash / "dflash-sliding")
    assert sliding.config.window(0) == 6 and sliding.config.window(1) is None
    for i, head in enumerate((head, sliding)):
        save_head(head, tmp_path / f"out{i}")
        again = load_head(tmp_path / f"out{i}")
        assert again.config == head.config
        for a, b in zip(jax.tree.leaves(head), jax.tree.leaves(again)):
            np.testing.assert_array_equal(a, b)


# --- lossless on every family --------------------------------------------------------------

GREEDY_CASES = [  # (seed, target, batch, k, eos)
    (0, "llama", 1, 4, False),
    (1, "qwen3", 3, 2, True),
    (2, "qwen2", 4, 1, False),
    (3, "gemma4", 3, 4, True),
]


def _target(kind, seed):
    if kind == "gemma4":
        return tiny_gemma4(seed)
    flags = dict(llama={}, qwen2=dict(qkv_bias=True), qwen3=dict(qk_norm=True, head_dim=32))[kind]
    return tiny_model(seed, **flags)


@pytest.mark.parametrize("seed, kind, batch, k, eos", GREEDY_CASES)
def test_greedy_speculative_equals_greedy(seed, kind, batch, k, eos):
    target = _target(kind, seed)
    drafter = dflash(target, ids=(0, target.config.num_layers - 1), seed=seed + 10)
    check_greedy_lossless(target, drafter, seed, batch, k, eos)


# (seed, target, batch, topk, depth, nodes); a 12-token vocabulary makes accepted paths common.
TREE_CASES = [
    (0, "llama", 1, 2, 3, 5),
    (1, "qwen3", 3, 3, 2, 6),
    (2, "gemma4", 2, 2, 4, 3),  # fewer nodes than levels: a path holds at most 3 drafts
]


@pytest.mark.parametrize("seed, kind, batch, topk, depth, nodes", TREE_CASES)
def test_greedy_tree_speculative_equals_greedy(seed, kind, batch, topk, depth, nodes):
    qwen3 = dict(qk_norm=True, head_dim=32) if kind == "qwen3" else {}
    target = tiny_gemma4(seed) if kind == "gemma4" else tiny_model(seed, vocab_size=12, **qwen3)
    drafter = dflash(target, ids=(0, target.config.num_layers - 1), seed=seed + 20)
    prompts = [list(np.random.default_rng(seed + b).integers(0, target.config.vocab_size, 3 + 2 * b))
               for b in range(batch)]
    result = jspec.speculative_generate(target, drafter, prompts, 12, num_draft_tokens=nodes, topk=topk, depth=depth)
    assert result.tokens == jspec.generate(target, prompts, 12)
    assert (result.stats["accepted"] <= result.stats["rounds"] * min(depth, nodes)).all()
    if target.config.vocab_size == 12:
        assert result.stats["accepted"].sum() > 0  # some rounds commit along a tree's path


def test_sampled_tree_speculative_has_the_target_distribution():
    from tests.stats import assert_matches_distribution
    from tests.test_speculative import SAMPLING_VOCAB, _exact_joint

    target = tiny_model(11, vocab_size=SAMPLING_VOCAB)
    drafter = dflash(target, block_size=4, seed=14)
    prompt, sampling = [1, 5, 1, 5, 2], dict(temperature=0.8, top_k=5)
    result = jspec.speculative_generate(target, drafter, [prompt] * 6_000, 3, num_draft_tokens=5, topk=3, depth=2,
                                        key=jax.random.key(5), **sampling)
    index = (np.array(result.tokens) * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(target, prompt, SamplingParams(**sampling)))


@pytest.mark.parametrize("num_accepted", [(0, 2, 4), (4, 1, 0)])
def test_commit_leaves_the_context_a_prefill_of_the_accepted_tokens_would(num_accepted):
    """After propose, verify and commit with ``a`` drafts accepted, the draft's context rows equal a
    fresh prefill over prompt + first token + the ``a`` drafts: the block's rows and the rejected
    drafts' rows leave nothing behind."""
    target = tiny_model(4, qk_norm=True)
    drafter = dflash(target, ids=(1, 0)).bind(target)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 97, size=n)) for n in (5, 11, 3)]
    tokens, lengths = pad_prompts(prompts)
    params, k = SamplingParams(), 4
    state = start(target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0), params=params,
                  eos_ids=(), capacity=64, max_len=64)
    base = state.target_kv.lengths
    ctx = RoundContext(state.history, base, state.root, state.features, state.target_kv)
    _, _, dstate = drafter.propose(state.draft_state, ctx, num_draft_tokens=k, params=params, key=jax.random.key(1))
    drafts = jnp.asarray(rng.integers(0, 97, size=(3, k)), jnp.int32)
    verify_tokens = jnp.concatenate([state.root[:, None], drafts], axis=1)
    _, features, _ = forward(target, verify_tokens, state.target_kv, capture=drafter.capture)
    bonus = jnp.asarray(rng.integers(0, 97, size=3), jnp.int32)
    committed = drafter.commit(dstate, CommitContext(base, verify_tokens, jnp.asarray(num_accepted), bonus, features))

    first = np.asarray(state.root)
    seqs = [p + [int(first[b])] + np.asarray(drafts[b, :num_accepted[b]]).tolist() for b, p in enumerate(prompts)]
    s_tokens, s_lengths = (jnp.asarray(x) for x in pad_prompts(seqs))
    _, s_features, _ = prefill(target, s_tokens, s_lengths, target.init_cache(3, 64), capture=drafter.capture)
    scratch = drafter.prefill(PrefillContext(s_tokens, s_lengths, s_features, bonus), max_len=64)
    np.testing.assert_array_equal(committed.lengths, np.asarray(base) + np.asarray(num_accepted) + 1)
    np.testing.assert_array_equal(committed.lengths, scratch.lengths)
    for layer in range(len(committed.k)):
        for b, n in enumerate(np.asarray(scratch.lengths)):
            for got, want in ((committed.k, scratch.k), (committed.v, scratch.v)):
                np.testing.assert_allclose(got[layer][b, :, :n], want[layer][b, :, :n], rtol=1e-4, atol=1e-5)


# --- bad input -----------------------------------------------------------------------------


def _config_json(hf_dflash, tmp_path, edit):
    case = tmp_path / "case"
    shutil.copytree(hf_dflash / "dflash", case)
    cfg = json.loads((case / "config.json").read_text())
    edit(cfg)
    (case / "config.json").write_text(json.dumps(cfg))
    return case


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(block_size=1), "block_size must be >= 2"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.update(layer_types=["sliding_attention"] * 2), "sliding_window >= 1"),
    (lambda c: c.update(layer_types=["chunked_attention"] * 2, sliding_window=4), "layer_types"),
    (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not a DFlash config"),
])
def test_bad_checkpoints_raise(hf_dflash, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        DFlash.load(_config_json(hf_dflash, tmp_path, edit))


def test_bad_targets_and_options_raise():
    target = tiny_model(0)
    prompts = [[1, 2, 3]]
    cases = [
        (dflash(target, ids=(0, 2)), {}, "target_layer_ids"),  # a 2-layer target
        (dflash(tiny_model(0, hidden_size=32, num_heads=2)), {}, "hidden_size"),
        (dflash(tiny_model(0, vocab_size=50)), {}, "vocab_size"),
        (dflash(target, block_size=4), dict(num_draft_tokens=4), "exceeds the 3 drafts"),
        (dflash(target, block_size=4), dict(num_draft_tokens=6, topk=2, depth=4), "depth=4 exceeds the 3 drafts"),
    ]
    for drafter, options, message in cases:
        with pytest.raises(ValueError, match=message):
            jspec.speculative_generate(target, drafter, prompts, 4, **options)
    unbound = dflash(target)
    with pytest.raises(ValueError, match="bind"):
        unbound.block_logits(init_context_kv(unbound.head, 1, 8), jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="mask_token_id"):
        dataclasses.replace(unbound.config, mask_token_id=97)
