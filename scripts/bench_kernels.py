#!/usr/bin/env python
"""Benchmarks (and GPU correctness checks) for the jspec Pallas kernels.

Subcommands (``python scripts/bench_kernels.py <cmd> --help``):

  copy-bandwidth    device copy bandwidth (torch ``copy_`` if torch imports, else a JAX copy)
  check             kernels vs their jnp references on the current device (exit 1 on a mismatch)
  decode-attention  decode / verify attention: Pallas kernel vs jnp reference vs cuDNN
  gather-rows       last-position slicing (+ RMSNorm): Pallas kernel vs XLA gather + norm
  plot              PNG from a decode-attention JSON
  merge             merge decode-attention JSONs of several runs (later runs win) + PNG
  all               all of the above into --out (JSON + PNG), the recorded run

Timing: each measurement jits ``--inner`` dependent calls (the output of one call feeds the
next, so nothing is hoisted or fused across calls and host dispatch is amortised), runs it
twice to warm up, then reports the median over ``--repeats`` runs divided by ``--inner``.
Bandwidth = bytes of K and V the attention must read (``batch * kv_heads * length * head_dim *
2 tensors * itemsize``) / time, compared with the copy bandwidth measured in the same run.

Reproduce the recorded numbers (GPU machine, from the repository root):

  PYTHONPATH=. python scripts/bench_kernels.py all --out benchmarks
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

# ---------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------


def _ints(text):
    return [int(t) for t in str(text).split(",") if t]


def device_info():
    import jax

    dev = jax.devices()[0]
    return dict(
        device=getattr(dev, "device_kind", str(dev)),
        platform=dev.platform,
        jax_version=jax.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def time_chained(step, carry, *args, inner=10, repeats=10):
    """Median seconds per call of ``carry = step(carry, *args)``, ``inner`` calls per jit."""
    import jax

    def chained(c, *a):
        for _ in range(inner):
            c = step(c, *a)
        return c

    fn = jax.jit(chained)
    for _ in range(2):  # two warm-ups: compile, and the once-per-process Pallas retrace
        jax.block_until_ready(fn(carry, *args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(carry, *args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / inner


def copy_bandwidth(nbytes=2 << 30):
    """Bytes read + written per second of a device copy, best method (``jspec.benchmarking``)."""
    from jspec.benchmarking import copy_bandwidth as measure

    bw = measure(nbytes)
    return dict(method=bw["method"], bytes=nbytes, tb_s=bw["bytes_per_s"] / 1e12)


# ---------------------------------------------------------------------------------------------
# correctness on the device
# ---------------------------------------------------------------------------------------------


def _decode_check_cases():
    # (name, case kwargs, call kwargs)
    base = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
    return [
        ("decode_gqa4_d128_bf16", dict(batch=4, num_q=1, max_len=4096, dtype="bfloat16", **base), {}),
        ("decode_b8_block_k32_bf16", dict(batch=8, num_q=1, max_len=5000, dtype="bfloat16", **base), {}),
        ("verify_gqa4_d128_bf16", dict(batch=3, num_q=5, max_len=3001, dtype="bfloat16", **base), {}),
        ("tree9_window_bf16", dict(batch=2, num_q=9, max_len=2048, dtype="bfloat16", tree=True, **base), dict(window=700)),
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
    ]


def make_case(seed, *, batch, num_q, num_q_heads, num_kv_heads, max_len, head_dim, dtype, tree=False):
    """Random q/k/v (cache rows past each length NaN-poisoned), ragged lengths incl. num_q and max_len."""
    import jax.numpy as jnp

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
        q=jnp.asarray(q, dtype), k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype),
        kv_lengths=jnp.asarray(lengths, jnp.int32), q_positions=jnp.asarray(positions, jnp.int32),
        tail_mask=None if tail_mask is None else jnp.asarray(tail_mask),
    )


def _check_split_merge(max_len_cap=None, draws=6, repeats=3):
    """The split programs of a sequence leave partials that the last to arrive (found with an
    atomic counter) or a combine kernel merges. Races would show as wrong or unsteady outputs,
    so: ragged batches with fresh random lengths (0 included, rows past each length NaN) for
    several split counts, each call repeated; every output must match the reference and repeat
    bit for bit (the merge runs in slot order, whichever program arrives last)."""
    import jax

    from jspec.benchmarking import decode_attention_inputs
    from pallas_kernels.decode_attention import decode_attention_pallas, decode_attention_reference
    from pallas_kernels.decode_tiling import default_config

    rng = np.random.default_rng(1)
    hq, hkv, head_dim = 32, 8, 128
    if jax.default_backend() != "gpu":  # interpreted: one draw, and no race to look for
        draws, repeats = 1, 1
    ref_fn = jax.jit(lambda q, k, v, l, p: decode_attention_reference(q, k, v, l, q_positions=p))
    entries = []
    shapes = [(1, 1, 20000), (8, 1, 4096), (32, 1, 2048), (8, 5, 4096), (3, 9, 3000), (3, 1, 512)]
    for batch, num_q, max_len in shapes:
        if max_len_cap and max_len > max_len_cap:
            continue
        default = default_config(batch, num_q, hq, hkv, max_len, head_dim)["k_splits"]
        for k_splits in sorted({2, default, 4 * default}):
            fn = jax.jit(lambda q, k, v, l, p, s=k_splits: decode_attention_pallas(q, k, v, l, q_positions=p, k_splits=s))
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
            entries.append(dict(name=f"split_merge_b{batch}_q{num_q}_len{max_len}_splits{k_splits}", draws=draws,
                                repeats=repeats, max_abs_err=worst, unsteady_repeats=unsteady,
                                passed=bool(worst <= 2e-2 and unsteady == 0)))
    return entries


def run_check(max_len_cap=None):
    import zlib

    import jax
    import jax.numpy as jnp

    from pallas_kernels import decode_attention, gather_rows

    results = []
    ok_all = True
    for name, case_kw, call_kw in _decode_check_cases():
        if max_len_cap and case_kw["max_len"] > max_len_cap:
            continue
        dtype = jnp.dtype(case_kw.pop("dtype"))
        case = make_case(zlib.crc32(name.encode()) % 1000, dtype=dtype, **case_kw)
        fns = {
            impl: jax.jit(
                lambda q, k, v, l, p, t, impl=impl: decode_attention(
                    q, k, v, l, q_positions=p, tail_mask=t, impl=impl, **call_kw
                )
            )
            for impl in ("pallas", "xla")
        }
        a = (case["q"], case["k"], case["v"], case["kv_lengths"], case["q_positions"], case["tail_mask"])
        entry = dict(name=name, **{k: v for k, v in case_kw.items()}, dtype=str(dtype), **call_kw)
        try:
            out = np.asarray(fns["pallas"](*a), np.float32)
            ref = np.asarray(fns["xla"](*a), np.float32)
            err = float(np.max(np.abs(out - ref)))
            tol = 2e-5 if dtype == jnp.float32 else 2e-2
            finite = bool(np.isfinite(out).all())
            passed = finite and bool(np.allclose(out, ref, atol=tol, rtol=tol))
            entry.update(max_abs_err=err, finite=finite, passed=passed)
        except Exception as exc:  # noqa: BLE001 - record and go on
            entry.update(passed=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        ok_all &= entry["passed"]
        results.append(entry)
        print(json.dumps(entry))

    for entry in _check_split_merge(max_len_cap):
        ok_all &= entry["passed"]
        results.append(entry)
        print(json.dumps(entry))

    rng = np.random.default_rng(0)
    for batch, seq_len, hidden, n, norm in [(4, 37, 2048, None, True), (3, 9, 3072, 5, True), (2, 5, 5000, 2, False)]:
        x = jnp.asarray(rng.standard_normal((batch, seq_len, hidden)), jnp.bfloat16)
        rows = jnp.asarray(rng.integers(-seq_len, seq_len, size=(batch,) if n is None else (batch, n)), jnp.int32)
        w = jnp.asarray(1 + rng.standard_normal(hidden), jnp.bfloat16) if norm else None
        entry = dict(name=f"gather_rows_{batch}x{seq_len}x{hidden}_n{n}_norm{norm}")
        try:
            out = np.asarray(jax.jit(lambda x, r, w: gather_rows(x, r, norm_weight=w, impl="pallas"))(x, rows, w), np.float32)
            ref = np.asarray(jax.jit(lambda x, r, w: gather_rows(x, r, norm_weight=w, impl="xla"))(x, rows, w), np.float32)
            err = float(np.max(np.abs(out - ref)))
            entry.update(max_abs_err=err, passed=bool(np.allclose(out, ref, atol=2e-2, rtol=1e-2)))
        except Exception as exc:  # noqa: BLE001
            entry.update(passed=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        ok_all &= entry["passed"]
        results.append(entry)
        print(json.dumps(entry))
    return dict(passed=ok_all, cases=results)


# ---------------------------------------------------------------------------------------------
# decode attention benchmark
# ---------------------------------------------------------------------------------------------


def bench_decode_one(batch, num_q, context, *, hq=32, hkv=8, head_dim=128, lengths=None, impls=("pallas", "xla", "cudnn"),
                     inner=10, repeats=10, kernel_kw=None, device_time=True, device_repeats=5):
    """Wall time per call (``ms``, ``inner`` chained calls per dispatch) and, with ``device_time``,
    the summed GPU time of the kernels of one call after an L2 flush (``device_ms``, from the
    profiler; median of ``device_repeats`` calls)."""
    import jax
    import jax.numpy as jnp

    from jspec.benchmarking import decode_attention_inputs, gpu_kernel_times

    from pallas_kernels.decode_attention import decode_attention_pallas, decode_attention_reference

    lengths = [context] * batch if lengths is None else list(lengths)
    q, k, v, lens, pos = decode_attention_inputs(batch, num_q, hq, hkv, context, head_dim, lengths)
    kv_bytes = 2 * hkv * head_dim * 2 * int(sum(lengths))
    row = dict(batch=batch, num_q=num_q, max_len=context, mean_length=float(np.mean(lengths)), kv_bytes=kv_bytes, ms={})
    kernel_kw = kernel_kw or {}
    # cuDNN gets its own layout [B, S, Hkv, D], transposed outside the timed region. Non-causal
    # with key lengths: for num_q > 1 it skips the causal rule among the last num_q rows.
    steps = {
        "pallas": (lambda c, k, v, l, p: decode_attention_pallas(c, k, v, l, q_positions=p, **kernel_kw), (k, v, lens, pos)),
        "xla": (lambda c, k, v, l, p: decode_attention_reference(c, k, v, l, q_positions=p), (k, v, lens, pos)),
        "cudnn": (lambda c, k, v, l: jax.nn.dot_product_attention(c, k, v, key_value_seq_lengths=l, implementation="cudnn"),
                  (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lens) if "cudnn" in impls else ()),
    }
    row["device_ms"] = {}
    for impl in impls:
        step, args = steps[impl]
        try:
            row["ms"][impl] = time_chained(step, q, *args, inner=inner, repeats=repeats) * 1e3
            if device_time:
                one_call = functools.partial(jax.jit(step), q, *args)
                # Warm up (compile) once; every traced call is still cold, after its own L2 flush.
                samples = [sum(t for _, t in gpu_kernel_times(one_call, warmup=2 if i == 0 else 0,
                                                              flush_l2_bytes=256 << 20))
                           for i in range(device_repeats)]
                row["device_ms"][impl] = float(np.median(samples)) * 1e3 if any(samples) else None
        except Exception as exc:  # noqa: BLE001 - e.g. cuDNN refusing a shape
            row["ms"][impl] = None
            row.setdefault("errors", {})[impl] = f"{type(exc).__name__}: {str(exc)[:300]}"
    del steps, args, q, k, v  # the cuDNN-layout copies go with them
    return row


def _finish_row(row, copy_tb_s):
    """Bandwidth, fraction of copy and speed-ups, from the wall times (``ms``) and, where
    measured, from the kernels' GPU times (``device_ms`` -> ``device_*``)."""
    for src, prefix in (("ms", ""), ("device_ms", "device_")):
        times = row.get(src) or {}
        if not any(times.values()):
            continue
        row[f"{prefix}tb_s"] = {i: (row["kv_bytes"] / (t * 1e-3) / 1e12 if t else None) for i, t in times.items()}
        if copy_tb_s:
            row[f"{prefix}frac_of_copy"] = {i: (b / copy_tb_s if b else None) for i, b in row[f"{prefix}tb_s"].items()}
        p = times.get("pallas")
        for other in ("xla", "cudnn"):
            o = times.get(other)
            row[f"{prefix}speedup_vs_{other}"] = (o / p) if (p and o) else None
    return row


def run_decode(args, copy_tb_s=None, save=None):
    from tqdm import tqdm

    from pallas_kernels.decode_tiling import default_config

    hq, hkv, head_dim = args.heads
    heads = dict(hq=hq, hkv=hkv, head_dim=head_dim)
    kv_row_bytes = 2 * hkv * head_dim * 2  # K and V of one cache row, bf16
    configs = [(b, qn, c) for qn in args.queries for b in args.batches for c in args.contexts]
    configs = [cfg for cfg in configs if kv_row_bytes * cfg[0] * cfg[2] <= args.max_kv_gb * 1e9]
    rows = []
    for batch, num_q, context in tqdm(configs, desc="decode-attention", file=sys.stdout):
        impls = ["pallas", "xla"]
        if 2 * kv_row_bytes * batch * context <= args.max_kv_gb * 1e9:  # room for cuDNN's copy
            impls.append("cudnn")
        row = bench_decode_one(batch, num_q, context, impls=impls, inner=args.inner, repeats=args.repeats,
                               device_repeats=args.device_repeats, **heads)
        row["config"] = default_config(batch, num_q, hq, hkv, context, head_dim)
        rows.append(_finish_row(row, copy_tb_s))
        if save:
            save(rows, [])
    # Ragged batches in a long cache: the kernel reads only each row's length.
    ragged = []
    rng = np.random.default_rng(0)
    for batch, max_len in args.ragged:
        lengths = rng.integers(1, max_len + 1, size=batch)
        lengths[0] = max_len
        for num_q in args.queries:
            lengths = np.maximum(lengths, num_q)
            row = bench_decode_one(batch, num_q, max_len, lengths=lengths, impls=["pallas", "xla", "cudnn"],
                                   inner=args.inner, repeats=args.repeats, device_repeats=args.device_repeats,
                                   **heads)
            ragged.append(_finish_row(row, copy_tb_s))
            if save:
                save(rows, ragged)
    return rows, ragged


def run_qscan(args, copy_tb_s=None):
    """Many query rows (big trees, prefill chunks): where the kernel stops paying off."""
    from tqdm import tqdm

    rows = []
    for batch, num_q, context in tqdm(args.qscan, desc="num_q scan", file=sys.stdout):
        row = bench_decode_one(batch, num_q, context, impls=("pallas", "xla"), inner=args.inner, repeats=args.repeats,
                               device_repeats=args.device_repeats)
        rows.append(_finish_row(row, copy_tb_s))
    return rows


def run_sweep(args, copy_tb_s=None):
    from tqdm import tqdm

    from pallas_kernels.decode_tiling import default_config

    out = []
    shapes = args.sweep_shapes
    jobs = []
    for batch, num_q, context in shapes:
        default = default_config(batch, num_q, 32, 8, context, 128)
        splits = [default["k_splits"] // 2, default["k_splits"] * 2]
        shape_variants = [{}] + [dict(k_splits=s) for s in splits if s >= 1]
        if num_q > 1:
            shape_variants += [dict(block_k=128, num_warps=8, num_stages=2), dict(block_k=128, num_warps=4, num_stages=3),
                               dict(block_k=64, num_warps=8, num_stages=3), dict(block_k=64, num_warps=4, num_stages=2)]
        else:  # one row: how much of the cache is in flight (splits x block_k x stages), and the warps
            other_k = 96 - default["block_k"]  # 32 <-> 64
            shape_variants += [dict(block_k=other_k), dict(block_k=other_k, k_splits=default["k_splits"] * 2),
                               dict(block_k=other_k, k_splits=max(1, default["k_splits"] // 2)), dict(num_stages=2),
                               dict(num_stages=4), dict(num_warps=8), dict(block_k=128, num_stages=2)]
        jobs += [(batch, num_q, context, kw) for kw in shape_variants]
    # Rounds interleave every variant of every shape, so drift on a shared GPU hits all of them alike;
    # the default variant also times cuDNN in each round, as the yardstick.
    for round_index in range(args.sweep_rounds):
        for batch, num_q, context, kw in tqdm(jobs, desc=f"sweep round {round_index + 1}", file=sys.stdout):
            impls = ("pallas",) if kw else ("pallas", "cudnn")
            row = bench_decode_one(batch, num_q, context, impls=impls, inner=args.inner,
                                   repeats=max(3, args.repeats // 2), kernel_kw=kw, device_repeats=args.device_repeats)
            row.update(kernel_kw=kw, round=round_index)
            out.append(_finish_row(row, copy_tb_s))
    return out


# ---------------------------------------------------------------------------------------------
# gather rows benchmark
# ---------------------------------------------------------------------------------------------


def run_gather(args):
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from pallas_kernels.gather_rows import gather_rows_pallas, gather_rows_reference

    rows_out = []
    configs = [(b, t, h, n) for b in (1, 8, 32) for t in (128, 2048) for h in (2048, 4096) for n in (None, 5)]
    for batch, seq_len, hidden, n in tqdm(configs, desc="gather-rows", file=sys.stdout):
        x = jax.random.normal(jax.random.key(1), (batch, seq_len, hidden), jnp.bfloat16)
        w = jnp.ones((hidden,), jnp.bfloat16)
        rows = jnp.full((batch,) if n is None else (batch, n), seq_len - 1, jnp.int32)
        entry = dict(batch=batch, seq_len=seq_len, hidden=hidden, n=n, ms={})
        for impl, fn in (("pallas", gather_rows_pallas), ("xla", gather_rows_reference)):
            # Chain: the next row index depends on this output (0 in practice), so calls stay separate.
            def step(r, x, w, fn=fn):
                out = fn(x, r, norm_weight=w, eps=1e-6)
                dep = (out.reshape(out.shape[0], -1)[:, :1] > 1e30).astype(jnp.int32)
                return r - dep.reshape((-1,) + (1,) * (r.ndim - 1))

            entry["ms"][impl] = time_chained(step, rows, x, w, inner=args.inner, repeats=args.repeats) * 1e3
        entry["speedup_vs_xla"] = entry["ms"]["xla"] / entry["ms"]["pallas"]
        rows_out.append(entry)
    return rows_out


# ---------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------


def plot_decode(data, png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    queries = sorted({r["num_q"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(queries), len(batches), figsize=(4.2 * len(batches), 3.4 * len(queries)), squeeze=False)
    copy = data.get("copy_bandwidth", {}).get("tb_s")
    for qi, num_q in enumerate(queries):
        for bi, batch in enumerate(batches):
            ax = axes[qi][bi]
            sel = sorted((r for r in rows if r["num_q"] == num_q and r["batch"] == batch), key=lambda r: r["max_len"])
            names = {"pallas": "Pallas kernel", "xla": "jnp reference", "cudnn": "cuDNN dot_product_attention"}
            for color, (impl, style) in enumerate((("pallas", "o-"), ("xla", "s--"), ("cudnn", "^:"))):
                # filled: wall time of chained calls; hollow, thin: the kernels' GPU time (profiler)
                for key, extra, suffix in (("tb_s", {}, ""), ("device_tb_s", dict(mfc="none", lw=0.8), ", GPU time")):
                    pts = [(r["max_len"], r[key].get(impl)) for r in sel if r.get(key, {}).get(impl)]
                    if pts:
                        ax.plot(*zip(*pts), style, color=f"C{color}", label=names[impl] + suffix, **extra)
            if copy:
                ax.axhline(copy, color="gray", lw=0.8, label=f"copy {copy:.2f} TB/s")
                ax.axhline(0.8 * copy, color="gray", lw=0.8, ls=":", label="80% of copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"batch {batch}, {num_q} query row(s)")
            ax.set_xlabel("context (KV rows)")
            ax.set_ylabel("K+V read / time (TB/s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode attention, bf16, Hq 32 / Hkv 8, head_dim 128 -- {data['info']['device']}, jax {data['info']['jax_version']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def merge_decode(paths, out_json, out_png=None):
    """Merge decode-attention JSONs: a later file's rows replace an earlier file's rows of the same
    (batch, num_q, max_len, mean_length); sweeps and num_q scans are concatenated. Each row keeps
    the fraction of the copy bandwidth measured in its own run."""
    runs, merged = [], {}
    sweep, qscan, ragged = [], {}, {}
    data = None
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs.append(dict(file=Path(path).name, info=data["info"], copy_bandwidth=data["copy_bandwidth"]))
        for r in data["rows"]:
            merged[(r["batch"], r["num_q"], r["max_len"], r["mean_length"])] = dict(r, run=Path(path).name)
        for r in data.get("ragged", []):
            ragged[(r["batch"], r["num_q"], r["max_len"], r["mean_length"])] = dict(r, run=Path(path).name)
        for r in data.get("qscan", []):
            qscan[(r["batch"], r["num_q"], r["max_len"])] = dict(r, run=Path(path).name)
        sweep += [dict(r, run=Path(path).name) for r in data.get("sweep", [])]
    out = dict(data, runs=runs, rows=sorted(merged.values(), key=lambda r: (r["num_q"], r["batch"], r["max_len"])),
               ragged=list(ragged.values()), qscan=list(qscan.values()), sweep=sweep)
    Path(out_json).write_text(json.dumps(out, indent=1))
    if out_png:
        plot_decode(out, out_png)
    return out


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _add_timing(p):
    p.add_argument("--inner", type=int, default=10, help="dependent calls per jitted program (default 10)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs; the median is reported (default 10)")
    p.add_argument("--device-repeats", type=int, default=5,
                   help="profiled calls per implementation; the median GPU time is reported (default 5)")
    p.add_argument("--out", type=Path, default=Path("benchmarks"), help="output folder (default benchmarks/)")


def _add_decode(p):
    p.add_argument("--batches", type=_ints, default=[1, 8, 32])
    p.add_argument("--contexts", type=_ints, default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--queries", type=_ints, default=[1, 5])
    p.add_argument("--heads", type=lambda s: tuple(_ints(s.replace("x", ","))), default=(32, 8, 128),
                   help="'QHEADSxKVHEADSxHEAD_DIM' (default 32x8x128, Llama-3.1-8B; Gemma 4 31B full layers: 32x4x512)")
    p.add_argument("--max-kv-gb", type=float, default=20.0, help="skip sizes whose K+V exceed this (default 20 GB)")
    p.add_argument("--ragged", type=lambda s: [tuple(_ints(t.replace("x", ","))) for t in s.split(";") if t],
                   default=[(8, 32768), (32, 8192)], help="ragged batches 'BxMAXLEN;...' (lengths uniform in 1..max)")
    p.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep (block_k, warps, stages, splits)")
    p.add_argument("--sweep-rounds", type=int, default=1, help="interleaved rounds of the sweep (default 1)")
    p.add_argument("--sweep-shapes", type=lambda s: [tuple(_ints(t.replace("x", ","))) for t in s.split(";") if t],
                   default=[(1, 1, 131072), (8, 5, 32768), (32, 1, 8192)], help="'BATCHxQUERIESxCONTEXT;...'")
    p.add_argument("--check-max-len", type=int, default=None, help="check: skip cases with a longer cache")
    p.add_argument("--qscan", type=lambda s: [tuple(_ints(t.replace("x", ","))) for t in s.split(";") if t],
                   default=[(1, 16, 4096), (1, 64, 4096), (8, 16, 32768), (8, 64, 32768), (1, 512, 4096)],
                   help="'BATCHxQUERIESxCONTEXT;...' for the num_q scan ('' to skip)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("copy-bandwidth", help="device copy bandwidth")
    p_check = sub.add_parser("check", help="kernels vs references on this device")
    p_check.add_argument("--out", type=Path, default=None)
    p_check.add_argument("--check-max-len", type=int, default=None, help="skip cases with a longer cache")
    p_dec = sub.add_parser("decode-attention", help="decode attention benchmark")
    _add_timing(p_dec)
    _add_decode(p_dec)
    p_gat = sub.add_parser("gather-rows", help="gather-rows benchmark")
    _add_timing(p_gat)
    p_plot = sub.add_parser("plot", help="PNG from a decode-attention JSON")
    p_plot.add_argument("json", type=Path)
    p_plot.add_argument("png", type=Path)
    p_merge = sub.add_parser("merge", help="merge decode-attention JSONs (later runs win) into one JSON + PNG")
    p_merge.add_argument("out_json", type=Path)
    p_merge.add_argument("inputs", type=Path, nargs="+")
    p_merge.add_argument("--png", type=Path, default=None)
    p_all = sub.add_parser("all", help="copy bandwidth, check, decode-attention (+ sweep), gather-rows; JSON + PNG")
    _add_timing(p_all)
    _add_decode(p_all)
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.cmd == "plot":
        plot_decode(json.loads(args.json.read_text()), args.png)
        return 0
    if args.cmd == "merge":
        merge_decode(args.inputs, args.out_json, args.png)
        return 0
    copy = copy_bandwidth() if args.cmd in ("copy-bandwidth", "decode-attention", "all") else None
    if copy:
        print("copy bandwidth:", json.dumps(copy))
    if args.cmd == "copy-bandwidth":
        return 0
    info = device_info()
    print(json.dumps(info))
    status = 0
    if args.cmd in ("check", "all"):
        t0 = time.time()
        check = run_check(args.check_max_len)
        print(f"check: passed={check['passed']} ({time.time() - t0:.1f} s)")
        status = 0 if check["passed"] else 1
        out = args.out
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "decode_attention_check.json").write_text(json.dumps(dict(info=info, **check), indent=1))
    if args.cmd in ("decode-attention", "all"):
        args.out.mkdir(parents=True, exist_ok=True)
        data = dict(
            info=info, copy_bandwidth=copy, shape=dict(num_q_heads=args.heads[0], num_kv_heads=args.heads[1], head_dim=args.heads[2], dtype="bfloat16"),
            method=f"ms: median of {args.repeats} runs of a jit with {args.inner} chained calls, divided by {args.inner}; "
                   "device_ms: GPU time of the kernels of one call after an L2 flush (profiler)",
            rows=[], ragged=[], sweep=[],
        )
        path = args.out / "decode_attention.json"

        def save(rows, ragged):
            data.update(rows=rows, ragged=ragged)
            path.write_text(json.dumps(data, indent=1))

        if not args.no_sweep:  # first: it decides the defaults of the next recorded run
            t0 = time.time()
            data["sweep"] = run_sweep(args, copy["tb_s"])
            print(f"sweep: {time.time() - t0:.1f} s")
            path.write_text(json.dumps(data, indent=1))
            for r in data["sweep"]:
                print(json.dumps({k: r[k] for k in ("batch", "num_q", "max_len", "kernel_kw", "ms")}))
        t0 = time.time()
        rows, ragged = run_decode(args, copy["tb_s"], save)
        print(f"decode-attention: {time.time() - t0:.1f} s")
        data["qscan"] = run_qscan(args, copy["tb_s"])
        path.write_text(json.dumps(data, indent=1))
        try:
            plot_decode(data, args.out / "decode_attention.png")
        except Exception as exc:  # noqa: BLE001 - no matplotlib: the JSON is enough, plot later
            print("plot failed:", exc)
        for r in rows + ragged + data["qscan"]:
            print(json.dumps({k: r[k] for k in ("batch", "num_q", "max_len", "mean_length", "ms", "tb_s")}))
    if args.cmd in ("gather-rows", "all"):
        args.out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        rows = run_gather(args)
        print(f"gather-rows: {time.time() - t0:.1f} s")
        (args.out / "gather_rows.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
        for r in rows:
            print(json.dumps(r))
    return status


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    sys.exit(main())
