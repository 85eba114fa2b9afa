"""Tensor parallelism (``jspec.shard``) on 4 CPU devices forced by XLA_FLAGS, each check in a
subprocess so the rest of the suite keeps one device (the checks: tests/sharded_checks.py):
sharded outputs equal unsharded ones for every drafter, and the parameters and caches are placed
as intended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jspec.sharding import param_spec, shard, tensor_parallel_mesh

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
    assert param_spec("qkv", (64, 128), 4) == spec(None, "tp") and param_spec("qkv_bias", (128,), 4) == spec("tp")
    assert param_spec("down", (96, 64), 4) == spec("tp") and param_spec("embed", (128, 64), 4) == spec("tp")
    assert param_spec("embed", (97, 64), 4) == spec()  # the vocabulary does not divide: replicated
    assert param_spec("attn_norm", (64,), 4) == spec() and param_spec("lm_head", (64, 97), 4) == spec()


def test_a_mesh_without_the_axis_is_refused():
    with pytest.raises(ValueError, match="no axis 'tp'"):
        shard({}, jax.sharding.Mesh(jax.devices()[:1], ("data",)))
    assert tensor_parallel_mesh().axis_names == ("tp",)
