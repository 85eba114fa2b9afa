"""Checks of tensor-parallel placement and decoding on several devices, run by test_sharding.py in a
subprocess with forced host devices: ``python -m tests.sharded_checks NAME`` (exit 0: passed)."""

from __future__ import annotations

import collections
import dataclasses
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jspec
from jspec.drafters import MTP, DraftModel, Eagle3, FrozenKVMTP, NGram, assistant_config, init_assistant, init_mtp_head
from jspec.models.gemma4 import FULL, SLIDING
from jspec.parallel import plain_order
from tests.tiny import TINY, TINY_GEMMA4, eagle3_head

DEVICES = 4
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1]]  # ragged
CONFIG = dataclasses.replace(TINY, vocab_size=128, num_kv_heads=4)  # vocab and KV heads divide over 4 devices


def _target(config=CONFIG):
    return jspec.init_params(config, jax.random.key(0), scale=0.3)


def _spec(array):
    return array.sharding.spec


def check_placements():
    """Megatron placement of every weight, the cache over KV heads, replicated where nothing divides."""
    mesh = jspec.tensor_parallel_mesh()
    assert mesh.shape["tp"] == DEVICES == jax.device_count()
    model = jspec.shard(_target(dataclasses.replace(CONFIG, qkv_bias=True)), mesh)
    layer = model.layers[0]
    assert _spec(layer.qkv) == P(None, "tp") and _spec(layer.qkv_bias) == P("tp")
    assert _spec(layer.gate_up) == P(None, "tp")
    assert _spec(layer.o) == P("tp") and _spec(layer.down) == P("tp")
    assert _spec(model.embed) == P("tp") and _spec(layer.attn_norm) == P() and _spec(model.final_norm) == P()
    cache = model.init_cache(2, 64)
    assert all(_spec(buffer) == P(None, "tp") for buffer in cache.k + cache.v)
    # Inside a jitted forward the written cache keeps its placement.
    _, _, cache = jax.jit(jspec.forward)(model, jnp.array([[1, 2, 3], [4, 5, 6]]), cache)
    assert all(_spec(buffer) == P(None, "tp") for buffer in cache.k + cache.v)
    # 2 KV heads and a vocabulary of 97 on 4 devices: the cache and the table are replicated.
    odd = jspec.shard(jspec.init_params(TINY, jax.random.key(0)), mesh)
    assert _spec(odd.embed) == P() and all(_spec(b) == P() for b in odd.init_cache(1, 16).k)
    untied = jspec.shard(_target(dataclasses.replace(CONFIG, tie_word_embeddings=False)), mesh)
    assert _spec(untied.lm_head) == P(None, "tp")


def check_plain_decoding():
    """Sharded logits equal unsharded ones within fp32 tolerance, greedy tokens identically; a
    one-device mesh takes the same path."""
    target = _target()
    tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    reference, _, _ = jax.jit(jspec.forward)(target, tokens, target.init_cache(1, 64))
    plain = jspec.generate(target, PROMPTS, 12)
    for devices in (jax.devices(), jax.devices()[:1]):
        sharded = jspec.shard(target, jspec.tensor_parallel_mesh(devices))
        logits, _, _ = jax.jit(jspec.forward)(sharded, tokens, sharded.init_cache(1, 64))
        np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), rtol=1e-5, atol=1e-5)
        assert jspec.generate(sharded, PROMPTS, 12) == plain


def check_kernels_run_per_device():
    """Attention, the RoPE + cache write (on each device's KV heads), the split projections, the
    embedding lookup and the residual add + norms run inside shard_maps (the Pallas kernels are custom
    calls XLA cannot partition), kernels included (interpret mode here); where nothing divides over
    the mesh they run as they are."""
    target = _target(dataclasses.replace(CONFIG, tie_word_embeddings=False))
    sharded = jspec.shard(target, jspec.tensor_parallel_mesh())
    tokens = jnp.array([[3, 1, 4, 1, 5]])

    def shard_maps(model):
        jaxpr = jax.make_jaxpr(lambda m, kv: jspec.forward(m, tokens, kv))(model, model.init_cache(1, 32))
        return str(jaxpr).count("shard_map[")

    # Per layer: attention and the RoPE + cache write (per KV head), qkv and gate_up (column), o and
    # down (row), and two residual add + norms (replicated: every device holds the activations; the
    # first layer's input norm adds nothing). Then the embedding lookup, the last add + norm and the LM head.
    assert shard_maps(sharded) == 8 * CONFIG.num_layers + 2
    # Nothing divides by 4 (3 x 18 query columns, 1 KV head, 2 x 91 MLP columns, 97 tokens): only the
    # add + norms run in shard_maps, on replicated operands.
    small = dataclasses.replace(TINY, num_heads=3, num_kv_heads=1, head_dim=18, intermediate_size=91)
    assert shard_maps(jspec.shard(jspec.init_params(small, jax.random.key(0)), jspec.tensor_parallel_mesh())) == (
        2 * small.num_layers)
    prompts = PROMPTS[:2]
    assert jspec.generate(sharded, prompts, 6, impl="pallas") == jspec.generate(target, prompts, 6, impl="pallas")


def _collectives(model, tokens) -> collections.Counter:
    compiled = jax.jit(jspec.forward).lower(model, tokens, model.init_cache(1, 32)).compile().as_text()
    return collections.Counter(re.findall(
        r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(", compiled))


def check_device_major_layout():
    """Fused weights are stored device-major, so a placed Llama-family forward moves no column
    between devices: its only collectives are two all-reduces per layer and the embedding's. A
    placed model saves in the plain order, and placing it again starts from that order."""
    target = _target(dataclasses.replace(CONFIG, qkv_bias=True))
    sharded = jspec.shard(target, jspec.tensor_parallel_mesh())
    tokens = jnp.array([[3, 1, 4, 1, 5]])
    assert _collectives(sharded, tokens) == {"all-reduce": 2 * CONFIG.num_layers + 1}
    reference, _, _ = jax.jit(jspec.forward)(target, tokens, target.init_cache(1, 32))
    logits, _, _ = jax.jit(jspec.forward)(sharded, tokens, sharded.init_cache(1, 32))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), rtol=1e-5, atol=1e-5)  # with q|k|v bias
    q, k, v = np.split(np.asarray(target.layers[0].qkv), [CONFIG.q_size, CONFIG.q_size + CONFIG.kv_size], axis=-1)
    first_device = np.asarray(sharded.layers[0].qkv.addressable_shards[0].data)
    np.testing.assert_array_equal(first_device, np.concatenate(
        [part[:, : part.shape[1] // DEVICES] for part in (q, k, v)], axis=-1))  # its heads' q, k and v
    for a, b in zip(jax.tree.leaves(plain_order(sharded)), jax.tree.leaves(target), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    again = jspec.shard(sharded, jspec.tensor_parallel_mesh(jax.devices()[:2]))
    for a, b in zip(jax.tree.leaves(plain_order(again)), jax.tree.leaves(target), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with tempfile.TemporaryDirectory() as tmp:
        jspec.save(sharded, Path(tmp) / "placed")
        loaded = jspec.restore(Path(tmp) / "placed")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(target), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check_drafters(drafters, target=None, **kw):
    target = _target() if target is None else target
    mesh = jspec.tensor_parallel_mesh()
    sharded = jspec.shard(target, mesh)
    plain = jspec.generate(target, PROMPTS, 12)
    for name, drafter in drafters(target).items():
        reference = jspec.speculative_generate(target, drafter, PROMPTS, 12, num_draft_tokens=3, **kw)
        result = jspec.speculative_generate(sharded, jspec.shard(drafter, mesh), PROMPTS, 12, num_draft_tokens=3, **kw)
        assert result.tokens == reference.tokens == plain, name
        np.testing.assert_array_equal(result.stats["accepted"], reference.stats["accepted"], err_msg=name)


def check_draft_model_and_ngram():
    draft = jspec.init_params(dataclasses.replace(CONFIG, num_layers=1), jax.random.key(1), scale=0.3)
    _check_drafters(lambda target: {"draft-model": DraftModel(draft), "self": DraftModel(target), "ngram": NGram()})


def check_hidden_state_heads():
    _check_drafters(lambda target: {"eagle3": Eagle3(eagle3_head(3, target, aux=(0, 1, 1))),
                                    "mtp": MTP(init_mtp_head(CONFIG, jax.random.key(4), scale=0.3))})


def check_gemma4_and_its_assistant():
    """Gemma 4's two cache geometries (sliding: 2 KV heads, split on 2 devices; full: 1, replicated)."""
    config = dataclasses.replace(TINY_GEMMA4, vocab_size=128, vocab_size_per_layer_input=128)
    target = jspec.init_params(config, jax.random.key(0), scale=0.3)
    mesh = jspec.tensor_parallel_mesh(jax.devices()[:2])
    cache = jspec.shard(target, mesh).init_cache(1, 16)
    assert {_spec(b) for b in cache.k} == {P(None, "tp"), P()}
    assistant_cfg = assistant_config(config, hidden_size=32, layer_types=(SLIDING, FULL), num_heads=2,
                                     num_centroids=None, centroid_top_k=32)
    assistant = FrozenKVMTP(init_assistant(assistant_cfg, jax.random.key(5), scale=0.3))
    _check_drafters(lambda target: {"frozen-kv-mtp": assistant, "self": DraftModel(target)}, target=target)


def check_sharded_init_and_benchmarks():
    """A preset made already placed equals the one made on one device; the benchmarks' --tp runs."""
    import json

    from jspec.bench import cli
    from jspec.sharding import init_sharded

    mesh = jspec.tensor_parallel_mesh()
    placed = init_sharded(CONFIG, jax.random.key(0), jnp.float32, mesh)
    assert _spec(placed.layers[1].gate_up) == P(None, "tp") and placed.execution.placement is not None
    on_one_device = jax.jit(jspec.init_params, static_argnums=(0, 2))(CONFIG, jax.random.key(0), jnp.float32)
    for a, b in zip(jax.tree.leaves(plain_order(placed)), jax.tree.leaves(on_one_device), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with tempfile.TemporaryDirectory() as tmp:
        for command in (["spec", "--target", "tiny", "--drafter", "eagle3"], ["decode", "--targets", "tiny"]):
            out = Path(tmp) / f"{command[0]}.json"
            assert cli.main([*command, "--tiny", "--tp", "4", "--out", str(out)]) in (0, None)
            rows = json.loads(out.read_text())["rows"]
            timed = [row for row in rows if row["measure"] != "policy"]  # policy rows are a choice, not a run
            assert timed and all(row["tp"] == 4 for row in timed)  # every timed row says it ran on 4 devices


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"]()
    print(f"{sys.argv[1]}: ok on {jax.device_count()} devices")
