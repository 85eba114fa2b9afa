"""The kernels against their jnp references on the current device (``kernels check``), and the
attention inputs the kernel benchmarks share."""

from __future__ import annotations

import itertools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import decode_attention, gather_rows, skinny_matmul
from pallas_kernels.norm.add_rms_norm import add_rms_norm
from pallas_kernels.attention.decode_attention import decode_attention_pallas, decode_attention_reference
from pallas_kernels.attention.decode_tiling import tiling
from pallas_kernels.rope_write import rope_write


def decode_attention_inputs(batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, lengths, *,
                            seed=0, poison=False, dtype=jnp.bfloat16):
    """Random ``q [batch, num_q, num_q_heads, head_dim]`` and caches ``k, v [batch, num_kv_heads,
    max_len, head_dim]``, ``kv_lengths`` from ``lengths`` and ``q_positions`` = the last ``num_q``
    rows of each length. ``poison``: NaN in every cache row past each length (nothing may read it)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, num_q, num_q_heads, head_dim), dtype)
    k, v = (jax.random.normal(key, (batch, num_kv_heads, max_len, head_dim), dtype) for key in keys[1:])
    kv_lengths = jnp.asarray(lengths, jnp.int32)
    if poison:
        past = jnp.arange(max_len)[None, None, :, None] >= kv_lengths[:, None, None, None]
        k, v = jnp.where(past, jnp.nan, k), jnp.where(past, jnp.nan, v)
    q_positions = kv_lengths[:, None] - num_q + jnp.arange(num_q, dtype=jnp.int32)[None, :]
    return q, k, v, kv_lengths, q_positions


def decode_check_cases():
    """``(name, case kwargs, call kwargs)`` of the decode-attention check."""
    base = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    return [
        ("decode_gqa4_d128_bf16", dict(batch=4, num_q=1, max_len=4096, dtype="bfloat16", **base), {}),
        ("decode_b8_block_k32_bf16", dict(batch=8, num_q=1, max_len=5000, dtype="bfloat16", **base), {}),
        ("verify_gqa4_d128_bf16", dict(batch=3, num_q=5, max_len=3001, dtype="bfloat16", **base), {}),
        ("tree9_window_bf16", dict(batch=2, num_q=9, max_len=2048, dtype="bfloat16", tree=True, **base),
         dict(window=700)),
        ("tree40_two_words_f32", dict(batch=2, num_q=40, num_q_heads=4, num_kv_heads=4, max_len=512, head_dim=64,
                                      dtype="float32", tree=True), {}),
        ("decode_mha_d64_f32", dict(batch=2, num_q=1, num_q_heads=8, num_kv_heads=8, max_len=1000, head_dim=64,
                                    dtype="float32"), {}),
        ("verify_gqa8_d256_bf16", dict(batch=2, num_q=4, num_q_heads=16, num_kv_heads=2, max_len=1536, head_dim=256,
                                       dtype="bfloat16"), dict(scale=0.05)),
        ("prefill_t128_gqa4_bf16", dict(batch=2, num_q=128, max_len=1024, dtype="bfloat16", **base), dict(window=300)),
        ("decode_128k_b1_bf16", dict(batch=1, num_q=1, max_len=131072, dtype="bfloat16", **base), {}),
        ("gemma4_full_d512_gqa8_bf16", dict(batch=2, num_q=5, num_q_heads=32, num_kv_heads=4, max_len=2048,
                                            head_dim=512, dtype="bfloat16"), dict(scale=1.0)),
        ("gemma4_sliding_d256_window_bf16", dict(batch=2, num_q=1, num_q_heads=32, num_kv_heads=16, max_len=3000,
                                                 head_dim=256, dtype="bfloat16"), dict(window=1024, scale=1.0)),
        ("decode_m4_gqa1_16_bf16", dict(batch=1, num_q=1, num_q_heads=4, num_kv_heads=4, max_len=256, head_dim=128,
                                        dtype="bfloat16"), {}),
        # Gemma 4 draft / verify shapes: 16-row M blocks at head_dim 256 and 512, windows, k_eq_v
        ("gemma4_31b_full_9rows_k_eq_v_bf16", dict(batch=3, num_q=9, num_q_heads=32, num_kv_heads=4, max_len=3000,
                                                   head_dim=512, dtype="bfloat16", same_kv=True), dict(scale=1.0)),
        # the wide-head kernel's 72 rows in two tiles at 32-row blocks, lengths cut inside a block
        ("gemma4_31b_full_9rows_wide_bf16", dict(batch=3, num_q=9, num_q_heads=32, num_kv_heads=4, max_len=3008,
                                                 head_dim=512, dtype="bfloat16"), dict(scale=1.0)),
        ("gemma4_e4b_full_5rows_bf16", dict(batch=4, num_q=5, num_q_heads=8, num_kv_heads=2, max_len=5000,
                                            head_dim=512, dtype="bfloat16"), dict(scale=1.0)),
        ("gemma4_31b_sliding_9rows_window_bf16", dict(batch=3, num_q=9, num_q_heads=32, num_kv_heads=16, max_len=4000,
                                                      head_dim=256, dtype="bfloat16"), dict(window=1024, scale=1.0)),
        ("gemma4_e4b_sliding_1row_window_bf16", dict(batch=5, num_q=1, num_q_heads=8, num_kv_heads=2, max_len=2000,
                                                     head_dim=256, dtype="bfloat16"), dict(window=512, scale=1.0)),
    ]


def make_case(seed, *, batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, tree=False, same_kv=False):
    """Random q/k/v (cache rows past each length NaN-poisoned), ragged lengths incl. num_q and max_len;
    ``same_kv``: one buffer as both K and V (Gemma 4's ``attention_k_eq_v``)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, num_q, num_q_heads, head_dim))
    k = rng.standard_normal((batch, num_kv_heads, max_len, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, num_kv_heads, max_len, head_dim)).astype(np.float32)
    lengths = rng.integers(num_q, max_len + 1, size=batch)
    lengths[0] = max_len
    if batch > 1:
        lengths[-1] = num_q
    for b in range(batch):
        k[b, :, lengths[b]:] = np.nan
        v[b, :, lengths[b]:] = np.nan
    tail_mask, depth = None, np.arange(num_q)[None, :].repeat(batch, 0)
    if tree:
        tail_mask = np.zeros((batch, num_q, num_q), bool)
        depth = np.zeros((batch, num_q), np.int32)
        for b in range(batch):
            tail_mask[b, 0, 0] = True
            for c in range(1, num_q):
                parent = int(rng.integers(0, c))
                tail_mask[b, c] = tail_mask[b, parent]
                tail_mask[b, c, c] = True
                depth[b, c] = depth[b, parent] + 1
    positions = lengths[:, None] - num_q + depth
    return dict(
        q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(k if same_kv else v, dtype),
        kv_lengths=jnp.asarray(lengths, jnp.int32), q_positions=jnp.asarray(positions, jnp.int32),
        tail_mask=None if tail_mask is None else jnp.asarray(tail_mask),
    )


def _compare(entry, run_kernel, run_reference, tol):
    """``entry`` with max_abs_err / finite / passed (or the error) of the kernel vs the reference."""
    try:
        out = np.asarray(run_kernel(), np.float32)
        ref = np.asarray(run_reference(), np.float32)
        finite = bool(np.isfinite(out).all())
        entry.update(max_abs_err=float(np.max(np.abs(out - ref))), finite=finite,
                     passed=finite and bool(np.allclose(out, ref, atol=tol[0], rtol=tol[1])))
    except Exception as exc:  # noqa: BLE001 - record and go on
        entry.update(passed=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    return entry


def check_decode_attention(max_len_cap=None, seed=0):
    for name, case_kw, call_kw in decode_check_cases():
        if max_len_cap and case_kw["max_len"] > max_len_cap:
            continue
        case_kw = dict(case_kw)
        dtype = jnp.dtype(case_kw.pop("dtype"))
        case = make_case(zlib.crc32(name.encode()) % 1000 + seed, dtype=dtype, **case_kw)
        fns = {impl: jax.jit(lambda q, k, v, lens, p, t, impl=impl: decode_attention(
            q, k, v, lens, q_positions=p, tail_mask=t, impl=impl, **call_kw)) for impl in ("pallas", "xla")}
        a = (case["q"], case["k"], case["v"], case["kv_lengths"], case["q_positions"], case["tail_mask"])
        tol = 2e-5 if dtype == jnp.float32 else 2e-2
        entry = dict(measure="check", name=name, **case_kw, dtype=str(dtype), **call_kw)
        yield _compare(entry, lambda: fns["pallas"](*a), lambda: fns["xla"](*a), (tol, tol))


def check_split_merge(max_len_cap=None, draws=6, repeats=3, seed=0, max_shapes=None):
    """The split programs of a sequence leave partials that the last to arrive (found with an
    atomic counter) or a combine kernel merges. Races would show as wrong or unsteady outputs,
    so: ragged batches with fresh random lengths (0 included, rows past each length NaN) for
    several split counts, each call repeated; every output must match the reference and repeat
    bit for bit (the merge runs in slot order, whichever program arrives last). ``max_shapes``: the
    first that many shapes only (each still with every split count)."""
    rng = np.random.default_rng(1 + seed)
    hq, hkv, head_dim = 32, 8, 128
    interpreted = jax.default_backend() != "gpu"
    if interpreted:  # one draw, and no race to look for
        draws, repeats = 1, 1
    ref_fn = jax.jit(lambda q, k, v, lens, p: decode_attention_reference(q, k, v, lens, q_positions=p))
    shapes = [(1, 1, 20000), (8, 1, 4096), (32, 1, 2048), (8, 5, 4096), (3, 9, 3000), (3, 1, 512)]
    shapes = [shape for shape in shapes if not (max_len_cap and shape[2] > max_len_cap)][:max_shapes]
    for batch, num_q, max_len in shapes:
        default = tiling(batch, num_q, hq, hkv, max_len, head_dim)["k_splits"]
        # 2 splits: merged by the last program to arrive; more: by the combine kernel. Interpreted,
        # the two extremes cover both merges (each split count is a program to compile).
        for k_splits in sorted({2, 4 * default} if interpreted else {2, default, 4 * default}):
            fn = jax.jit(lambda q, k, v, lens, p, s=k_splits: decode_attention_pallas(q, k, v, lens, q_positions=p,
                                                                                       k_splits=s))
            worst, unsteady = 0.0, 0
            for draw in range(draws):
                lengths = rng.integers(0, max_len + 1, size=batch)
                lengths[rng.integers(batch)] = max_len
                lengths[rng.integers(batch)] = rng.integers(0, 3)
                q, k, v, lens, pos = decode_attention_inputs(batch, num_q, hq, hkv, max_len, head_dim, lengths,
                                                             seed=draw, poison=True)
                outs = [np.asarray(fn(q, k, v, lens, pos), np.float32) for _ in range(repeats)]
                ref = np.asarray(ref_fn(q, k, v, lens, pos), np.float32)
                unsteady += sum(not np.array_equal(o, outs[0], equal_nan=True) for o in outs[1:])
                worst = max(worst, float(np.max(np.abs(outs[0] - ref))) if np.isfinite(outs[0]).all() else float("inf"))
            yield dict(measure="check", name=f"split_merge_b{batch}_q{num_q}_len{max_len}_splits{k_splits}",
                       draws=draws, repeats=repeats, max_abs_err=worst, unsteady_repeats=unsteady,
                       passed=bool(worst <= 2e-2 and unsteady == 0))


def check_gather_rows(seed=0):
    rng = np.random.default_rng(seed)
    for batch, seq_len, hidden, n, norm in [(4, 37, 2048, None, True), (3, 9, 3072, 5, True), (2, 5, 5000, 2, False)]:
        x = jnp.asarray(rng.standard_normal((batch, seq_len, hidden)), jnp.bfloat16)
        rows = jnp.asarray(rng.integers(-seq_len, seq_len, size=(batch,) if n is None else (batch, n)), jnp.int32)
        w = jnp.asarray(1 + rng.standard_normal(hidden), jnp.bfloat16) if norm else None
        fns = {impl: jax.jit(lambda x, r, w, impl=impl: gather_rows(x, r, norm_weight=w, impl=impl))
               for impl in ("pallas", "xla")}
        entry = dict(measure="check", name=f"gather_rows_{batch}x{seq_len}x{hidden}_n{n}_norm{norm}")
        yield _compare(entry, lambda: fns["pallas"](x, rows, w), lambda: fns["xla"](x, rows, w), (2e-2, 1e-2))


def check_add_rms_norm(seed=0):
    """The residual add + RMSNorm from a projection's split-K partials, at the 1B, SmolLM2 and 8B
    hiddens (decode and verify rows; the split counts their output projections take)."""
    rng = np.random.default_rng(seed)
    for rows, hidden, splits in [(1, 2048, 16), (5, 576, 1), (1, 4096, 8), (3, 5000, 4)]:
        x = jnp.asarray(3 * rng.standard_normal((1, rows, hidden)), jnp.bfloat16)
        parts = jnp.asarray(rng.standard_normal((splits, 1, rows, hidden)), jnp.float32)
        w = jnp.asarray(1 + rng.standard_normal(hidden), jnp.bfloat16)
        fns = {impl: jax.jit(lambda x, p, w, impl=impl: jnp.concatenate(add_rms_norm(x, p, w, 1e-5, impl=impl)))
               for impl in ("pallas", "xla")}
        entry = dict(measure="check", name=f"add_rms_norm_{rows}x{hidden}_splits{splits}")
        yield _compare(entry, lambda: fns["pallas"](x, parts, w), lambda: fns["xla"](x, parts, w), (4e-2, 1e-2))


def check_fused_matmul(seed=0, max_weight=None):
    """The skinny matmul with its gated epilogue (decode / verify rows at the 8B, 1B, SmolLM2 and
    Qwen2.5-0.5B gate/up shapes with SiLU, Gemma 4 E4B's and its assistant's with the tanh GELU, a
    ragged K) and the assistant's plain one-row projections (hidden 256: q, o, down, pre-projection);
    ``max_weight``: skip weights of more elements."""
    rng = np.random.default_rng(seed)
    for m, k, n, gated in [(1, 4096, 28672, "silu"), (5, 2048, 16384, "silu"), (1, 576, 3072, "silu"),
                           (1, 896, 9728, "silu"), (3, 1000, 1536, "silu"), (1, 2560, 20480, "gelu_tanh"),
                           (3, 1000, 1536, "gelu_tanh"), (1, 256, 4096, "gelu_tanh"), (1, 256, 1024, None),
                           (1, 1024, 256, None), (1, 2048, 256, None), (1, 5120, 256, None)]:
        if max_weight and k * n > max_weight:
            continue
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        fns = {impl: jax.jit(lambda x, w, impl=impl, gated=gated: skinny_matmul(x, w, impl=impl, gated=gated))
               for impl in ("pallas", "xla")}
        entry = dict(measure="check", name=f"skinny_matmul_{m}x{k}x{n}_gated_{gated}")
        yield _compare(entry, lambda: fns["pallas"](x, w), lambda: fns["xla"](x, w), (3e-2, 2e-2))


def check_rope_write(seed=0):
    """RoPE + the K/V cache write at Llama / Qwen3 / Gemma 4 head shapes, ragged lengths; the caches'
    rows past the new ones are NaN and must stay so (compared as written: NaN where the reference has NaN).
    Interpreted (off a GPU) every program copies the whole caches, so there they hold 96 rows, still
    room past the longest (80-row) write, instead of 512: the same paths at a fifth of the work."""
    rng = np.random.default_rng(seed)
    max_len = 512 if jax.default_backend() == "gpu" else 96
    gemma4 = dict(norm="fp32_scale", v_norm=True)
    for batch, rows, heads, kv_heads, head_dim, qk_norm, options in [
            (4, 1, 32, 8, 128, False, {}), (3, 5, 16, 8, 128, True, {}), (2, 80, 32, 8, 64, False, {}),
            (2, 5, 32, 16, 256, True, gemma4), (2, 5, 32, 4, 512, True, dict(gemma4, k_eq_v=True))]:
        v_heads = 0 if options.get("k_eq_v") else kv_heads
        qkv = jnp.asarray(rng.standard_normal((batch, rows, (heads + kv_heads + v_heads) * head_dim)), jnp.bfloat16)
        angles = np.tile(rng.uniform(0, 6, (batch, rows, head_dim // 2)), 2)
        cos, sin = (jnp.asarray(f(angles), jnp.bfloat16) for f in (np.cos, np.sin))
        lengths = jnp.asarray(rng.integers(0, max_len - rows + 1, size=batch), jnp.int32)
        past = np.arange(max_len)[None, None, :, None] >= np.asarray(lengths)[:, None, None, None]
        caches = [jnp.asarray(np.where(past, np.nan, rng.standard_normal((batch, kv_heads, max_len, head_dim))),
                              jnp.bfloat16) for _ in range(2)]
        norms = ([jnp.asarray(1 + 0.1 * rng.standard_normal(head_dim), jnp.bfloat16) for _ in range(2)]
                 if qk_norm else [None, None])
        fns = {impl: jax.jit(lambda *a, impl=impl, options=options: jnp.concatenate([x.reshape(-1) for x in rope_write(
            *a[:6], num_heads=heads, num_kv_heads=kv_heads, q_norm=a[6], k_norm=a[7], impl=impl, **options)]))
            for impl in ("pallas", "xla")}
        args = (qkv, cos, sin, *caches, lengths, *norms)
        entry = dict(measure="check", name=f"rope_write_b{batch}_t{rows}_h{heads}_{kv_heads}_d{head_dim}_qknorm{qk_norm}"
                                           + "".join(f"_{k}" for k in options))
        # NaN -> a sentinel: a row written where it must not be, or left unwritten, mismatches
        yield _compare(entry, lambda: np.nan_to_num(np.asarray(fns["pallas"](*args), np.float32), nan=1e4),
                       lambda: np.nan_to_num(np.asarray(fns["xla"](*args), np.float32), nan=1e4), (2e-2, 1e-2))


def check_wide_swapped(max_len_cap=None, seed=0):
    """The wide-head kernel with the rows on WGMMA's N axis against the reference."""
    from pallas_kernels.attention.wide_head_swapped import decode_attention_swapped

    # (name, case, kernel kwargs): 31B's 72 rows (two row groups, one), E4B's 20 (GQA 4: q padded by
    # XLA), 31B decode
    cases = [
        ("swapped_31b_full_9rows", dict(batch=3, num_q=9, num_q_heads=32, num_kv_heads=4, max_len=3008), {}),
        ("swapped_31b_full_9rows_one_group", dict(batch=2, num_q=9, num_q_heads=32, num_kv_heads=4, max_len=1024),
         dict(row_groups=1)),
        ("swapped_e4b_full_5rows", dict(batch=4, num_q=5, num_q_heads=8, num_kv_heads=2, max_len=4992), {}),
        ("swapped_31b_full_1row", dict(batch=2, num_q=1, num_q_heads=32, num_kv_heads=4, max_len=512), {}),
    ]
    for name, case_kw, call_kw in cases:
        if max_len_cap and case_kw["max_len"] > max_len_cap:
            continue
        case = make_case(zlib.crc32(name.encode()) % 1000 + seed, head_dim=512, dtype=jnp.bfloat16, **case_kw)
        a = (case["q"], case["k"], case["v"], case["kv_lengths"], case["q_positions"])
        kernel = jax.jit(lambda q, k, v, lens, p: decode_attention_swapped(q, k, v, lens, q_positions=p, scale=1.0,
                                                                           **call_kw))
        reference = jax.jit(lambda q, k, v, lens, p: decode_attention(q, k, v, lens, q_positions=p, scale=1.0,
                                                                      impl="xla"))
        entry = dict(measure="check", name=name, **case_kw, head_dim=512, dtype="bfloat16", **call_kw)
        yield _compare(entry, lambda: kernel(*a), lambda: reference(*a), (2e-2, 2e-2))


def run_check(max_len_cap=None, seed=0, max_weight=None, per_kernel=None) -> list[dict]:
    """One ``check`` row per case, each printed as it finishes (``max_len_cap`` / ``max_weight``: skip
    the attention cases with longer caches and the matmul cases with larger weights; ``per_kernel``: the
    first that many cases of each kernel left, e.g. 1 for a smoke run that still checks every kernel)."""

    def first(cases):
        return cases if per_kernel is None else itertools.islice(cases, per_kernel)

    rows = []
    cases = itertools.chain(first(check_decode_attention(max_len_cap, seed)),
                            # a split-merge case is a shape with a row per split count: limited by shapes
                            check_split_merge(max_len_cap, seed=seed, max_shapes=per_kernel),
                            first(check_gather_rows(seed)), first(check_add_rms_norm(seed)),
                            first(check_fused_matmul(seed, max_weight)), first(check_rope_write(seed)),
                            first(check_wide_swapped(max_len_cap, seed)))
    for entry in cases:
        rows.append(entry)
        print(json.dumps(entry, default=float))
    return rows
