"""FrozenKVMTP inside speculation rounds: greedy output equals plain greedy (targets with and
without KV-shared layers, k_eq_v on and off, both heads, both options, ragged batches), sampled
output has the target's distribution with either head, the target cache is only read (no write
into it or any view of it in propose's program; rows past the lengths may hold anything), and the
seed step runs inside the draft scan."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr, Var

import jspec
from jspec.drafters import FrozenKVMTP, assistant_config, init_assistant
from jspec.drafters.base import RoundContext
from jspec.engine import pad_prompts
from jspec.kv import KVCache
from jspec.models.gemma4 import FULL, SLIDING
from jspec.sampling import SamplingParams, probabilities
from jspec.speculative import start
from tests.hidden_drafters import check_greedy_lossless
from tests.stats import assert_matches_distribution
from tests.tiny import tiny_gemma4


@functools.partial(jax.jit, static_argnums=0)
def _init(config, key):
    return init_assistant(config, key, scale=0.3)


def _drafter(target, seed, *, centroids=None, layer_types=(SLIDING, FULL, SLIDING), **options):
    """A random assistant for ``target``: ``centroids`` = (num_centroids, top_k) for the centroid head."""
    num_centroids, top_k = centroids or (None, 32)
    config = assistant_config(target.config, hidden_size=32, layer_types=layer_types, num_heads=2,
                              num_centroids=num_centroids, centroid_top_k=top_k)
    return FrozenKVMTP(_init(config, jax.random.key(seed)), **options)


# (seed, batch, k, eos, target overrides, centroid head, drafter options)
GREEDY_CASES = [
    # KV-shared layers (one per type), k_eq_v, per-layer embeddings (tests/tiny.py TINY_GEMMA4)
    (0, 1, 1, False, dict(), None, dict()),
    # no KV sharing (which transformers cannot run with an assistant), k_eq_v off, the centroid head
    (1, 3, 3, True, dict(num_kv_shared_layers=0, attention_k_eq_v=False, num_global_kv_heads=2, vocab_size=96,
                         vocab_size_per_layer_input=96), (8, 2), dict(rope_position="last_committed")),
    (2, 2, 6, False, dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0), None,
     dict(rope_position="last_committed", sliding_rows="window")),
]


@pytest.mark.parametrize("seed, batch, k, eos, overrides, centroids, options", GREEDY_CASES)
def test_greedy_speculative_equals_greedy(seed, batch, k, eos, overrides, centroids, options):
    target = tiny_gemma4(seed, **overrides)
    check_greedy_lossless(target, _drafter(target, seed + 50, centroids=centroids, **options), seed, batch, k, eos)


# --- sampling ------------------------------------------------------------------------------

VOCAB = 8
NUM_SAMPLES = 6_000
PROMPT = [1, 5, 1, 5, 2, 7, 3]


@pytest.fixture(scope="module")
def small_vocab():
    """A target over 8 tokens and its last-row logits after ``PROMPT`` + every continuation of
    0, 1 and 2 tokens (``[8 ** depth, 8]`` per depth), for exact joint distributions."""
    target = tiny_gemma4(11, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB)
    logits = [np.asarray(jspec.score(target, np.array([PROMPT + list(p) for p in
                                                        itertools.product(range(VOCAB), repeat=depth)]))[:, -1])
              for depth in range(3)]
    return target, logits


def _exact_joint(logits, params):
    """P(the first 3 new tokens) by enumeration: ``[vocab ** 3]``."""
    joint = np.ones((1,))
    for depth_logits in logits:
        probs = np.asarray(probabilities(jnp.asarray(depth_logits), params), np.float64)
        joint = (joint.reshape(-1, 1) * probs).ravel()
    return joint


@pytest.mark.parametrize(
    "centroids, sampling",
    [(None, dict(temperature=1.0)), ((4, 2), dict(temperature=0.9, top_k=6))],  # centroid: q is 0 on 4 of 8
)
def test_sampled_speculative_has_the_target_distribution(small_vocab, centroids, sampling):
    target, logits = small_vocab
    drafter = _drafter(target, 12, centroids=centroids)
    result = jspec.speculative_generate(
        target, drafter, [PROMPT] * NUM_SAMPLES, 3, num_draft_tokens=2, key=jax.random.key(3), **sampling
    )
    tokens = np.array(result.tokens)
    assert result.stats["accepted"].sum() > 0
    index = (tokens * VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(logits, SamplingParams(**sampling)))


def test_sampled_drafts_come_from_the_returned_distribution(small_vocab):
    """Centroid head: q is exactly zero off the candidates (never the min - 1 fill)."""
    target, _ = small_vocab
    drafter = _drafter(target, 5, centroids=(4, 1)).bind(target)
    state = _start(target, drafter, [PROMPT])
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
    params = SamplingParams(temperature=1.0)
    tokens, probs, _ = jax.jit(jax.vmap(lambda key: drafter.propose((), ctx, num_draft_tokens=1, params=params,
                                                                    key=key)))(jax.random.split(jax.random.key(1), 2000))
    probs = np.asarray(probs[:, 0, 0])  # [2000, vocab]: one context, one distribution
    np.testing.assert_array_equal(probs, np.broadcast_to(probs[0], probs.shape))
    assert (probs[0] == 0).sum() == VOCAB - VOCAB // 4  # q lives on one cluster of two tokens
    assert_matches_distribution(np.asarray(tokens[:, 0, 0]), probs[0])


# --- the target cache is only read -----------------------------------------------------------


def _start(target, drafter, prompts, max_len=64):
    tokens, lengths = pad_prompts(prompts)
    return jax.jit(functools.partial(start, params=SamplingParams(), eos_ids=(), capacity=max_len, max_len=max_len))(
        target, drafter, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0)
    )


@pytest.fixture(scope="module")
def prefilled():
    """A target after the prefill of a ragged batch (the state does not depend on the assistant)."""
    target = tiny_gemma4(6)
    state = _start(target, _drafter(target, 7).bind(target), [[5, 17, 42, 8, 9, 1, 2, 3], [7, 1], [3] * 11])
    return target, state


@pytest.mark.parametrize("centroids", [None, (97, 3)])
def test_propose_reads_the_target_cache_and_nothing_past_its_lengths(prefilled, centroids):
    target, state = prefilled
    drafter = _drafter(target, 7, centroids=centroids).bind(target)
    kv = state.target_kv

    @jax.jit
    def round_logits(kv):
        ctx = RoundContext(state.history, kv.lengths, state.root, state.features, kv)
        tokens, _, _ = drafter.propose((), ctx, num_draft_tokens=3, params=SamplingParams(), key=jax.random.key(0))
        view, token, hidden, logits = drafter.frozen_kv(kv, kv.lengths), state.root, state.features[0], []
        for step in range(3):
            y, hidden = drafter.step(view, token, hidden)
            logits.append(drafter.head_logits(y))
            token = tokens[:, step]
        return tokens, jnp.stack(logits, 1)

    tokens, logits = round_logits(kv)

    past = jnp.arange(kv.max_len)[None, None, :, None] >= kv.lengths[:, None, None, None]
    poisoned = jax.tree.map(lambda buf: jnp.where(past, jnp.nan, buf), (kv.k, kv.v))
    poisoned_tokens, poisoned_logits = round_logits(type(kv)(*poisoned, kv.lengths))
    np.testing.assert_array_equal(poisoned_tokens, tokens)
    np.testing.assert_array_equal(poisoned_logits, logits)
    assert np.isfinite(np.asarray(logits)).all()

    # No write of any kind in the program of a greedy propose: the cache is an input only. Sampled
    # (the centroid head scatters its candidates' logits): no write into the cache or a view of it.
    def propose(kv, params=SamplingParams()):
        ctx = RoundContext(state.history, kv.lengths, state.root, state.features, kv)
        return drafter.propose((), ctx, num_draft_tokens=3, params=params, key=jax.random.key(0))

    assert not {p for p in _primitives(jax.make_jaxpr(propose)(kv).jaxpr) if _is_write(p)}
    assert _cache_writes(functools.partial(propose, params=SamplingParams(temperature=1.0)), kv)[0] == []


def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def _primitives(jaxpr) -> set[str]:
    """Every primitive of ``jaxpr``, nested ones included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in _sub_jaxprs(eqn.params):
            names |= _primitives(sub)
    return names


def _is_write(primitive: str) -> bool:
    return primitive == "dynamic_update_slice" or primitive.startswith("scatter")


# Primitives whose output holds (some of) their input's elements unchanged: a view of a cache is
# still the cache. Arithmetic ends a view (attention scores are not the cache).
_VIEWS = frozenset({"slice", "dynamic_slice", "gather", "reshape", "transpose", "squeeze", "expand_dims",
                    "broadcast_in_dim", "convert_element_type", "concatenate", "select_n", "pad", "rev", "copy",
                    "copy_p"})


def _writes_into(jaxpr, views) -> tuple[list[str], set]:
    """The writes (dynamic_update_slice, scatter*) in ``jaxpr``, nested ones included, whose
    destination is one of the variables ``views`` or a slice, gather, reshape, cast, ... of one;
    and the variables that are such views. A sub-program (jit, scan) takes its equation's operands
    in order (a while's / cond's the trailing ones)."""
    views, writes = set(views), []
    for eqn in jaxpr.eqns:
        hits = [isinstance(v, Var) and v in views for v in eqn.invars]
        if _is_write(eqn.primitive.name) and hits[0]:
            writes.append(eqn.primitive.name)
        if eqn.primitive.name in _VIEWS and any(hits):
            views.update(eqn.outvars)
        for sub in _sub_jaxprs(eqn.params):
            n = min(len(sub.invars), len(hits))
            inner = {v for v, hit in zip(sub.invars[len(sub.invars) - n:], hits[len(hits) - n:]) if hit}
            sub_writes, sub_views = _writes_into(sub, inner)
            writes += sub_writes
            views.update(o for o, v in zip(eqn.outvars, sub.outvars) if isinstance(v, Var) and v in sub_views)
    return writes, views


def _cache_writes(fn, kv) -> tuple[list[str], set[str]]:
    """The writes into ``kv``'s K/V buffers (or views of them) in the program of ``fn(kv)``, and
    every primitive of that program."""
    jaxpr = jax.make_jaxpr(lambda k, v: fn(type(kv)(k, v, kv.lengths)))(kv.k, kv.v).jaxpr
    return _writes_into(jaxpr, jaxpr.invars)[0], _primitives(jaxpr)


def test_the_write_check_sees_a_write_into_a_slice_of_the_cache():
    """What the tests above and below rely on: a write into a view of the cache is found through
    jit and scan, one into a copy made by arithmetic is not."""
    kv = KVCache.zeros(2, 3, 2, 16, 8, jnp.float32)
    into_view = lambda kv: jax.jit(lambda k: k.astype(jnp.bfloat16)[:, :, :4].at[:, :, 0].set(0))(kv.k[0])  # noqa: E731

    def in_a_scan(kv):
        return jax.lax.scan(lambda c, _: (jax.lax.dynamic_update_slice_in_dim(c, c[:, :, :1], 3, axis=2), None),
                            kv.v[-1], None, length=2)[0]

    assert _cache_writes(into_view, kv)[0] == ["scatter"]
    assert _cache_writes(in_a_scan, kv)[0] == ["dynamic_update_slice"]
    assert _cache_writes(lambda kv: (kv.k[0] * 2).at[:, :, 0].set(0), kv)[0] == []  # a new array, not the cache


# --- the seed is iteration 0 of the draft scan -------------------------------------------------


def test_the_seed_step_runs_inside_the_one_draft_scan(prefilled):
    """propose's program: one scan of k iterations holds every assistant forward (the matmuls);
    outside it, nothing but the RoPE tables and key splitting; one while loop once compiled (a rolled
    scan: unrolled, the assistant's propose ran ~3x slower on the H100)."""
    target, state = prefilled
    drafter = _drafter(target, 9).bind(target)
    ctx = RoundContext(state.history, state.target_kv.lengths, state.root, state.features, state.target_kv)
    k = 4

    def propose(c):
        return drafter.propose((), c, num_draft_tokens=k, params=SamplingParams(), key=jax.random.key(0))

    jaxpr = jax.make_jaxpr(propose)(ctx).jaxpr
    (scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan"]
    outside = set().union(*(_primitives_of(eqn) for eqn in jaxpr.eqns if eqn is not scan))
    assert not {"dot_general", "scan", "while"} & outside
    assert scan.params["length"] == k  # k drafts, k assistant forwards: the seed is iteration 0
    assert "dot_general" in _primitives(scan.params["jaxpr"].jaxpr)
    lowered = jax.jit(propose).lower(ctx)
    assert lowered.as_text().count("stablehlo.while") == 1
    assert lowered.compile().as_text().count(" while(") == 1  # XLA keeps the one loop


def _primitives_of(eqn) -> set[str]:
    return {eqn.primitive.name}.union(*(_primitives(sub) for sub in _sub_jaxprs(eqn.params)))


# --- trees (topk > 1) ----------------------------------------------------------------------


@pytest.mark.parametrize("seed, batch, overrides, centroids, tree", [
    (20, 2, dict(), None, dict(topk=2, depth=3, num_draft_tokens=5)),  # KV-shared target, tied head
    (21, 3, dict(num_kv_shared_layers=0, attention_k_eq_v=False, num_global_kv_heads=2, vocab_size=96,
                 vocab_size_per_layer_input=96), (8, 2), dict(topk=3, depth=2, num_draft_tokens=6)),
])
def test_greedy_tree_speculative_equals_greedy(seed, batch, overrides, centroids, tree):
    target = tiny_gemma4(seed, **overrides)
    prompts = [list(p) for p in np.random.default_rng(seed).integers(0, target.config.vocab_size, (batch, 9))]
    prompts[0] = prompts[0][:4]  # ragged
    result = jspec.speculative_generate(target, _drafter(target, seed + 50, centroids=centroids), prompts, 14,
                                        **tree)
    assert result.tokens == jspec.generate(target, prompts, 14)


def test_tree_branches_read_the_target_cache_and_nothing_past_its_lengths(prefilled):
    """The branches of a tree see the committed rows only (NaN past them changes nothing) and
    nothing in propose_tree's program writes into the target cache or a view of it (the tree's
    own tensors are written: a plain no-scatter check as for chains cannot tell them apart)."""
    target, state = prefilled
    drafter = _drafter(target, 7).bind(target)
    kv = state.target_kv
    shape = jspec.tree.TreeShape(topk=2, depth=3, num_nodes=6)

    def propose_tree(kv):
        ctx = RoundContext(state.history, kv.lengths, state.root, state.features, kv)
        tree, _ = drafter.propose_tree((), ctx, shape=shape, params=SamplingParams(), key=jax.random.key(0))
        return tree

    writes, primitives = _cache_writes(propose_tree, kv)
    assert writes == [] and any(_is_write(p) for p in primitives)  # the tree's own tensors are written
    tree = jax.jit(propose_tree)(kv)
    past = jnp.arange(kv.max_len)[None, None, :, None] >= kv.lengths[:, None, None, None]
    poisoned = jax.tree.map(lambda buf: jnp.where(past, jnp.nan, buf), (kv.k, kv.v))
    poisoned_tree = jax.jit(propose_tree)(type(kv)(*poisoned, kv.lengths))
    assert jax.tree.all(jax.tree.map(np.array_equal, poisoned_tree, tree))


@pytest.mark.parametrize("centroids", [None, (4, 2)])
def test_sampled_tree_speculative_has_the_target_distribution(small_vocab, centroids):
    target, logits = small_vocab
    result = jspec.speculative_generate(target, _drafter(target, 12, centroids=centroids), [PROMPT] * NUM_SAMPLES, 3,
                                        num_draft_tokens=4, topk=2, depth=2, temperature=1.0, key=jax.random.key(5))
    assert result.stats["accepted"].sum() > 0
    index = (np.array(result.tokens) * VOCAB ** np.arange(2, -1, -1)).sum(axis=1)
    assert_matches_distribution(index, _exact_joint(logits, SamplingParams(temperature=1.0)))
