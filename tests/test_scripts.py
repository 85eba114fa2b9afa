"""Every script runs: --help, and the tiny CPU mode of each benchmark script (so they never rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["bench.py", "bench_eagle.py", "bench_kernels.py", "bench_matmul.py", "convert_hf.py", "generate.py",
           "probe_mosaic_decode.py"]


def _run(*args, timeout=300):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    assert "usage" in _run(ROOT / "scripts" / script, "--help").lower()


@pytest.mark.parametrize(
    "command",
    [
        ["decode", "--targets", "tiny", "tiny-gemma4"],
        ["spec"],  # draft model: rounds, stages, end to end with the oracle
        ["spec", "--target", "tiny-gemma4"],  # a Gemma 4 target drafted by a Llama-family draft model
        ["spec", "--drafter", "eagle3", "--alpha", "--stages-k"],  # rounds only
        ["compile"],
    ],
    ids=["decode", "spec", "spec-gemma4", "spec-eagle3", "compile"],
)
def test_bench_tiny(tmp_path, command):
    out = tmp_path / "result.json"
    _run(ROOT / "scripts" / "bench.py", "--tiny", "--out", out, *command)
    command = command[0]
    result = json.loads(out.read_text())
    assert result["kind"] == command and result["environment"]["platform"] == "cpu"
    if command == "decode":
        assert {r["target"] for r in result["results"]} == {"tiny", "tiny-gemma4"}
        assert "roofline_fraction" in result["results"][0]  # CPU timings of a tiny model are noise
        assert {"median_ms", "p10_ms", "p90_ms"} <= set(result["results"][0]["timings"]["1_token"])
        assert out.with_suffix(".png").exists()
    if command == "spec" and result["results"]["rounds"]:  # every timed figure comes with its spread
        assert {"round", "decode_step"} <= set(result["results"]["rounds"][0]["timings"])


def test_bench_eagle_tiny(tmp_path):
    out = tmp_path / "eagle.json"
    _run(ROOT / "scripts" / "bench_eagle.py", "--tiny", "--batches", "1", "--ks", "2", "--catch-up-ks", "2",
         "--out", out)
    assert json.loads(out.read_text())


def test_bench_kernels_check_on_cpu(tmp_path):
    """The GPU correctness check runs the kernels interpreted on CPU (small cases only)."""
    out = _run(ROOT / "scripts" / "bench_kernels.py", "check", "--check-max-len", "600", "--out", tmp_path)
    assert "check: passed=True" in out
    assert json.loads((tmp_path / "decode_attention_check.json").read_text())["passed"]


def test_bench_matmul_smoke(tmp_path):
    """Correctness and auto routing of the skinny matmul script on CPU (timing is GPU-only)."""
    _run(ROOT / "scripts" / "bench_matmul.py", "--smoke", "--skip-torch", "--skip-measure", "--shapes", "300x200",
         "--ms", "1,3", "--sweep-budget", "0", "--out", tmp_path)
    result = json.loads((tmp_path / "skinny_matmul.json").read_text())
    assert result["correctness"] and all(case["ok"] for case in result["correctness"])


def test_generate_default_model():
    out = _run(ROOT / "scripts" / "generate.py", "--max-new-tokens", "8", "--drafter", "ngram")
    assert "identical to plain decoding" in out


def test_gpu_kernel_times_is_empty_off_a_gpu():
    import jax.numpy as jnp

    from jspec.bench.common import gpu_kernel_times, interleaved_gpu_times

    assert gpu_kernel_times(lambda: jnp.ones(3) + 1, flush_l2_bytes=1 << 10) == []
    assert interleaved_gpu_times({"a": lambda: jnp.ones(3)}, flush_l2_bytes=1 << 10) == {"a": []}


@pytest.mark.parametrize("config", [dict(), dict(k_splits=3, block_kv=128, stages=3), dict(layout="bshd")])
def test_mosaic_probe_kernel_traces_on_cpu(config):
    """The Mosaic GPU probe kernel cannot lower without a GPU, but tracing it checks its shapes,
    refs and barriers against the installed jax's MGPU API."""
    import importlib.util

    import jax
    import jax.numpy as jnp

    spec = importlib.util.spec_from_file_location("probe_mosaic_decode", ROOT / "scripts" / "probe_mosaic_decode.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    batch, max_len = 3, 1024
    q = jax.ShapeDtypeStruct((batch, 1, 8, 128), jnp.bfloat16)
    kv_shape = (batch, 2, max_len, 128) if config.get("layout", "bnth") == "bnth" else (batch, max_len, 2, 128)
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    traced = jax.jit(lambda *a: probe.mosaic_decode_attention(*a, **config)).trace(q, kv, kv, lengths)
    assert traced.out_info.shape == q.shape
