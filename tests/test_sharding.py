"""Tensor parallelism (``jspec.shard``) on 4 CPU devices forced by XLA_FLAGS, each check in a
subprocess so the rest of the suite keeps one device (the checks: tests/sharded_checks.py):
sharded outputs equal unsharded ones for every drafter, and the parameters and caches are placed
as intended."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.parallel import COLUMN, ROW, split
from jspec.sharding import param_spec, placements, shard, tensor_parallel_mesh
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parent.parent
FORCED_DEVICES = "--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize("check", ["placements", "plain_decoding", "draft_model_and_ngram", "hidden_state_heads",
                                   "gemma4_and_its_assistant", "sharded_init_and_benchmarks",
                                   "kernels_run_per_device", "device_major_layout"])
def test_on_four_devices(check):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {FORCED_DEVICES}".strip(),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "tests.sharded_checks", check], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"{check}: ok on 4 devices" in proc.stdout


def test_param_specs_follow_megatron_and_fall_back_to_replication():
    spec = jax.sharding.PartitionSpec
    assert param_spec(COLUMN, (64, 128), 4) == spec(None, "tp") and param_spec(COLUMN, (128,), 4) == spec("tp")
    assert param_spec(ROW, (96, 64), 4) == spec("tp")
    assert param_spec(ROW, (97, 64), 4) == spec()  # a vocabulary that does not divide: replicated
    assert param_spec(None, (64,), 4) == spec() and param_spec(COLUMN, (64, 97), 4) == spec()


def test_placement_is_what_each_field_declares_not_its_name():
    """The Megatron split comes from the parameter's field (``jspec.parallel.split``): a new field
    called ``o`` or ``embed`` elsewhere is replicated, and every split the models declare is read."""

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Other:
        o: jax.Array
        embed: jax.Array
        table: jax.Array = split(ROW)

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))  # one device: every split divides
    ones = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    placed = placements(Other(ones, ones, ones), mesh)
    assert placed.o.spec == placed.embed.spec == jax.sharding.PartitionSpec()
    assert placed.table.spec == jax.sharding.PartitionSpec("tp")
    model = jax.eval_shape(lambda: tiny_model(0, qkv_bias=True))
    specs = placements(model, mesh)
    layer = specs.layers[0]
    assert [getattr(layer, name).spec for name in ("qkv", "qkv_bias", "gate_up")] == [
        jax.sharding.PartitionSpec(None, "tp"), jax.sharding.PartitionSpec("tp"), jax.sharding.PartitionSpec(None, "tp")]
    assert layer.o.spec == layer.down.spec == specs.embed.spec == jax.sharding.PartitionSpec("tp")
    assert layer.attn_norm.spec == specs.final_norm.spec == jax.sharding.PartitionSpec()


def test_a_mesh_without_the_axis_is_refused():
    with pytest.raises(ValueError, match="no axis 'tp'"):
        shard({}, jax.sharding.Mesh(jax.devices()[:1], ("data",)))
    assert tensor_parallel_mesh().axis_names == ("tp",)
