"""Pallas GPU kernels for jspec, each with a jnp reference and an ``impl=`` dispatcher."""

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
