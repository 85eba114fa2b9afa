"""XLA options the library's on-device loops are compiled with.

They are set per compile (``jax.jit(..., compiler_options=LOOP_COMPILER_OPTIONS)``), not through
``XLA_FLAGS``: the speed does not depend on the user's environment, and an option set here wins
over the same flag in it for these programs only.

* **Command buffers** (CUDA graphs) for the whole loop, ``WHILE`` and ``CONDITIONAL`` included: a
  decode step or a speculation round then launches as a few graphs instead of hundreds of
  kernels: a clear gain for small, launch-bound models, a tie for large ones (figures:
  ``benchmarks/README.md``, plain decode). The CPU backend ignores the option.
* ``COLLECTIVES`` too (XLA leaves it off): under tensor parallelism every layer all-reduces twice,
  and a loop whose body holds a command XLA may not capture cannot run as one graph: each device
  would launch every kernel of a token on its own, which can cost more than halving its weight
  reads saves (figures: ``benchmarks/README.md``, tensor parallel). One-device programs hold no
  collectives, so the option changes nothing there.
"""

from __future__ import annotations

COMMAND_BUFFER_KINDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "WHILE", "CONDITIONAL", "COLLECTIVES")

LOOP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_KINDS)}
