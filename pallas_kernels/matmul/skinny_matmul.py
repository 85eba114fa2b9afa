"""Few rows times a big weight matrix (decode / verify projections).

Shapes: x [M, K] (small M), w [K, N] -> [M, N] in x's dtype, fp32 accumulation.
Leading batch dims of x are flattened into M. ``w_transposed=True`` takes w as [N, K] instead
(a tied LM head contracting against the embedding table as stored, never a transposed copy).

The cost of ``x @ w`` for M = 1..64 is reading ``w`` once, so the Pallas kernel is a
weight-streaming GEMV/GEMM (Triton backend; :mod:`pallas_kernels.matmul.skinny_kernel`, the one kernel
this matmul and the quantized one share):

* grid ``(M tiles, cdiv(N, block_n), split_k)``: each program owns one ``block_n`` column tile
  of ``w`` and one of ``split_k`` contiguous K ranges (split-K when the N tiles alone do not
  fill the GPU's SMs); it loops over its K range in ``block_k`` steps with a
  ``fori_loop`` that Triton software-pipelines ``num_stages`` deep. M tiles (only with
  ``block_m`` set) are the fastest grid axis, so the tiles that read the same weight tile run
  back to back and all but the first read it from L2;
* the rows of ``x`` are padded to ``block_m = max(16, next_pow2(M))`` *inside* the kernel
  (a masked load), the minimum size of a 16-bit tensor-core dot;
* K and N that are not multiples of the block are handled with masked loads and stores
  (never an out-of-bounds ref slice; masks are only emitted where the shape needs them,
  so aligned shapes stream unmasked);
* with ``split_k > 1`` the kernel writes fp32 partial sums ``[split_k, M, N]`` that one
  small XLA fusion adds up and casts;
* a gated activation in the epilogue (``gated="silu"``: w is ``[gate | up]``, each program holds
  one column tile of each and writes ``silu(gate) * up``), one launch fewer per MLP.
  No RMSNorm prologue: summing each row's squares in a first pass over K slows the projection far
  more than the norm's launch costs, and even feeding ``x * g`` to the dot in one pass (``1 / rms``
  scaling the accumulator at the end) puts an elementwise op on x between its load and the dot,
  which costs the loop more than the norm's own launch.

``skinny_matmul(..., impl="auto")`` uses the kernel only on a GPU and only for the shapes
where the benchmarks show it faster than XLA's dot (``benchmarks/README.md``, skinny matmul;
16-bit operands; the swept model shapes per M bucket up to 16 rows, other shapes at M = 1; see
``_auto_uses_pallas``); everywhere else (CPU, prefill) it is the reference.
``impl="pallas"`` takes any M <= 64 (tilings: :mod:`pallas_kernels.matmul.skinny_tilings`, swept per M bucket
for the Llama-3.2-1B and Llama-3.1-8B projection shapes); more rows (a prefill) are no skinny product,
so they take the reference there too, as every dispatcher does with shapes its kernel does not take.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.dispatch import check_impl, interpret_mode, on_gpu
from pallas_kernels.matmul.skinny_kernel import GATES, MAX_M, Plain, skinny_call  # noqa: F401 (GATES, MAX_M: re-exported)
from pallas_kernels.matmul.skinny_tilings import (  # noqa: F401 (re-exported: the tilings are part of this kernel's API)
    _TUNED, INVARIANT_BLOCK_M, SkinnyConfig, _m_bucket, _pow2_at_least, default_config, gated_config, invariant_config,
)


def skinny_matmul_reference(x, w, *, w_transposed=False, gated=None):
    """``x @ w``; with ``gated`` (a name in ``GATES``, e.g. ``"silu"``), w is ``[gate | up]`` and the result
    ``act(x @ gate) * (x @ up)``, each product rounded to x's dtype first."""
    # fp32 operands: full fp32 (no TF32). 16-bit operands: default precision, which is
    # already bf16 x bf16 -> fp32; HIGHEST there makes XLA's M = 1 dot several times slower.
    f32 = jnp.dtype(jnp.float32) in (jnp.dtype(x.dtype), jnp.dtype(w.dtype))
    precision = jax.lax.Precision.HIGHEST if f32 else None
    out = jnp.einsum("...k,nk->...n" if w_transposed else "...k,kn->...n", x, w, precision=precision,
                     preferred_element_type=jnp.float32).astype(x.dtype)
    if gated is None:
        return out
    gate, up = jnp.split(out, 2, axis=-1)
    return GATES[gated](gate) * up


def skinny_matmul_pallas(x, w, *, config: SkinnyConfig | None = None, interpret=None, w_transposed=False,
                         gated: str | None = None):
    """The Pallas kernel for x [..., K] (at most MAX_M rows after flattening, unless the config
    has M tiles), w [K, N] (or [N, K] with ``w_transposed``) -> [..., N] in x's dtype.
    ``gated="silu"``: w is ``[gate | up]`` and the result ``silu(x @ gate) * (x @ up)`` [..., N / 2],
    in the kernel."""
    return _pallas(x, w, config, interpret, w_transposed, gated, parts=False)


def skinny_matmul_pallas_parts(x, w, *, config: SkinnyConfig | None = None, interpret=None, w_transposed=False):
    """The kernel's split-K partial sums as they are: ``[splits, ..., N]`` in fp32 (``[1, ..., N]`` in
    x's dtype without split-K), for a consumer that adds them itself
    (``pallas_kernels.norm.add_rms_norm``); their sum rounded to x's dtype is the product."""
    return _pallas(x, w, config, interpret, w_transposed, None, parts=True)


def _pallas(x, w, config, interpret, w_transposed, gated, *, parts):
    if interpret is None:
        interpret = interpret_mode()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    k, n = w.shape[::-1] if w_transposed else w.shape
    if config is None:
        config = default_config(x2.shape[0], k, n, jnp.dtype(jnp.promote_types(x.dtype, w.dtype)).itemsize)
        if gated is not None:
            config = gated_config(config, n)
    out = skinny_call(x2, (w,), loader=Plain(jnp.dtype(w.dtype).itemsize), k=k, n=n, w_dtype=jnp.dtype(w.dtype),
                      config=config, interpret=bool(interpret), w_transposed=w_transposed, gated=gated,
                      split_parts=parts)
    return out.reshape(*out.shape[:-2], *lead, out.shape[-1])


def _auto_uses_pallas(m: int, k: int, n: int, x_dtype, w_dtype) -> bool:
    """The ``impl="auto"`` rule on a GPU (figures: ``benchmarks/README.md``, skinny matmul).

    16-bit operands only. Swept shapes (``_TUNED``): the kernel where its best tiling beat XLA's
    dot in that M bucket. Other shapes: one row only (M = 1: decode at batch 1, each draft step),
    where the kernel beat XLA on every mid-size projection measured (XLA's M = 1 dot is weak), but
    not the LM head (N > 32768), where they tie. That includes the small models' projections from
    512 x 512 up (SmolLM2-135M, Qwen2.5-0.5B: K or N under 1024; XLA runs them as reductions with
    more launches around them), whose decode step's kernels take less GPU time on the kernel. From
    256 x 256 up: the Gemma 4 assistant's hidden size is 256, and XLA runs its one-row projections as
    a product written out by one kernel and summed by another; on the kernel its propose takes less
    time in the on-device loop.
    """
    half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if jnp.dtype(x_dtype) != jnp.dtype(w_dtype) or jnp.dtype(x_dtype) not in half or m > MAX_M:
        return False
    tuned = _TUNED.get((k, n), {}).get(_m_bucket(m))
    if tuned is not None:
        return tuned[1]
    return m == 1 and k >= 256 and 256 <= n <= 32768


def skinny_matmul(x, w, *, impl="auto", w_transposed=False, gated=None):
    """Dispatcher: ``x @ w`` for x [..., K], w [K, N] -> [..., N] (w [N, K] with ``w_transposed``).
    ``impl="pallas"``: the kernel for up to ``MAX_M`` rows, the reference for more (a prefill);
    ``impl="invariant"``: the kernel with :func:`invariant_config`, for any number of rows.

    ``gated="silu"`` (w is ``[gate | up]``; the result ``silu(x @ gate) * (x @ up)``, [..., N / 2]):
    fused into the kernel wherever it runs (``"pallas"``; ``"auto"`` where it takes the kernel for
    ``x @ w``), saving the activation's launch; elsewhere the reference composes it. Not under
    ``"invariant"``, whose tiling does not hold gate and up side by side."""
    if gated is not None and gated not in GATES:
        raise ValueError(f"gated must be one of {sorted(GATES)}, got {gated!r}")
    return _dispatch(x, w, impl, w_transposed, gated, parts=False)


def skinny_matmul_parts(x, w, *, impl="auto", w_transposed=False):
    """Dispatcher for the product as partial sums ``[splits, ..., N]`` whose sum over the first axis,
    rounded to x's dtype, is ``x @ w`` (:func:`skinny_matmul_pallas_parts`; ``[1, ..., N]``, the
    product itself, wherever the kernel does not split K), for a consumer that adds them in its own
    launch (``pallas_kernels.norm.add_rms_norm``). The kernel runs where :func:`skinny_matmul`'s
    would."""
    return _dispatch(x, w, impl, w_transposed, None, parts=True)


def _dispatch(x, w, impl, w_transposed, gated, *, parts):
    impl = check_impl(impl, "skinny_matmul")
    m = math.prod(x.shape[:-1])
    k, n = w.shape[::-1] if w_transposed else w.shape
    kernel = functools.partial(_pallas, x, w, w_transposed=w_transposed, parts=parts)
    if impl == "invariant":
        if gated is not None:
            raise ValueError("impl='invariant' does not fuse a gate into the matmul: compose it")
        itemsize = jnp.dtype(jnp.promote_types(x.dtype, w.dtype)).itemsize
        return kernel(invariant_config(k, n, itemsize, w_transposed=w_transposed), None, gated=None)
    if impl == "pallas" and m <= MAX_M:
        if _fits_gated(m, k, n, x.dtype, w.dtype, gated):
            return kernel(None, None, gated=gated)
        gate, up = jnp.split(skinny_matmul_pallas(x, w), 2, axis=-1)
        return GATES[gated](gate) * up
    if (impl == "auto" and not w_transposed and on_gpu() and _auto_uses_pallas(m, k, n, x.dtype, w.dtype)
            and _fits_gated(m, k, n, x.dtype, w.dtype, gated)):
        return kernel(None, False, gated=gated)
    out = skinny_matmul_reference(x, w, w_transposed=w_transposed, gated=gated)
    return out[None] if parts else out


def _fits_gated(m, k, n, x_dtype, w_dtype, gated) -> bool:
    """Whether the gated product's tiling covers gate and up in whole tiles (always, ungated)."""
    if gated is None:
        return True
    itemsize = jnp.dtype(jnp.promote_types(x_dtype, w_dtype)).itemsize
    return n % 2 == 0 and (n // 2) % gated_config(default_config(m, k, n, itemsize), n).block_n == 0
