"""Pallas GPU kernels for jspec, each with a jnp reference and an ``impl=`` dispatcher."""

# Registered here, before any program is traced: the first Pallas call lowered in interpret mode
# (every kernel on CPU) imports jax's Mosaic interpreter, which imports the Pallas fuser, whose
# ``pallas_fuser_disable_nested_fuse`` option joins JAX's tracing context. A tracing context that
# grows by one value misses every cache entry made before it, so each program compiled before that
# first kernel call would trace, lower and compile again (a Gemma 4 generate: 20-45 s on CPU). The
# option keeps its default (off); importing it only fixes the context's size from the start.
import jax.experimental.pallas.fuser  # noqa: F401

from pallas_kernels.attention.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.norm.gather_rows import gather_rows, gather_rows_reference
from pallas_kernels.matmul.skinny_matmul import skinny_matmul, skinny_matmul_reference

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "gather_rows",
    "gather_rows_reference",
    "skinny_matmul",
    "skinny_matmul_reference",
]
