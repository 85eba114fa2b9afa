"""XLA options the library's on-device loops are compiled with.

They are set per compile (``jax.jit(..., compiler_options=LOOP_COMPILER_OPTIONS)``), not through
``XLA_FLAGS``: the speed does not depend on the user's environment, and an option set here wins
over the same flag in it for these programs only.

* **Command buffers** (CUDA graphs) for the whole loop, ``WHILE`` and ``CONDITIONAL`` included: a
  decode step or a speculation round then launches as a few graphs instead of hundreds of
  kernels. Measured on the H100 at batch 1 (``benchmarks/decode_h100_command_buffers.json``):
  Llama-3.2-1B 1.65 -> 1.41 ms/token (0.52 -> 0.59 of the roofline, launch-bound), Llama-3.1-8B
  6.17 -> 6.13 (a tie). The CPU backend ignores the option.
* ``COLLECTIVES`` too (XLA leaves it off): under tensor parallelism every layer all-reduces twice,
  and a loop whose body holds a command XLA may not capture cannot run as one graph. Without it,
  Llama-3.1-8B at batch 1 on 2 x H100 decoded at 6.55 ms/token against 5.98 on one GPU (~680
  kernels a token on each device, each device streaming half the weights); with it: not measured
  yet. One-device programs hold no collectives, so the option changes nothing there.
"""

from __future__ import annotations

COMMAND_BUFFER_KINDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "WHILE", "CONDITIONAL", "COLLECTIVES")

LOOP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_KINDS)}
