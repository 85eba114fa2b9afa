"""Benchmark the weight-streaming skinny matmul (pallas_kernels.skinny_matmul) on a GPU.

One run does, in order:
  1. torch (in a subprocess, so its CUDA libraries never share a process with XLA):
     device copy bandwidth (``copy_``), and ``F.linear`` (cuBLAS) for every shape and M,
     captured in a CUDA graph so launch overhead is amortised;
  2. GPU correctness of the Pallas kernel against an fp32 ``HIGHEST`` truth (aligned and
     ragged shapes, M in 1..64, bf16 and fp32, several tilings, split-K), and the
     ``impl="auto"`` routing;
  3. a time-boxed tuning sweep over block_n / block_k / split_k / num_warps / num_stages;
  4. the measurement: weight bytes / time for each shape and M, for XLA's dot (the
     reference path), the kernel with the default heuristic and with the best swept config.

Timing: each jitted program multiplies distinct (x_i, w_i) pairs (enough weights to
exceed the L2 cache, and no shared operand that XLA could merge), dispatched many times
back to back; the figure is the median over trials of time / (calls * matmuls). That wall
time includes what each framework pays between kernels (XLA's launches, torch's CUDA-graph
replay), so every row also records the **GPU time** of the kernels themselves, from the
profiler (CUPTI) on both sides (``device_*`` in JAX, ``*_device`` for torch): the quantity
that compares one kernel with another. ``device_kernel`` includes the split-K sum that XLA
runs after the kernel as a separate fusion; ``device_kernel_alone`` is the Pallas kernel only.

Usage (GPU):   PYTHONPATH=. python scripts/bench_matmul.py --out $OUT
Plot only:     python scripts/bench_matmul.py --plot-only benchmarks/skinny_matmul.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    def tqdm(it, **_):
        return it

SHAPES = "4096x4096,4096x14336,14336x4096,4096x128256"
MS = "1,2,4,5,8,16,32,64"


def parse_shapes(s):
    return [tuple(int(v) for v in p.split("x")) for p in s.split(",") if p]


def parse_ints(s):
    return [int(v) for v in s.split(",") if v]


def n_weights(k, n, target_bytes):
    return max(2, math.ceil(target_bytes / (k * n * 2)))


# --------------------------------------------------------------------------- torch
def run_torch(args):
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    res = {"torch_version": torch.__version__, "device": torch.cuda.get_device_name(0),
           "linear": {}, "matmul_kn": {}}
    # copy bandwidth: bytes read + written / time
    nbytes = 1 << 30
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    a.fill_(1)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    res["copy_bw_TBs"] = 2 * nbytes / statistics.median(ts) / 1e12
    res["copy_bw_max_TBs"] = 2 * nbytes / min(ts) / 1e12
    del a, b
    torch.cuda.empty_cache()

    def time_graph(fn_list, calls):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                for f in fn_list:
                    f()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = [f() for f in fn_list]
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        trials = []
        for _ in range(args.trials):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(calls):
                g.replay()
            e.record()
            e.synchronize()
            trials.append(s.elapsed_time(e) / 1e3 / (calls * len(fn_list)))
        del outs, g
        return statistics.median(trials)

    def device_time(fn_list):
        """GPU seconds per call of the kernels one pass of fn_list runs (profiler, as in JAX)."""
        from torch.profiler import ProfilerActivity, profile

        for f in fn_list:
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for f in fn_list:
                f()
            torch.cuda.synchronize()
        return sum(e.self_device_time_total for e in prof.key_averages()) * 1e-6 / len(fn_list)

    plan = [(k, n, parse_ints(args.ms)) for k, n in parse_shapes(args.shapes)]
    plan += [(k, n, parse_ints(args.extra_ms)) for k, n in parse_shapes(args.extra_shapes)]
    res["linear_device"], res["matmul_kn_device"] = {}, {}
    for k, n, mlist in plan:
        nw = n_weights(k, n, args.target_bytes)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(nw)]
        wkn = [torch.randn(k, n, dtype=torch.bfloat16, device=dev) for _ in range(nw)]
        for m in mlist:
            xs = [torch.randn(m, k, dtype=torch.bfloat16, device=dev) for _ in range(nw)]
            for name, fns in (("linear", [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)]),
                              ("matmul_kn", [lambda x=x, w=w: torch.matmul(x, w) for x, w in zip(xs, wkn)])):
                res[name][f"{k}x{n}/{m}"] = k * n * 2 / time_graph(fns, args.calls) / 1e12
                res[f"{name}_device"][f"{k}x{n}/{m}"] = k * n * 2 / device_time(fns) / 1e12
        del ws, wkn
        torch.cuda.empty_cache()
    with open(args.torch_json, "w") as f:
        json.dump(res, f)


# --------------------------------------------------------------------------- jax
def jax_main(args):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import jax
    import jax.numpy as jnp

    import importlib

    from jspec.benchmarking import gpu_kernel_times

    sm = importlib.import_module("pallas_kernels.skinny_matmul")  # the module, not the fn

    def parse_cfg(text):  # our own repr(SkinnyConfig(...))
        return eval(text, {"SkinnyConfig": sm.SkinnyConfig})  # noqa: S307

    t_start = time.time()
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    result = {
        "what": "weight bytes / time (TB/s) for x[M,K] @ w[K,N], bf16, fp32 accumulation",
        "device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
        "shapes": args.shapes, "ms": args.ms, "target_bytes": args.target_bytes,
        "calls_per_trial": args.calls, "trials": args.trials,
    }

    def save():
        with open(os.path.join(out_dir, "skinny_matmul.json"), "w") as f:
            json.dump(result, f, indent=1)

    # ---- 1. torch in a subprocess
    if not args.skip_torch:
        tj = os.path.join(tempfile.mkdtemp(), "torch.json")
        cmd = [sys.executable, __file__, "--torch-only", "--torch-json", tj,
               "--shapes", args.shapes, "--ms", args.ms, "--extra-shapes",
               args.extra_shapes, "--extra-ms", args.extra_ms, "--target-bytes",
               str(args.target_bytes), "--calls", str(args.calls), "--trials",
               str(args.trials)]
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode == 0:
            with open(tj) as f:
                result["torch"] = json.load(f)
        else:
            result["torch_error"] = p.stderr[-3000:]
        print(f"torch done in {time.time() - t0:.1f}s", flush=True)
        save()

    key = jax.random.key(0)

    # ---- 2. correctness
    def truth(x, w):
        return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)

    cases = []
    for m in (1, 2, 3, 5, 8, 16, 17, 32, 64):
        cases.append((m, 4096, 4096, "bfloat16", None))
    for m in (1, 5, 17, 64):
        cases.append((m, 1000, 777, "bfloat16", None))
        cases.append((m, 1000, 777, "float32", None))
        cases.append((m, 4096, 14336, "bfloat16", None))
        cases.append((m, 4100, 4104, "bfloat16", sm.SkinnyConfig(64, 256, 4, 4, 4)))
        cases.append((m, 2048, 300, "float32", sm.SkinnyConfig(32, 128, 3, 8, 3)))
        cases.append((m, 14336, 4096, "bfloat16", sm.SkinnyConfig(128, 128, 8, 8, 3)))
    if args.correctness == "quick":
        cases = [c for c in cases if c[0] in (1, 5, 64) and c[4] is not None][:8] + [
            (3, 4096, 4096, "bfloat16", None), (17, 2048, 300, "float32", None)]
    if args.correctness == "none":
        cases = []
    if args.smoke:
        cases = [(1, 300, 200, "bfloat16", None), (17, 1000, 77, "float32",
                                                      sm.SkinnyConfig(32, 128, 3, 8, 3))]
    corr = []
    for m, k, n, dt, cfg in tqdm(cases, desc="correctness", mininterval=5):
        key, k1, k2 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (m, k), dt)
        w = jax.random.normal(k2, (k, n), dt) / math.sqrt(k)
        rec = {"m": m, "k": k, "n": n, "dtype": dt, "config": str(cfg)}
        try:
            o = sm.skinny_matmul_pallas(x, w, config=cfg)
            r = sm.skinny_matmul_reference(x, w)
            t = truth(x, w)
            scale = float(jnp.max(jnp.abs(t))) + 1e-30
            rec["kernel_err"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - t))) / scale
            rec["xla_err"] = float(jnp.max(jnp.abs(r.astype(jnp.float32) - t))) / scale
            rec["finite"] = bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
            tol = 1e-2 if dt == "bfloat16" else 1e-5
            rec["ok"] = rec["finite"] and rec["kernel_err"] <= max(tol, 2 * rec["xla_err"])
        except Exception as e:  # noqa: BLE001
            rec["ok"] = False
            rec["error"] = repr(e)[:500]
        corr.append(rec)
    # auto routing: small M -> kernel on GPU, large M -> reference; both correct
    auto = {}
    ak = 256 if args.smoke else 4096
    for m in (4, 256):
        x = jax.random.normal(key, (m, ak), jnp.bfloat16)
        w = jax.random.normal(key, (ak, ak), jnp.bfloat16) / 64
        txt = jax.jit(sm.skinny_matmul).lower(x, w).as_text()
        o = sm.skinny_matmul(x, w)
        err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - truth(x, w))))
        auto[str(m)] = {"uses_kernel": "triton" in txt, "max_abs_err": err}
    result["correctness"] = corr
    result["auto_routing"] = auto
    n_ok = sum(r["ok"] for r in corr)
    print(f"correctness: {n_ok}/{len(corr)} ok; auto {auto}", flush=True)
    for r in corr:
        if not r["ok"]:
            print("FAIL", r, flush=True)
    save()

    # ---- timing helpers
    def make_inputs(k, n, m, nw, seed):
        ks = jax.random.split(jax.random.key(seed), 2 * nw)
        ws = [jax.random.normal(ks[i], (k, n), jnp.bfloat16) for i in range(nw)]
        xs = [jax.random.normal(ks[nw + i], (m, k), jnp.bfloat16) for i in range(nw)]
        jax.block_until_ready((ws, xs))
        return xs, ws

    programs = {}

    def program(fn):
        """One jitted program per matmul function, shared by the wall and the GPU timing."""
        if fn not in programs:
            programs[fn] = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
        return programs[fn]

    def time_fn(fn, xs, ws, calls=None):
        calls = calls or args.calls
        f = program(fn)
        jax.block_until_ready(f(xs, ws))
        jax.block_until_ready(f(xs, ws))
        trials = []
        for _ in range(args.trials):
            t0 = time.perf_counter()
            for _ in range(calls):
                o = f(xs, ws)
            jax.block_until_ready(o)
            trials.append((time.perf_counter() - t0) / (calls * len(ws)))
        return statistics.median(trials)

    def bw(k, n, t):
        return k * n * 2 / t / 1e12

    def device_bw(fn, xs, ws):
        """Weight TB/s from the GPU time of all the kernels of one matmul (profiler), and from the
        Pallas kernel's own time alone (without the split-K sum that XLA runs after it)."""
        kernels = gpu_kernel_times(functools.partial(program(fn), xs, ws))
        if not kernels:
            return None, None
        k, n = ws[0].shape
        total = sum(t for _, t in kernels) / len(ws)
        own = sum(t for name, t in kernels if "skinny_matmul" in name) / len(ws)
        return bw(k, n, total), (bw(k, n, own) if own else None)

    def kernel_fn(cfg):
        return lambda x, w: sm.skinny_matmul_pallas(x, w, config=cfg)

    # ---- 3. sweep (time-boxed)
    shapes = parse_shapes(args.shapes)
    sweep_shapes = parse_shapes(args.sweep_shapes or args.shapes)
    sweep = {}
    best = {}
    xla_sweep = {}
    sweep_ms = parse_ints(args.sweep_ms)
    deadline = time.time() + args.sweep_budget

    def stage_a(m, k, n):
        """~15 tilings per shape (run 1 on H100 pruned the rest): the square 128x128 tile,
        split-1 narrow tiles (4 and 6 stages), wide-N tiles, a 2-CTA/SM tile; split-K chosen
        for >= 2 waves of programs."""
        def split_for(bn, bk):
            tiles, sk = math.ceil(n / bn), 1
            while tiles * sk < 2 * 132 and math.ceil(k / (2 * sk)) >= 4 * bk:
                sk *= 2
            return sk

        fam = [sm.default_config(m, k, n)]
        for bn, bk, nwp, st, how in (
                (128, 128, 4, 4, "s"), (128, 128, 4, 4, "s/2"), (32, 128, 4, 4, "1"),
                (64, 256, 4, 4, "1"), (256, 64, 4, 4, "s"), (512, 32, 4, 4, "s"),
                (128, 64, 4, 6, "s"), (64, 128, 4, 4, "s"), (32, 128, 4, 4, "s"),
                # no split, 6 stages: the winners of the H100 GPU-time sweeps
                (32, 128, 4, 6, "1"), (64, 128, 4, 6, "1"), (128, 64, 4, 6, "1")):
            sk = {"1": 1, "s": split_for(bn, bk), "s/2": max(1, split_for(bn, bk) // 2)}[how]
            if bn <= n and bk <= k:
                fam.append(sm.SkinnyConfig(bn, bk, sk, nwp, st))
        return list(dict.fromkeys(fam))

    if args.sweep_budget > 0:
        for phase in ("a", "b") if args.sweep_phase_b else ("a",):
            for m in sweep_ms:
                for k, n in sweep_shapes:
                    if time.time() > deadline:
                        break
                    sk_key = f"{k}x{n}/{m}"
                    recs = sweep.setdefault(sk_key, {})
                    if phase == "a":
                        cands = [sm.default_config(m, k, n)] + stage_a(m, k, n)
                    else:
                        top = sorted(recs, key=lambda c: -recs[c])[:2]
                        cands = []
                        for c in top[:1]:
                            c = parse_cfg(c)
                            for nwp, st in ((4, 3), (4, 6), (8, 4), (8, 6), (2, 4)):
                                cands.append(sm.SkinnyConfig(c.block_n, c.block_k,
                                                             c.split_k, nwp, st))
                    nw = n_weights(k, n, args.sweep_bytes)
                    programs.clear()
                    xs, ws = make_inputs(k, n, m, nw, 1)
                    if phase == "a" and args.sweep_xla:
                        xla_sweep[sk_key] = bw(k, n, time_fn(sm.skinny_matmul_reference,
                                                             xs, ws, calls=args.sweep_calls))
                    for cfg in tqdm(cands, desc=f"sweep {phase} {sk_key}", mininterval=10):
                        if repr(cfg) in recs or time.time() > deadline:
                            continue
                        try:
                            # The kernels' GPU time where the profiler has it (steady to ~2%);
                            # the wall time otherwise (+-10% run to run on a shared GPU).
                            score = device_bw(kernel_fn(cfg), xs, ws)[0] if args.device_time else None
                            recs[repr(cfg)] = score or bw(k, n, time_fn(kernel_fn(cfg), xs, ws,
                                                                        calls=args.sweep_calls))
                        except Exception as e:  # noqa: BLE001
                            recs[repr(cfg)] = -1.0
                            print("config failed", cfg, repr(e)[:200], flush=True)
                    del xs, ws
                    if recs:
                        b = max(recs, key=lambda c: recs[c])
                        best[sk_key] = b
                        print(f"best {sk_key}: {b} {recs[b]:.3f} TB/s "
                              f"(default {recs.get(repr(sm.default_config(m, k, n)), -1):.3f}"
                              f", xla {xla_sweep.get(sk_key, -1):.3f})", flush=True)
        result["sweep"] = sweep
        result["sweep_best"] = best
        result["sweep_xla"] = xla_sweep
        save()

    def tuned_config(m, k, n):
        cands = [mm for mm in sweep_ms if f"{k}x{n}/{mm}" in best]
        if not cands:
            return None
        mm = min(cands, key=lambda v: (abs(math.log2(v) - math.log2(m)), v))
        return parse_cfg(best[f"{k}x{n}/{mm}"])

    # ---- 4. measurement
    meas = {}
    plan = [(k, n, parse_ints(args.ms)) for k, n in shapes]
    plan += [(k, n, parse_ints(args.extra_ms)) for k, n in parse_shapes(args.extra_shapes)]
    for k, n, mlist in ([] if args.skip_measure else plan):
        nw = n_weights(k, n, args.target_bytes)
        for m in tqdm(mlist, desc=f"measure {k}x{n}", mininterval=10):
            if time.time() > t_start + args.deadline:
                print("deadline reached, measurement cut short", flush=True)
                break
            programs.clear()  # new shapes: drop the compiled programs of the last ones
            xs, ws = make_inputs(k, n, m, nw, 2)
            rec = {"n_weights": nw}
            rec["xla"] = bw(k, n, time_fn(sm.skinny_matmul_reference, xs, ws))
            cfg = sm.default_config(m, k, n)
            kernel = kernel_fn(cfg)
            rec["kernel_default"] = bw(k, n, time_fn(kernel, xs, ws))
            rec["default_config"] = repr(cfg)
            if args.device_time:
                rec["device_xla"], _ = device_bw(sm.skinny_matmul_reference, xs, ws)
                rec["device_kernel"], rec["device_kernel_alone"] = device_bw(kernel, xs, ws)
            tc = tuned_config(m, k, n)
            if tc is not None and tc != cfg:
                rec["kernel_tuned"] = bw(k, n, time_fn(kernel_fn(tc), xs, ws))
                rec["tuned_config"] = repr(tc)
            rec["auto_uses_kernel"] = bool(sm._auto_uses_pallas(m, k, n, jnp.bfloat16,
                                                                jnp.bfloat16))
            meas[f"{k}x{n}/{m}"] = rec
            del xs, ws
            print(f"{k}x{n} M={m}: " + ", ".join(
                f"{a}={b:.3f}" for a, b in rec.items() if isinstance(b, float)), flush=True)
        result["measure"] = meas
        save()
    result["wall_s"] = time.time() - t_start
    save()
    if "measure" not in result:  # --skip-measure: nothing to draw
        return
    try:
        plot(os.path.join(out_dir, "skinny_matmul.json"))
    except Exception as e:  # noqa: BLE001
        print("plot failed (run --plot-only locally):", repr(e)[:200])


# --------------------------------------------------------------------------- plot
def plot(json_path, png_path=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        res = json.load(f)
    meas = res["measure"]
    shapes = parse_shapes(res["shapes"])
    ms = parse_ints(res["ms"])
    torch_res = res.get("torch", {})
    copy_bw = torch_res.get("copy_bw_TBs")
    has_device = any("device_kernel" in rec for rec in meas.values())
    rows = 2 if has_device else 1
    fig, axes = plt.subplots(rows, len(shapes), figsize=(4.2 * len(shapes), 3.8 * rows),
                             sharey=True, squeeze=False)
    for col, (k, n) in enumerate(shapes):
        def series(name, src=None):
            src = meas if src is None else src
            return [(src.get(f"{k}x{n}/{m}") or {}).get(name) if src is meas
                    else src.get(f"{k}x{n}/{m}") for m in ms]

        lines = [("kernel (default_config at run time)", series("kernel_default"), "o-"),
                 ("XLA dot", series("xla"), "s--")]
        if any("kernel_tuned" in (meas.get(f"{k}x{n}/{m}") or {}) for m in ms):
            tuned = [(meas.get(f"{k}x{n}/{m}") or {}).get("kernel_tuned",
                                                         (meas.get(f"{k}x{n}/{m}") or {}).get("kernel_default"))
                     for m in ms]
            lines.append(("kernel (best swept)", tuned, "^:"))
        if torch_res:
            lines.append(("torch F.linear (CUDA graph)", series(None, torch_res["linear"]), "d-."))
        _draw(axes[0][col], lines, ms, copy_bw, f"K={k}, N={n}: wall time")
        if has_device:
            lines = [("kernel + split-K sum", series("device_kernel"), "o-"),
                     ("kernel alone", series("device_kernel_alone"), "o:"),
                     ("XLA dot", series("device_xla"), "s--")]
            if "linear_device" in torch_res:
                lines += [("torch F.linear [N,K]", series(None, torch_res["linear_device"]), "d-."),
                          ("torch matmul [K,N]", series(None, torch_res["matmul_kn_device"]), "v-.")]
            _draw(axes[1][col], lines, ms, copy_bw, f"K={k}, N={n}: GPU time of the kernels")
    for row in axes:
        row[0].set_ylabel("weight TB/s")
        row[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"skinny matmul, bf16, {res['device']}, jax {res['jax_version']}")
    fig.tight_layout()
    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png_path, dpi=110)
    print("wrote", png_path)


def _draw(ax, lines, ms, copy_bw, title):
    for label, ys, style in lines:
        pts = [(m, y) for m, y in zip(ms, ys) if y]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    if copy_bw:
        ax.axhline(copy_bw, color="k", lw=0.8, label=f"copy_ {copy_bw:.2f}")
        ax.axhline(0.85 * copy_bw, color="gray", lw=0.8, ls=":", label="85% copy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels([str(m) for m in ms])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("M (rows)")
    ax.grid(alpha=0.3)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks"),
                    help="output folder for skinny_matmul.json/png")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of KxN")
    ap.add_argument("--ms", default=MS, help="comma list of M")
    ap.add_argument("--sweep-ms", default="1,8,32", help="M values tuned by the sweep")
    ap.add_argument("--sweep-shapes", default=None, help="KxN list for the sweep (default: --shapes)")
    ap.add_argument("--sweep-budget", type=float, default=150.0,
                    help="seconds for the tuning sweep (0 = skip)")
    ap.add_argument("--sweep-phase-b", action="store_true",
                    help="also vary num_warps/num_stages around the best tiling")
    ap.add_argument("--sweep-xla", action="store_true", help="time XLA in the sweep too")
    ap.add_argument("--sweep-calls", type=int, default=10, help="calls per trial in the sweep")
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--sweep-bytes", type=float, default=512e6,
                    help="weight bytes per timed program in the sweep")
    ap.add_argument("--target-bytes", type=float, default=512e6,
                    help="weight bytes per timed program in the measurement")
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per trial")
    ap.add_argument("--trials", type=int, default=5, help="trials (median reported)")
    ap.add_argument("--extra-shapes", default="", help="more KxN, measured at --extra-ms")
    ap.add_argument("--extra-ms", default="1,5,16")
    ap.add_argument("--correctness", choices=("full", "quick", "none"), default="full")
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds after start when the measurement stops (partial JSON)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--no-device-time", dest="device_time", action="store_false",
                    help="skip the profiler's per-kernel GPU times (JAX and torch)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke test of this script (interpret mode; use tiny --shapes)")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-json", help=argparse.SUPPRESS)
    ap.add_argument("--plot-only", metavar="JSON", help="only draw the PNG from a JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(args.plot_only)
    elif args.torch_only:
        run_torch(args)
    else:
        jax_main(args)


if __name__ == "__main__":
    main()
