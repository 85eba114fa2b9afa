"""kernels: benchmarks and GPU correctness checks of the Pallas kernels.

Actions (``python -m jspec.bench kernels <action> --help``):

  copy-bandwidth    device copy bandwidth (torch ``copy_`` if torch imports, else a JAX copy)
  check             kernels vs their jnp references on this device (exit 1 on a mismatch)
  decode-attention  decode / verify attention: Pallas kernel vs jnp reference vs cuDNN (and
                    tokamax's Mosaic GPU / Triton attention where tokamax is installed)
  draft-attention-gemma4  the same at Gemma 4's shapes (head_dim 256 / 512, windows), GPU time
  gather-rows       last-position slicing (+ RMSNorm): Pallas kernel vs XLA gather + norm
  plot              PNG from a decode-attention JSON
  merge             merge decode-attention JSONs of several runs (later runs win) + PNG
  all               copy-bandwidth, check, decode-attention, gather-rows into --out, the recorded run

``--out`` is a folder; the files have fixed names (``copy_bandwidth.json``,
``decode_attention_check.json``, ``decode_attention.json/png``, ``draft_attention_gemma4.json/png``,
``gather_rows.json``).
Timing: each measurement jits ``--inner`` dependent calls (the output of one call feeds the
next, so nothing is hoisted or fused across calls and host dispatch is amortised), runs it
twice to warm up, then reports the median over ``--repeats`` runs divided by ``--inner``; on a
GPU also the kernels' own time of one call after an L2 flush (profiler, ``--device-repeats``
calls). Bandwidth = bytes of K and V the attention must read / time, against the copy bandwidth
measured in the same run.

  python -m jspec.bench kernels all --out benchmarks
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np

from jspec.bench import draft_attention, peers, plots, report
from jspec.bench.flags import common, int_tuples, ints, subcommand

DECODE_NOTES = ("ms: median of --repeats runs of a jit with --inner chained calls, divided by --inner; device_ms: "
                "GPU time of the kernels of one call after an L2 flush (profiler), median of --device-repeats calls")


def bench_decode_one(batch, num_q, context, *, hq=32, hkv=8, head_dim=128, lengths=None,
                     impls=("pallas", "xla", "cudnn"), inner=10, repeats=10, kernel_kw=None, device_repeats=5,
                     dtype="bfloat16", seed=0, block=False):
    """Wall time per call (``ms``) and, on a GPU, the summed GPU time of the kernels of one call
    after an L2 flush (``device_ms``), with their spreads in ``timings``. ``block``: the last
    ``num_q`` rows see one another both ways (an all-true tail mask: a DFlash block, which is also
    what cuDNN's non-causal attention with key lengths computes); else causal among them."""
    import jax
    import jax.numpy as jnp

    from jspec.bench.kernel_check import decode_attention_inputs
    from jspec.bench.timing import chained, gpu_seconds, time_fn
    from pallas_kernels.attention.decode_attention import decode_attention_pallas, decode_attention_reference

    lengths = [context] * batch if lengths is None else list(lengths)
    dtype = jnp.dtype(dtype)
    q, k, v, lens, pos = decode_attention_inputs(batch, num_q, hq, hkv, context, head_dim, lengths, seed=seed,
                                                 dtype=dtype)
    kv_bytes = 2 * hkv * head_dim * dtype.itemsize * int(sum(lengths))
    tail = jnp.ones((batch, num_q, num_q), bool) if block else None
    row = dict(measure="decode_attention", batch=batch, num_q=num_q, block=block, max_len=context,
               mean_length=float(np.mean(lengths)), num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
               dtype=dtype.name, kv_bytes=kv_bytes, ms={}, device_ms={}, timings={})
    # cuDNN and tokamax get their own layout [B, S, Hkv, D], transposed outside the timed region.
    # Non-causal with key lengths: for num_q > 1 they skip the causal rule among the last num_q rows.
    own_layout = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lens) if set(impls) - {"pallas", "xla"} else ()
    steps = {
        "pallas": (lambda c, k, v, lens, p: decode_attention_pallas(c, k, v, lens, q_positions=p, tail_mask=tail,
                                                                    **(kernel_kw or {})),
                   (k, v, lens, pos)),
        "xla": (lambda c, k, v, lens, p: decode_attention_reference(c, k, v, lens, q_positions=p, tail_mask=tail),
                (k, v, lens, pos)),
        "cudnn": (lambda c, k, v, lens: jax.nn.dot_product_attention(c, k, v, key_value_seq_lengths=lens,
                                                                     implementation="cudnn"),
                  own_layout),
        **{name: (peers.attention(name), own_layout) for name in peers.ATTENTION},
    }
    for impl in impls:
        step, args = steps[impl]
        try:
            # two warm-ups: compile, and the once-per-process Pallas retrace
            wall = time_fn(functools.partial(chained(step, inner), q, *args), warmup=2, repeats=repeats).per(inner)
            row["ms"][impl] = wall.median_s * 1e3
            row["timings"][impl] = wall.as_dict()
            gpu = gpu_seconds(functools.partial(jax.jit(step), q, *args), repeats=device_repeats)
            row["device_ms"][impl] = None if gpu is None else gpu.median_s * 1e3
            if gpu is not None:
                row["timings"][f"{impl}_gpu"] = gpu.as_dict("us")
        except Exception as exc:  # noqa: BLE001 - e.g. cuDNN refusing a shape
            row["ms"][impl] = None
            row.setdefault("errors", {})[impl] = f"{type(exc).__name__}: {str(exc)[:300]}"
    del steps, args, q, k, v, own_layout  # the peers' layout copies go with them
    return row


def finish_row(row, copy_tb_s, which):
    """Bandwidth, fraction of copy and speed-ups, from the wall times (``ms``) and, where
    measured, from the kernels' GPU times (``device_ms`` -> ``device_*``)."""
    row["set"] = which
    for src, prefix in (("ms", ""), ("device_ms", "device_")):
        times = row.get(src) or {}
        if not any(times.values()):
            continue
        row[f"{prefix}tb_s"] = {i: (row["kv_bytes"] / (t * 1e-3) / 1e12 if t else None) for i, t in times.items()}
        if copy_tb_s:
            row[f"{prefix}frac_of_copy"] = {i: (b / copy_tb_s if b else None) for i, b in row[f"{prefix}tb_s"].items()}
        p = times.get("pallas")
        for other in ("xla", "cudnn", *peers.ATTENTION):
            o = times.get(other)
            row[f"{prefix}speedup_vs_{other}"] = (o / p) if (p and o) else None
    return row


def _bench(args, batch, num_q, context, copy_tb_s, which, **kw):
    hq, hkv, head_dim = args.heads
    row = bench_decode_one(batch, num_q, context, hq=hq, hkv=hkv, head_dim=head_dim, inner=args.inner,
                           device_repeats=args.device_repeats, dtype=args.dtype, seed=args.seed, block=args.block,
                           **{"repeats": args.repeats, **kw})
    return finish_row(row, copy_tb_s, which)


def run_decode(args, copy_tb_s, save):
    """The grid (every batch x query rows x context), then ragged batches in a long cache."""
    from tqdm import tqdm

    from pallas_kernels.attention.decode_tiling import tiling

    hq, hkv, head_dim = args.heads
    kv_row_bytes = 2 * hkv * head_dim * 2  # K and V of one cache row, bf16
    configs = [(b, qn, c) for qn in args.queries for b in args.batches for c in args.contexts]
    configs = [cfg for cfg in configs if kv_row_bytes * cfg[0] * cfg[2] <= args.max_kv_gb * 1e9]
    rows = []
    for batch, num_q, context in tqdm(configs, desc="decode-attention", file=sys.stdout):
        impls = ["pallas", "xla"]
        if 2 * kv_row_bytes * batch * context <= args.max_kv_gb * 1e9 and _has_cudnn():  # room for the peers' copy
            impls += ["cudnn", *peers.available(peers.ATTENTION)]
        row = _bench(args, batch, num_q, context, copy_tb_s, "grid", impls=impls)
        row["config"] = tiling(batch, num_q, hq, hkv, context, head_dim)
        rows.append(row)
        save(rows)
    # Ragged batches in a long cache: the kernel reads only each row's length.
    rng = np.random.default_rng(args.seed)
    for batch, max_len in args.ragged:
        lengths = rng.integers(1, max_len + 1, size=batch)
        lengths[0] = max_len
        for num_q in args.queries:
            lengths = np.maximum(lengths, num_q)
            impls = ["pallas", "xla"] + (["cudnn", *peers.available(peers.ATTENTION)] if _has_cudnn() else [])
            rows.append(_bench(args, batch, num_q, max_len, copy_tb_s, "ragged", lengths=lengths, impls=impls))
            save(rows)
    return rows


def _has_cudnn():
    import jax

    return jax.default_backend() == "gpu"


def run_qscan(args, copy_tb_s):
    """Many query rows (big trees, prefill chunks): where the kernel stops paying off."""
    from tqdm import tqdm

    return [_bench(args, batch, num_q, context, copy_tb_s, "qscan", impls=("pallas", "xla"))
            for batch, num_q, context in tqdm(args.qscan, desc="num_q scan", file=sys.stdout)]


def run_sweep(args, copy_tb_s):
    """Tiling variants of each --sweep-shapes shape, in interleaved rounds."""
    from tqdm import tqdm

    from pallas_kernels.attention.decode_tiling import tiling

    hq, hkv, head_dim = args.heads
    jobs = []
    for batch, num_q, context in args.sweep_shapes:
        default = tiling(batch, num_q, hq, hkv, context, head_dim)
        # Halved and doubled, and 1-2 (the merge in the kernel, one launch): at small shapes the
        # separate merge kernel can cost as much as the attention.
        splits = sorted({default["k_splits"] // 2, default["k_splits"] * 2, 1, 2} - {default["k_splits"], 0})
        shape_variants = [{}] + [dict(k_splits=s) for s in splits]
        if num_q > 1:
            shape_variants += [dict(block_k=128, num_warps=8, num_stages=2), dict(block_k=128, num_warps=4,
                                                                                  num_stages=3),
                               dict(block_k=64, num_warps=8, num_stages=3), dict(block_k=64, num_warps=4, num_stages=2)]
        else:  # one row: how much of the cache is in flight (splits x block_k x stages), and the warps
            other_k = 96 - default["block_k"]  # 32 <-> 64
            shape_variants += [dict(block_k=other_k), dict(block_k=other_k, k_splits=default["k_splits"] * 2),
                               dict(block_k=other_k, k_splits=max(1, default["k_splits"] // 2)), dict(num_stages=2),
                               dict(num_stages=4), dict(num_warps=8), dict(block_k=128, num_stages=2)]
        jobs += [(batch, num_q, context, kw) for kw in shape_variants]
    # Rounds interleave every variant of every shape, so drift on a shared GPU hits all of them alike;
    # the default variant also times cuDNN in each round, as the yardstick.
    out = []
    for round_index in range(args.sweep_rounds):
        for batch, num_q, context, kw in tqdm(jobs, desc=f"sweep round {round_index + 1}", file=sys.stdout):
            impls = ("pallas",) if kw or not _has_cudnn() else ("pallas", "cudnn")
            row = _bench(args, batch, num_q, context, copy_tb_s, "sweep", impls=impls, kernel_kw=kw,
                         repeats=max(3, args.repeats // 2))
            row.update(kernel_kw=kw, round=round_index)
            out.append(row)
    return out


def run_gather(args):
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from jspec.bench.timing import chained, time_fn
    from pallas_kernels.norm.gather_rows import gather_rows_pallas, gather_rows_reference

    rows_out = []
    configs = [(b, t, h, n) for b in (1, 8, 32) for t in (128, 2048) for h in (2048, 4096) for n in (None, 5)]
    if args.tiny:
        configs = [(2, 16, 256, None), (2, 16, 256, 3)]
    for batch, seq_len, hidden, n in tqdm(configs, desc="gather-rows", file=sys.stdout):
        x = jax.random.normal(jax.random.key(1 + args.seed), (batch, seq_len, hidden), jnp.dtype(args.dtype))
        w = jnp.ones((hidden,), x.dtype)
        rows = jnp.full((batch,) if n is None else (batch, n), seq_len - 1, jnp.int32)
        entry = dict(measure="gather_rows", batch=batch, seq_len=seq_len, hidden=hidden, n=n, ms={}, timings={})
        for impl, fn in (("pallas", gather_rows_pallas), ("xla", gather_rows_reference)):
            # Chain: the next row index depends on this output (0 in practice), so calls stay separate.
            def step(r, x, w, fn=fn):
                out = fn(x, r, norm_weight=w, eps=1e-6)
                dep = (out.reshape(out.shape[0], -1)[:, :1] > 1e30).astype(jnp.int32)
                return r - dep.reshape((-1,) + (1,) * (r.ndim - 1))

            timing = time_fn(functools.partial(chained(step, args.inner), rows, x, w), warmup=2,
                             repeats=args.repeats).per(args.inner)
            entry["ms"][impl] = timing.median_s * 1e3
            entry["timings"][impl] = timing.as_dict()
        entry["speedup_vs_xla"] = entry["ms"]["xla"] / entry["ms"]["pallas"]
        rows_out.append(entry)
    return rows_out


def merge_decode(paths, out_json, out_png=None, argv=()):
    """Merge decode-attention JSONs (this schema or the one before it): a later file's rows replace
    an earlier file's rows of the same (batch, num_q, max_len, mean_length) in the grid and the
    ragged set, and of the same (batch, num_q, max_len) in the num_q scan; sweeps are concatenated.
    Each row keeps the fraction of the copy bandwidth measured in its own run."""
    keyed, sweep, runs, env = {}, [], [], None
    for path in map(Path, paths):
        data = report.read(path)
        env, copy = plots.decode_attention_environment(data), data.get("copy_bandwidth")
        runs.append(dict(measure="run", file=path.name, environment=env, copy_bandwidth=copy))
        for r in plots.decode_attention_rows(data):
            r = dict(r, run=path.name)
            if r["set"] == "sweep":
                sweep.append(r)
            else:
                key = (r["batch"], r["num_q"], r["max_len"]) + (() if r["set"] == "qscan" else (r["mean_length"],))
                keyed[r["set"], key] = r
    rows = sorted(keyed.values(), key=lambda r: (r["set"] != "grid", r["num_q"], r["batch"], r["max_len"]))
    result = report.result("kernels merge", argv, env, runs + rows + sweep, copy_bandwidth=copy)
    report.write(out_json, result)
    if out_png:
        plots.decode_attention(result, out_png)
    return result


def run(args):
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
    action = args._command.split()[-1]
    if action == "plot":
        plots.decode_attention(report.read(args.json), args.png)
        return 0
    if action == "merge":
        merge_decode(args.inputs, args.out_json, args.png, args.argv)
        return 0
    from jspec.bench.roofline import copy_bandwidth

    env = report.environment(args.dtype, args.seed, weights="random inputs")
    copy = copy_bandwidth(args.copy_bytes) if action in ("copy-bandwidth", "decode-attention", "draft-attention-gemma4",
                                                         "all") else None
    if copy:
        print(f"copy bandwidth: {copy['tb_s']:.3f} TB/s ({copy['method']})")
    if action == "copy-bandwidth":
        if args.out:
            row = dict(measure="copy_bandwidth", **copy)
            result = report.result("kernels copy-bandwidth", args.argv, env, [row])
            report.write(args.out / "copy_bandwidth.json", result)
        return 0
    if action == "draft-attention-gemma4":
        draft_attention.run(args, env, copy)
        return 0
    status = 0
    if action in ("check", "all"):
        from jspec.bench.kernel_check import run_check

        t0 = time.time()
        rows = run_check(args.check_max_len, args.seed, args.check_max_weight, args.check_per_kernel)
        passed = all(r["passed"] for r in rows)
        print(f"check: passed={passed} ({time.time() - t0:.1f} s)")
        status = 0 if passed else 1
        if args.out:
            report.write(args.out / "decode_attention_check.json", report.result("kernels check", args.argv, env, rows))
    if action in ("decode-attention", "all"):
        path = args.out / "decode_attention.json"
        sweep = []

        def save(rows):
            report.write(path, report.result("kernels decode-attention", args.argv, env, rows + sweep,
                                             copy_bandwidth=copy, notes=DECODE_NOTES))

        if not args.no_sweep:  # first: it decides the defaults of the next recorded run
            sweep = run_sweep(args, copy["tb_s"])
            save([])
        rows = run_decode(args, copy["tb_s"], save)
        rows += run_qscan(args, copy["tb_s"])
        save(rows)
        try:
            plots.decode_attention(report.read(path), args.out / "decode_attention.png")
        except Exception as exc:  # noqa: BLE001 - no matplotlib: the JSON is enough, plot later
            print("plot failed:", exc)
    if action in ("gather-rows", "all"):
        rows = run_gather(args)
        report.write(args.out / "gather_rows.json", report.result("kernels gather-rows", args.argv, env, rows))
    return status


def _timing_flags(p):
    p.add_argument("--inner", type=int, default=10, help="dependent calls per jitted program (default 10)")
    p.add_argument("--device-repeats", type=int, default=5,
                   help="profiled calls per implementation; the median GPU time is reported (default 5)")


def _copy_flags(p):
    p.add_argument("--copy-bytes", type=int, default=2 << 30, help="bytes of the copy-bandwidth buffer")


def _check_flags(p):
    p.add_argument("--check-max-len", type=int, default=None, help="check: skip cases with a longer cache")
    p.add_argument("--check-max-weight", type=int, default=None,
                   help="check: skip matmul cases whose weight has more elements")
    p.add_argument("--check-per-kernel", type=int, default=None,
                   help="check: only the first N cases of each kernel that the caps above leave (default: all)")


def _decode_flags(p):
    p.add_argument("--batches", type=ints, default=[1, 8, 32])
    p.add_argument("--contexts", type=ints, default=[1024, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--queries", type=ints, default=[1, 5])
    p.add_argument("--block", action="store_true",
                   help="the query rows see one another both ways, as a DFlash block does (default: causally)")
    p.add_argument("--heads", type=lambda s: tuple(ints(s.replace("x", ","))), default=(32, 8, 128),
                   help="'QHEADSxKVHEADSxHEAD_DIM' (default 32x8x128, Llama-3.1-8B; Gemma 4 31B full layers: 32x4x512)")
    p.add_argument("--max-kv-gb", type=float, default=20.0, help="skip sizes whose K+V exceed this (default 20 GB)")
    p.add_argument("--ragged", type=int_tuples, default=[(8, 32768), (32, 8192)],
                   help="ragged batches 'BxMAXLEN;...' (lengths uniform in 1..max)")
    p.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep (block_k, warps, stages, splits)")
    p.add_argument("--sweep-rounds", type=int, default=1, help="interleaved rounds of the sweep (default 1)")
    p.add_argument("--sweep-shapes", type=int_tuples, default=[(1, 1, 131072), (8, 5, 32768), (32, 1, 8192)],
                   help="'BATCHxQUERIESxCONTEXT;...'")
    p.add_argument("--qscan", type=int_tuples,
                   default=[(1, 16, 4096), (1, 64, 4096), (8, 16, 32768), (8, 64, 32768), (1, 512, 4096)],
                   help="'BATCHxQUERIESxCONTEXT;...' for the num_q scan ('' to skip)")


TINY_COPY = dict(copy_bytes=1 << 22)
# One case of each kernel: interpreted on a CPU, a case costs seconds of compiling and running.
TINY_CHECK = dict(check_max_len=600, check_max_weight=1 << 22, check_per_kernel=1)
TINY_TIMING = dict(repeats=2, inner=2, device_repeats=1)
TINY_DECODE = dict(batches=[2], contexts=[64], queries=[1], heads=(4, 2, 32), ragged=[(2, 64)], no_sweep=True,
                   qscan=[(1, 4, 64)], sweep_shapes=[(1, 1, 64)])


def register(subparsers):
    k = subparsers.add_parser("kernels", help="Pallas kernel benchmarks and GPU correctness checks",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = k.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name, help, flags, tiny, out_default=Path("benchmarks")):
        parent = common(out_help=f"output folder (default {out_default})", out_default=out_default, out_type=Path)
        p = subcommand(actions, name, help=help, description=__doc__, run=run, parents=[parent],
                       command=f"kernels {name}", tiny=tiny)
        for add in flags:
            add(p)
        return p

    action("copy-bandwidth", "device copy bandwidth", [_copy_flags], TINY_COPY, out_default=None)
    action("check", "kernels vs references on this device", [_check_flags], TINY_CHECK, out_default=None)
    action("decode-attention", "decode attention benchmark", [_copy_flags, _timing_flags, _decode_flags],
           TINY_COPY | TINY_TIMING | TINY_DECODE)
    action("draft-attention-gemma4", "decode / draft attention at Gemma 4 shapes: kernel vs reference vs cuDNN",
           [_copy_flags, draft_attention.add_flags], TINY_COPY | draft_attention.TINY)
    action("gather-rows", "gather-rows benchmark", [_timing_flags], TINY_TIMING)
    action("all", "copy bandwidth, check, decode-attention (+ sweep), gather-rows; JSON + PNG",
           [_copy_flags, _check_flags, _timing_flags, _decode_flags],
           TINY_COPY | TINY_CHECK | TINY_TIMING | TINY_DECODE)
    p_plot = subcommand(actions, "plot", help="PNG from a decode-attention JSON", description=__doc__, run=run,
                        command="kernels plot")
    p_plot.add_argument("json", type=Path)
    p_plot.add_argument("png", type=Path)
    p_merge = subcommand(actions, "merge", help="merge decode-attention JSONs (later runs win) into one JSON + PNG",
                         description=__doc__, run=run, command="kernels merge")
    p_merge.add_argument("out_json", type=Path)
    p_merge.add_argument("inputs", type=Path, nargs="+")
    p_merge.add_argument("--png", type=Path, default=None)
    return k
