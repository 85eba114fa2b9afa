"""The library, not the user's environment, sets the XLA options of its on-device loops: XLA's own
dump of each compile's debug options shows them, even when XLA_FLAGS asks for something else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jspec.compile_options import COMMAND_BUFFER_KINDS, LOOP_COMPILER_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
RUN_BOTH_LOOPS = """
import jspec
from jspec.drafters import NGram
from tests.tiny import tiny_model
model = tiny_model(0)
jspec.generate(model, [[1, 2, 3]], 4)
jspec.speculative_generate(model, NGram(), [[1, 2, 3]], 4, num_draft_tokens=2)
"""


def test_on_device_loops_compile_with_command_buffers_whatever_xla_flags_say(tmp_path):
    # The environment asks for fusions only; the library's per-compile options must win.
    flags = f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*on_device.* --xla_gpu_enable_command_buffer=FUSION"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", RUN_BOTH_LOOPS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for loop in ("generate_on_device", "speculative_on_device"):
        dumps = sorted(tmp_path.glob(f"*jit_{loop}.debug_options"))
        assert dumps, f"no compile of {loop} was dumped: {sorted(p.name for p in tmp_path.iterdir())[:20]}"
        kinds = [line.split(":", 1)[1].strip() for line in dumps[0].read_text().splitlines()
                 if line.startswith("xla_gpu_enable_command_buffer:")]
        assert sorted(kinds) == sorted(COMMAND_BUFFER_KINDS), (loop, kinds)


def test_the_options_are_per_compile_not_global():
    assert LOOP_COMPILER_OPTIONS == {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_KINDS)}
    assert "WHILE" in COMMAND_BUFFER_KINDS and "CONDITIONAL" in COMMAND_BUFFER_KINDS  # the whole loop in graphs
    assert "COLLECTIVES" in COMMAND_BUFFER_KINDS  # ... under tensor parallelism too
    assert "command_buffer" not in os.environ.get("XLA_FLAGS", "")  # importing jspec set no flag


FIRST_KERNEL_CALL = """
import jax, jax.numpy as jnp
import pallas_kernels
from pallas_kernels.norm.gather_rows import gather_rows
traces = []
@jax.jit
def program(x):
    traces.append(1)
    return x * 2
x = jnp.ones((2, 4, 8), jnp.float32)
program(x)
gather_rows(x, jnp.array([1, 2]), impl="pallas")  # this process's first Pallas call (interpret mode)
program(x)
print(len(traces))
"""


def test_a_program_compiled_before_the_first_pallas_call_is_not_traced_again_after_it():
    # The first Pallas call lowered in interpret mode imports the Pallas fuser, whose option joins
    # JAX's tracing context; importing pallas_kernels registers it first, so the context keeps its
    # size and the earlier program stays cached. A fresh process: the first call of this one is past.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", FIRST_KERNEL_CALL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "1"  # traced once
