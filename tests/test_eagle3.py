"""EAGLE-3 drafter: head parity with a torch implementation of the published formula, greedy
losslessness, catch-up correctness, checkpoint validation."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jspec
from jspec.drafters import Eagle3, Eagle3Head
from jspec.drafters.base import RoundContext
from jspec.engine import pad_prompts
from jspec.sampling import SamplingParams
from jspec.speculative import start
from tests import hf_oracle
from tests.hidden_drafters import check_catch_up, check_greedy_lossless, check_parity
from tests.tiny import eagle3_head, tiny_model


@pytest.fixture(scope="module")
def eagle3_dir(tmp_path_factory):
    return hf_oracle.once_per_run(tmp_path_factory, "hf_eagle3", lambda out: hf_oracle.make("eagle3", out))


@pytest.mark.parametrize("case", ["eagle3", "eagle3-own"])
def test_head_parity_with_torch_reference(eagle3_dir, case):
    target = jspec.load_hf(eagle3_dir / "target")
    drafter = Eagle3.load(eagle3_dir / case)
    assert isinstance(drafter.head, Eagle3Head)
    ref = np.load(eagle3_dir / case / "reference.npz")
    assert drafter.bind(target).capture == jspec.Capture(residuals=tuple(ref["aux_layers"].tolist()))
    check_parity(target, drafter, eagle3_dir / case)


def test_load_hf_on_a_head_is_a_deprecated_alias(eagle3_dir):
    with pytest.warns(DeprecationWarning, match="Eagle3.load"):
        head = jspec.load_hf(eagle3_dir / "eagle3")
    assert isinstance(head, Eagle3Head)
    assert jax.tree.all(jax.tree.map(np.array_equal, head, Eagle3.load(eagle3_dir / "eagle3").head))
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        Eagle3.load(eagle3_dir / "target")


# (seed, batch, k, eos, target overrides, head options)
GREEDY_CASES = [
    (0, 1, 1, False, dict(num_layers=4), dict()),  # default aux layers [2, 2, 1], d2t
    (1, 3, 2, True, dict(num_layers=3, qkv_bias=True), dict(hidden=48, own_embed=True, fc_bias=True, aux=(0, 1, 2))),
    (2, 4, 5, False, dict(num_layers=3, vocab_size=12, tie_word_embeddings=True), dict(draft_vocab=8, aux=(1, 1, 2))),
]


@pytest.mark.parametrize("seed, batch, k, eos, overrides, options", GREEDY_CASES)
def test_greedy_speculative_equals_greedy(seed, batch, k, eos, overrides, options):
    target = tiny_model(seed, **overrides)
    check_greedy_lossless(target, Eagle3(eagle3_head(seed + 50, target, **options)), seed, batch, k, eos)


def test_catch_up_equals_draft_from_scratch():
    target = tiny_model(5, num_layers=4)
    check_catch_up(target, Eagle3(eagle3_head(6, target, fc_bias=True)))


def test_draft_steps_are_unrolled():
    """propose lowers without a loop: its k - 1 draft steps are one layer each, unrolled, so no loop
    bookkeeping runs between them (on the H100 at k = 4: 60 kernels instead of 70)."""
    target = tiny_model(7, num_layers=4)
    drafter = Eagle3(eagle3_head(8, target)).bind(target)
    tokens, lengths = pad_prompts([[1, 2, 3], [4, 5]])
    state = start(target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                  params=SamplingParams(), eos_ids=(), capacity=32, max_len=32)
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)

    def propose(draft_state, ctx):
        return drafter.propose(draft_state, ctx, num_draft_tokens=4, params=SamplingParams(), key=jax.random.key(1))

    assert "stablehlo.while" not in jax.jit(propose).lower(state.draft_state, ctx).as_text()


def _copy(src, dst, *, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(cfg)))
    if tensors is not None:
        path = dst / "model.safetensors"
        save_file(tensors(load_file(path)), path)
    return dst


def test_bad_checkpoints_raise(eagle3_dir, tmp_path):
    target = jspec.load_hf(eagle3_dir / "target")
    good = eagle3_dir / "eagle3"

    def drop(name):
        return lambda t: {k: v for k, v in t.items() if k != name}

    bad = _copy(good, tmp_path / "no-d2t", tensors=drop("d2t"))
    with pytest.raises(ValueError, match="missing 'd2t'"):
        Eagle3.load(bad)
    bad = _copy(good, tmp_path / "no-norm", tensors=drop("midlayer.hidden_norm.weight"))
    with pytest.raises(ValueError, match="missing tensor.*midlayer.hidden_norm.weight"):
        Eagle3.load(bad)
    bad = _copy(good, tmp_path / "extra", tensors=lambda t: t | {"fc2.weight": t["fc.weight"]})
    with pytest.raises(ValueError, match="unexpected tensor.*fc2.weight"):
        Eagle3.load(bad)
    bad = _copy(good, tmp_path / "fc-shape", tensors=lambda t: t | {"fc.weight": t["fc.weight"][:, :100]})
    with pytest.raises(ValueError, match="'fc.weight' has shape"):
        Eagle3.load(bad)
    # A head trained for a 48-wide target: loads, but not for this 64-wide target.
    bad = _copy(good, tmp_path / "fc-width", config=lambda c: c | {"target_hidden_size": 48},
                tensors=lambda t: t | {"fc.weight": np.ascontiguousarray(t["fc.weight"][:, :144])})
    with pytest.raises(ValueError, match="wrong fc width"):
        jspec.speculative_generate(target, Eagle3.load(bad), [[1, 2]], 4)
    # Captured layer ids outside the target (3 layers).
    bad = _copy(good, tmp_path / "ids", config=lambda c: c | {"aux_layers_hf_index": [0, 1, 7]})
    with pytest.raises(ValueError, match=r"layer ids \[0, 1, 7\] are out of range for a target with 3 layers"):
        Eagle3.load(bad).bind(target)
    bad = _copy(good, tmp_path / "neg", config=lambda c: c | {"eagle_aux_hidden_state_layer_ids": [-1, 1, 2]})
    with pytest.raises(ValueError, match="out of range"):
        Eagle3.load(bad)
    bad = _copy(good, tmp_path / "vocab", config=lambda c: c | {"vocab_size": 170},
                tensors=lambda t: t | {"t2d": np.zeros(170, bool)})
    with pytest.raises(ValueError, match="vocab_size 170 != target vocab_size 160"):
        Eagle3.load(bad).bind(target)
