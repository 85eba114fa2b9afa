"""Training draft heads (jspec.training): the loss goes down, its gradients are right, training
runs the very forward that drafting runs, checkpoints resume exactly, and an exported head loads
and drafts losslessly."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import training
from jspec.drafters import MTP, Eagle3, eagle3, init_mtp_head, mtp
from jspec.drafters.base import PrefillContext, RoundContext
from jspec.execution import with_kernels
from jspec.sampling import SamplingParams
from jspec.training.trainer import sample_anchors, target_batch
from tests.stats import assert_matches_distribution
from tests.test_speculative import SAMPLING_VOCAB, _exact_joint
from tests.tiny import dflash, eagle3_head, tiny_model

ROOT = Path(__file__).resolve().parent.parent

CFG = training.TrainConfig(learning_rate=3e-3, warmup_steps=5, total_steps=40, steps=3, anchors=6)


@pytest.fixture(scope="module")
def setup():
    """A tiny target, an EAGLE-3 head for it (reduced vocabulary) and the target's own greedy text."""
    target = tiny_model(0, num_layers=4)
    drafter = Eagle3(eagle3_head(1, target)).bind(with_kernels(target, "xla"))  # no gradients through kernels
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, target.config.vocab_size, 4)) for _ in range(6)]
    text = [p + o for p, o in zip(prompts, jspec.generate(target, prompts, 20))]
    tokens = jnp.asarray(text, jnp.int32)
    return target, drafter, tokens, jnp.full((len(text),), tokens.shape[1], jnp.int32)


def _mtp(target):
    return MTP(init_mtp_head(target.config, jax.random.key(3), scale=0.3)).bind(with_kernels(target, "xla"))


def assert_a_few_steps_lower_the_loss(drafter, target, tokens, lengths):
    """25 optimizer steps cut the mean loss of the last five steps below 0.7x that of the first five."""
    state = training.init_state(drafter, CFG, jax.random.key(0))
    losses = []
    for _ in range(25):
        state, metrics = training.train_step(state, drafter, target, tokens, lengths, cfg=CFG)
        losses.append(float(metrics["total"]))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_few_steps_lower_the_loss(setup, kind):
    target, drafter, tokens, lengths = setup
    if kind == "mtp":
        drafter = _mtp(target)
    assert_a_few_steps_lower_the_loss(drafter, target, tokens, lengths)


def test_anchors_are_distinct_rows_usable_first():
    """Anchors never repeat a row; a window fills them from its usable rows (all predictions inside)
    before any other, and asking for more anchors than rows is an error."""
    lengths = jnp.array([20, 9, 3], jnp.int32)
    anchors = np.asarray(sample_anchors(jax.random.key(0), lengths, 20, 8, 3))
    assert anchors.shape == (3, 8)
    assert all(len(set(row)) == 8 for row in anchors)
    assert (anchors[0] < 16).all()  # 16 usable rows: all eight among them
    assert sorted(anchors[1][:5]) == [0, 1, 2, 3, 4]  # 5 usable rows, drawn first
    with pytest.raises(ValueError, match="21 anchors per window"):
        sample_anchors(jax.random.key(0), lengths, 20, 21, 3)


def assert_gradient_is_the_central_difference(loss, params, eps=1e-3):
    """``loss``'s gradient at ``params`` along a random direction equals the central difference."""
    grads = jax.grad(loss)(params)
    direction = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape, x.dtype), params)
    numeric = (loss(jax.tree.map(lambda p, d: p + eps * d, params, direction))
               - loss(jax.tree.map(lambda p, d: p - eps * d, params, direction))) / (2 * eps)
    analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    np.testing.assert_allclose(float(analytic), float(numeric), rtol=2e-3)


@pytest.mark.parametrize("soft_labels", [False, True])
def test_gradients_equal_finite_differences(setup, soft_labels):
    target, drafter, tokens, lengths = setup
    batch = target_batch(target, drafter, tokens, lengths, soft_labels=soft_labels)
    batch["anchors"] = sample_anchors(jax.random.key(2), lengths, tokens.shape[1], 4, 3)
    params = training.trainable_params(drafter)

    @jax.jit
    def loss(p):
        return training.loss_fn(p, drafter, batch, steps=3)[0]

    assert_gradient_is_the_central_difference(loss, params)


def test_training_logits_are_the_drafting_logits(setup):
    """Step 0 at row r is what prefill leaves for the first draft after a prompt of r + 1 tokens;
    step j from that anchor is propose's step j when fed the same tokens (here: propose's own
    samples, read back from the exact draft distributions it returns)."""
    target, drafter, tokens, lengths = setup
    anchor, steps = 9, 4
    features = target_batch(target, drafter, tokens[:1], lengths[:1])["features"]
    drafts, probs = _propose(drafter, tokens[:1], features, anchor, steps, SamplingParams(temperature=1.0))
    fed = tokens[:1].at[:, anchor + 2:anchor + 2 + steps].set(drafts)
    first, later = training.step_logits(drafter, fed, features, jnp.array([[anchor]]), steps=steps)
    logits = jnp.concatenate([first[:, anchor][None], later], axis=0)[:, 0]  # [steps, V_d]
    want = jax.nn.softmax(drafter.draft_vocab_to_target(logits), axis=-1)
    np.testing.assert_allclose(np.asarray(want), np.asarray(probs[0]), atol=1e-5)


def _dflash(target):
    return dflash(target, block_size=4, ids=(1, 3)).bind(with_kernels(target, "xla"))


def test_dflash_steps_lower_the_loss_and_gradients_equal_finite_differences(setup):
    """The DFlash objective (anchored blocks, slot weights exp(-(j-1)/gamma)): its gradient against a
    central difference along a random direction, and a few optimizer steps."""
    target, _, tokens, lengths = setup
    drafter = _dflash(target)
    batch = target_batch(target, drafter, tokens, lengths)
    batch["anchors"] = sample_anchors(jax.random.key(1), lengths, tokens.shape[1], 4, drafter.config.block_size - 2)
    params = training.trainable_params(drafter)

    @jax.jit
    def loss(p):
        return training.dflash_loss_fn(p, drafter, batch, gamma=CFG.gamma)[0]

    assert_gradient_is_the_central_difference(loss, params)

    assert_a_few_steps_lower_the_loss(drafter, target, tokens, lengths)


def test_dflash_training_blocks_are_the_drafting_blocks(setup):
    """Anchor a's block in training is what propose drafts after a prompt of a tokens whose first
    sampled token is the token at a: the same logits, through the same forward."""
    target, _, tokens, lengths = setup
    drafter = _dflash(target)
    anchor = 9
    batch = target_batch(target, drafter, tokens[:1], lengths[:1])
    trained = training.dflash_objective.block_logits(drafter, tokens[:1], batch["features"], jnp.array([[anchor]]))
    prefix = tuple(f[:, :anchor] for f in batch["features"])
    state = drafter.prefill(PrefillContext(tokens[:1, :anchor], jnp.array([anchor]), prefix, tokens[:1, anchor]),
                            max_len=64)
    drafting = drafter.block_logits(state, tokens[:1, anchor])
    np.testing.assert_allclose(np.asarray(trained), np.asarray(drafting), rtol=1e-5, atol=1e-5)


def test_a_resumed_run_equals_an_uninterrupted_one(setup, tmp_path):
    target, drafter, tokens, lengths = setup
    data = np.asarray(tokens), np.asarray(lengths)

    def run(state, start, steps):
        batches = training.data.batches(*data, 3, seed=7, start_step=start)
        return training.train(state, drafter, target, batches, cfg=CFG, num_steps=steps)

    straight = run(training.init_state(drafter, CFG, jax.random.key(0)), 0, 6)
    half = run(training.init_state(drafter, CFG, jax.random.key(0)), 0, 3)
    training.save_state(half, tmp_path / "ckpt", metadata=dict(note="test"))
    resumed = training.restore_state(tmp_path / "ckpt", training.init_state(drafter, CFG, jax.random.key(9)))
    assert int(resumed.step) == 3
    resumed = run(resumed, 3, 3)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _propose(drafter, tokens, features, anchor, steps, params):
    """``(drafts [batch, steps], probs)`` of ``propose`` after prefilling ``tokens[:, :anchor + 1]``
    (next token ``tokens[:, anchor + 1]``); ``features``: the target's capture over ``tokens``."""
    batch = tokens.shape[0]
    state = drafter.prefill(PrefillContext(tokens=tokens[:, :anchor + 1], prompt_lengths=jnp.full((batch,), anchor + 1),
                                           features=tuple(f[:, :anchor + 1] for f in features),
                                           next_token=tokens[:, anchor + 1]), max_len=64)
    ctx = RoundContext(history=tokens, lengths=jnp.full((batch,), anchor + 1), root=tokens[:, anchor + 1],
                       features=tuple(f[:, anchor] for f in features), target_kv=None)
    drafts, probs, _ = drafter.propose(state, ctx, num_draft_tokens=steps, params=params, key=jax.random.key(3))
    return drafts, probs


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_an_exported_head_loads_and_drafts_losslessly(setup, tmp_path, kind):
    """save_head -> load gives the trained tensors and the same drafts; speculation with it is lossless."""
    target, drafter, tokens, lengths = setup
    drafter, module = (drafter, eagle3) if kind == "eagle3" else (_mtp(target), mtp)
    state = training.init_state(drafter, CFG, jax.random.key(0))
    for _ in range(5):
        state, _ = training.train_step(state, drafter, target, tokens, lengths, cfg=CFG)
    trained = training.with_params(drafter, state.params)
    module.save_head(trained.head, tmp_path / "head", metadata=dict(steps=5))
    loaded = type(drafter).load(tmp_path / "head").bind(with_kernels(target, "xla"))
    for a, b in zip(jax.tree.leaves(trained.head), jax.tree.leaves(loaded.head), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    features = target_batch(target, drafter, tokens, lengths)["features"]
    drafts = [_propose(d, tokens, features, 9, 4, SamplingParams())[0] for d in (trained, loaded)]
    np.testing.assert_array_equal(*drafts)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    result = jspec.speculative_generate(target, loaded, prompts, 12, num_draft_tokens=3)
    assert result.tokens == jspec.generate(target, prompts, 12)


def test_data_windows_and_draft_vocabulary():
    tokens, lengths = training.windows([[1] * 10, [2] * 3, list(range(20))], 8, min_tokens=3)
    assert tokens.shape == (5, 8) and lengths.tolist() == [8, 3, 8, 8, 4]
    assert tokens[1].tolist() == [2, 2, 2, 0, 0, 0, 0, 0]
    d2t = training.draft_vocabulary([[5, 5, 5, 2, 2, 9], [9, 9, 9, 9]], 2, 12)
    assert (np.arange(2) + np.asarray(d2t)).tolist() == [5, 9]  # the two most frequent ids, sorted
    with pytest.raises(ValueError, match="draft vocabulary size"):
        training.draft_vocabulary([[1]], 13, 12)


def test_chat_prompts_are_thousands_and_none_is_a_held_out_prompt():
    """Distinct everyday requests; none equals a benchmark prompt or shares most of its words."""
    import re

    from jspec.bench.accept import prompt_set

    prompts = training.chat_prompts()
    assert 4000 <= len(prompts) == len(set(prompts)) and not any("{" in p for p in prompts)
    subset = training.chat_prompts(50, seed=1)
    assert subset == training.chat_prompts(50, seed=1) != training.chat_prompts(50, seed=2)
    assert len(subset) == 50 and set(subset) <= set(prompts)

    def words(text):
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    held_out = [words(p["text"]) for p in prompt_set()]
    assert not {" ".join(p["text"].split()) for p in prompt_set()} & {" ".join(p.split()) for p in prompts}
    overlap = max(len(w & h) / len(w | h) for w in map(words, prompts) for h in held_out)
    assert overlap < 0.7


def test_transform_prompts_hand_the_target_a_passage_to_work_on():
    code = training.stdlib_functions(3, seed=1)
    assert len(code) == 3 and all(c.startswith("def ") and 150 <= len(c) <= 800 for c in code)
    assert code == training.stdlib_functions(3, seed=1)  # deterministic for a seed
    prompts = training.transform_prompts(["The river runs to the sea."], code, seed=0)
    assert len(prompts) == 4 and "The river runs to the sea." in prompts[0] and "```" not in prompts[0]
    assert all(c in p and "```python" in p for c, p in zip(code, prompts[1:]))


def test_a_trained_head_samples_the_exact_target_distribution():
    """A head trained a few steps (reduced vocabulary) drafts for rejection sampling: the output
    still has exactly the target's distribution (chi-square on a tiny vocabulary)."""
    target = tiny_model(11, vocab_size=SAMPLING_VOCAB, num_layers=4)
    drafter = Eagle3(eagle3_head(12, target, draft_vocab=6)).bind(with_kernels(target, "xla"))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, SAMPLING_VOCAB, (4, 16)), jnp.int32)
    lengths = jnp.full((4,), 16, jnp.int32)
    state = training.init_state(drafter, CFG, jax.random.key(0))
    for _ in range(5):
        state, _ = training.train_step(state, drafter, target, tokens, lengths, cfg=CFG)
    trained = training.with_params(drafter, state.params)  # speculative_generate binds it to the target again
    prompt, sampling = [1, 5, 1, 5, 2], dict(temperature=1.0)
    result = jspec.speculative_generate(target, trained, [prompt] * 6_000, 3, num_draft_tokens=2,
                                        key=jax.random.key(4), **sampling)
    index = (np.array(result.tokens) * SAMPLING_VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(target, prompt, SamplingParams(**sampling)))


def test_the_shipped_smollm2_head_drafts_losslessly_on_the_real_model(smollm2_gguf):
    from jspec.text import Tokenizer

    head = Eagle3.load(ROOT / "checkpoints" / "smollm2-eagle3", dtype=jnp.float32)
    assert head.head.config.draft_vocab_size == 8192 and "data" in _config_metadata()
    target = jspec.io.load_model(smollm2_gguf, dtype=jnp.float32)
    tokenizer = Tokenizer.from_pretrained(smollm2_gguf)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}]),
               tokenizer.encode("def add(a, b):\n    return")]
    result = jspec.speculative_generate(target, head, prompts, 24, num_draft_tokens=4)
    assert result.tokens == jspec.generate(target, prompts, 24)
    assert (result.stats["mean_acceptance_length"] > 1.0).any()  # it drafts something the target keeps


def _config_metadata() -> dict:
    import json

    return json.loads((ROOT / "checkpoints" / "smollm2-eagle3" / "config.json").read_text())["jspec"]
