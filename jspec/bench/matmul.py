"""matmul: the weight-streaming skinny matmul (pallas_kernels.matmul.skinny_matmul) on a GPU.

One run does, in order:
  1. torch, in a subprocess (``matmul --torch-only``, see ``matmul_torch``): device copy
     bandwidth and cuBLAS (``F.linear``, ``torch.matmul``) for every shape and M;
  2. GPU correctness of the Pallas kernel against an fp32 ``HIGHEST`` truth (aligned and
     ragged shapes, M in 1..64, bf16 and fp32, several tilings, split-K), and the
     ``impl="auto"`` routing;
  3. a time-boxed tuning sweep over block_n / block_k / split_k / num_warps / num_stages;
  4. the measurement: weight bytes / time for each shape and M, for XLA's dot (the
     reference path), the kernel with the default heuristic and with the best swept config,
     and where tokamax is installed its grouped matmul with one group (``jspec.bench.peers``).

Timing: each jitted program multiplies distinct (x_i, w_i) pairs (enough weights to exceed the
L2 cache, and no shared operand that XLA could merge), dispatched ``--calls`` times back to
back; the figure is the median over ``--repeats`` samples of time / (calls * matmuls). That wall
time includes what each framework pays between kernels (XLA's launches, torch's CUDA-graph
replay), so every row also has the **GPU time** of the kernels themselves, from the profiler
on both sides (``device_*``): the quantity that compares one kernel with another.
``device_kernel`` includes the split-K sum that XLA runs after the kernel as a separate fusion;
``device_kernel_alone`` is the Pallas kernel only. ``--out`` is a folder: skinny_matmul.json/png.

  python -m jspec.bench matmul --out benchmarks --sweep-budget 0 --correctness quick
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from tqdm.auto import tqdm

from jspec.bench import matmul_sweep, peers, plots, report
from jspec.bench.flags import common, subcommand
from jspec.bench.matmul_torch import n_weights, plan, run_torch

SHAPES = "4096x4096,4096x14336,14336x4096,4096x128256"
MS = "1,2,4,5,8,16,32,64"


def torch_rows(args, env):
    """Run the torch side in a subprocess: ``(rows, copy bandwidth)``, or an error row."""
    path = os.path.join(tempfile.mkdtemp(), "torch.json")
    cmd = [sys.executable, "-m", "jspec.bench", "matmul", "--torch-only", "--torch-json", path,
           "--shapes", args.shapes, "--ms", args.ms, "--extra-shapes", args.extra_shapes, "--extra-ms", args.extra_ms,
           "--target-bytes", str(args.target_bytes), "--calls", str(args.calls), "--repeats", str(args.repeats)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(f"torch done in {time.time() - t0:.1f}s", flush=True)
    if proc.returncode != 0:
        return [dict(measure="torch_error", stderr=proc.stderr[-3000:])], None
    res = report.read(path)
    env.update(torch_version=res["torch_version"], torch_device=res["device"])
    return res["rows"], res["copy"]


def correctness_cases(sm, args):
    if args.tiny:
        return [(1, 300, 200, "bfloat16", None), (17, 1000, 77, "float32", sm.SkinnyConfig(32, 128, 3, 8, 3))]
    cases = [(m, 4096, 4096, "bfloat16", None) for m in (1, 2, 3, 5, 8, 16, 17, 32, 64)]
    for m in (1, 5, 17, 64):
        cases += [(m, 1000, 777, "bfloat16", None), (m, 1000, 777, "float32", None), (m, 4096, 14336, "bfloat16", None),
                  (m, 4100, 4104, "bfloat16", sm.SkinnyConfig(64, 256, 4, 4, 4)),
                  (m, 2048, 300, "float32", sm.SkinnyConfig(32, 128, 3, 8, 3)),
                  (m, 14336, 4096, "bfloat16", sm.SkinnyConfig(128, 128, 8, 8, 3))]
    if args.correctness == "quick":
        cases = [c for c in cases if c[0] in (1, 5, 64) and c[4] is not None][:8] + [
            (3, 4096, 4096, "bfloat16", None), (17, 2048, 300, "float32", None)]
    return [] if args.correctness == "none" else cases


def correctness(sm, args, key):
    """``correctness`` rows (kernel vs an fp32 HIGHEST truth, XLA's error as the yardstick) and
    ``auto_routing`` rows (small M -> kernel on a GPU, large M -> reference; both correct)."""
    import jax
    import jax.numpy as jnp

    def truth(x, w):
        return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)

    rows = []
    for m, k, n, dt, cfg in tqdm(correctness_cases(sm, args), desc="correctness", mininterval=5):
        key, k1, k2 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (m, k), dt)
        w = jax.random.normal(k2, (k, n), dt) / k**0.5
        rec = dict(measure="correctness", m=m, k=k, n=n, dtype=dt, config=str(cfg))
        try:
            t = truth(x, w)
            scale = float(jnp.max(jnp.abs(t))) + 1e-30
            out = sm.skinny_matmul_pallas(x, w, config=cfg).astype(jnp.float32)
            rec["kernel_err"] = float(jnp.max(jnp.abs(out - t))) / scale
            rec["xla_err"] = float(jnp.max(jnp.abs(sm.skinny_matmul_reference(x, w).astype(jnp.float32) - t))) / scale
            rec["finite"] = bool(jnp.all(jnp.isfinite(out)))
            tol = 1e-2 if dt == "bfloat16" else 1e-5
            rec["ok"] = rec["finite"] and rec["kernel_err"] <= max(tol, 2 * rec["xla_err"])
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=repr(e)[:500])
        rows.append(rec)
    size = 256 if args.tiny else 4096
    for m in (4, 256):
        x = jax.random.normal(key, (m, size), jnp.bfloat16)
        w = jax.random.normal(key, (size, size), jnp.bfloat16) / 64
        text = jax.jit(sm.skinny_matmul).lower(x, w).as_text()
        err = float(jnp.max(jnp.abs(sm.skinny_matmul(x, w).astype(jnp.float32) - truth(x, w))))
        rows.append(dict(measure="auto_routing", m=m, k=size, n=size, uses_kernel="triton" in text, max_abs_err=err))
    return rows


def measure(sm, args, bench, best, deadline):
    """``matmul`` rows: weight TB/s of XLA's dot and of the kernel (default and best swept tiling)."""
    import jax.numpy as jnp

    rows = []
    for k, n, mlist, extra in [] if args.skip_measure else plan(args):
        nw = n_weights(k, n, args.target_bytes)
        for m in tqdm(mlist, desc=f"measure {k}x{n}", mininterval=10):
            if time.time() > deadline:
                print("deadline reached, measurement cut short", flush=True)
                return rows
            bench.programs.clear()  # new shapes: drop the compiled programs of the last ones
            xs, ws = bench.inputs(k, n, m, nw, 2)
            cfg = sm.default_config(m, k, n)
            row = dict(measure="matmul", shape=f"{k}x{n}", k=k, n=n, m=m, extra=extra, n_weights=nw,
                       default_config=repr(cfg), tb_s={}, timings={})
            fns = {"xla": sm.skinny_matmul_reference, "kernel_default": bench.kernel(cfg),
                   **{name: peers.matmul(name) for name in peers.available(peers.MATMUL)}}
            tuned = best.tuned_config(m, k, n)
            if tuned is not None and tuned != cfg:
                fns["kernel_tuned"] = bench.kernel(tuned)
                row["tuned_config"] = repr(tuned)
            for name, fn in fns.items():
                timing = bench.wall(fn, xs, ws)
                row["tb_s"][name] = bench.tb_s(k, n, timing.median_s)
                row["timings"][name] = timing.as_dict("us")
            if args.device_time:
                row["tb_s"]["device_xla"], _ = bench.device_tb_s(sm.skinny_matmul_reference, xs, ws)
                kernel = bench.device_tb_s(fns["kernel_default"], xs, ws)
                row["tb_s"]["device_kernel"], row["tb_s"]["device_kernel_alone"] = kernel
                for name in peers.available(peers.MATMUL):
                    row["tb_s"][f"device_{name}"], _ = bench.device_tb_s(fns[name], xs, ws)
            row["auto_uses_kernel"] = bool(sm._auto_uses_pallas(m, k, n, jnp.bfloat16, jnp.bfloat16))
            rows.append(row)
            del xs, ws
            print(f"{k}x{n} M={m}: " + ", ".join(f"{a}={b:.3f}" for a, b in row["tb_s"].items() if b), flush=True)
    return rows


def run(args):
    if args.plot_only:
        plots.matmul(report.read(args.plot_only), os.path.splitext(args.plot_only)[0] + ".png")
        return 0
    if args.torch_only:
        return run_torch(args)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import importlib

    import jax

    sm = importlib.import_module("pallas_kernels.matmul.skinny_matmul")  # the module, not the function it exports

    t_start = time.time()
    path = os.path.join(args.out, "skinny_matmul.json")
    env = report.environment(args.dtype, args.seed, weights="random inputs")
    rows, copy = [], None

    def save():
        report.write(path, report.result("matmul", args.argv, env, rows, copy_bandwidth=copy))

    if not args.skip_torch:
        torch, copy = torch_rows(args, env)
        rows += torch
        save()
    rows += correctness(sm, args, jax.random.key(args.seed))
    failed = [r for r in rows if r["measure"] == "correctness" and not r["ok"]]
    print(f"correctness: {sum(r['measure'] == 'correctness' for r in rows) - len(failed)} ok, {len(failed)} failed; "
          f"auto {[r for r in rows if r['measure'] == 'auto_routing']}", flush=True)
    for r in failed:
        print("FAIL", r, flush=True)
    save()
    bench = matmul_sweep.Bench(sm, args)
    best = matmul_sweep.sweep(sm, args, bench)
    rows += best.rows
    save()
    rows += measure(sm, args, bench, best, t_start + args.deadline)
    save()
    if any(r["measure"] == "matmul" for r in rows):
        try:
            plots.matmul(report.read(path), os.path.join(args.out, "skinny_matmul.png"))
        except Exception as e:  # noqa: BLE001
            print("plot failed (run --plot-only locally):", repr(e)[:200])
    return 0


TINY = dict(shapes="256x128", ms="1,3", extra_shapes="", sweep_budget=0.0, skip_torch=True, target_bytes=1.0, calls=1,
            sweep_bytes=1.0, sweep_calls=1,
            repeats=2)


def register(subparsers):
    parent = common(out_help="output folder for skinny_matmul.json/png (default $OUT or benchmarks)",
                    out_default=os.environ.get("OUT", "benchmarks"), repeats=5, repeats_aliases=("--trials",),
                    repeats_help="timed samples (--trials); the median is reported (default 5)")
    ap = subcommand(subparsers, "matmul",
                    help="skinny matmul: correctness, tuning sweep, weight TB/s vs XLA and cuBLAS",
                    description=__doc__, run=run, parents=[parent], tiny=TINY)
    ap.add_argument("--shapes", default=SHAPES, help="comma list of KxN")
    ap.add_argument("--ms", default=MS, help="comma list of M")
    ap.add_argument("--sweep-ms", default="1,8,32", help="M values tuned by the sweep")
    ap.add_argument("--sweep-shapes", default=None, help="KxN list for the sweep (default: --shapes)")
    ap.add_argument("--sweep-budget", type=float, default=150.0, help="seconds for the tuning sweep (0 = skip)")
    ap.add_argument("--sweep-phase-b", action="store_true",
                    help="also vary num_warps/num_stages around the best tiling")
    ap.add_argument("--sweep-xla", action="store_true", help="time XLA in the sweep too")
    ap.add_argument("--sweep-calls", type=int, default=10, help="calls per trial in the sweep")
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--sweep-bytes", type=float, default=512e6, help="weight bytes per timed program in the sweep")
    ap.add_argument("--target-bytes", type=float, default=512e6,
                    help="weight bytes per timed program in the measurement")
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per trial")
    ap.add_argument("--extra-shapes", default="", help="more KxN, measured at --extra-ms")
    ap.add_argument("--extra-ms", default="1,5,16")
    ap.add_argument("--correctness", choices=("full", "quick", "none"), default="full")
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds after start when the measurement stops (partial JSON)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--no-device-time", dest="device_time", action="store_false",
                    help="skip the profiler's per-kernel GPU times (JAX and torch)")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-json", help=argparse.SUPPRESS)
    ap.add_argument("--plot-only", metavar="JSON", help="only draw the PNG from a JSON")
    return ap

