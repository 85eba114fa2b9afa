"""Decode / draft attention: flash-decoding over a split KV axis (Triton), the row-invariant form, and
the wide-head Mosaic GPU kernels for head_dim 512; ``decode_attention`` is the dispatcher."""
