"""quant-matmul: the quantized skinny matmul (pallas_kernels.matmul.quantized_kernel) on a GPU, against
XLA's dequantize-then-dot (the reference path) and torch's small-M quantized kernels.

One run does, in order:
  1. torch, in a subprocess (``quant-matmul --torch-only``, see ``quant_matmul_torch``): device copy
     bandwidth, ``F.linear`` (bf16), ``_weight_int8pack_mm``, ``_weight_int4pack_mm`` (g128) and
     ``_scaled_mm`` (fp8) at every shape and row count;
  2. correctness on the device: the kernel against the reference at ragged shapes, every format,
     1..80 rows, a table read [N, K] and a fused gate, and the weight read back through one-hot rows;
  3. the measurement: for every shape, format and row count, the GPU time of one call (the
     profiler's kernel times, each call right after an L2 flush, interleaved, median of
     ``--repeats``) of XLA (``xla``) and of the kernel (``kernel``: the default tiling; with
     ``--sweep``, ``kernel_best`` and its tiling from a time-boxed sweep at the ``--sweep-ms`` rows,
     every tiling's time in ``sweep_us``, the tilings compiled in ``--compile-threads`` threads);
     the bytes streamed (values + scales + mins, or the bf16 weight) per second and as a fraction
     of the copy bandwidth.

Formats are ``bf16`` (the skinny matmul's own kernel) or quantization schemes (``jspec.quant.Scheme``
names: ``int8``, ``fp8``, ``int4-g128``, ``int4-g32-sym``, ...). A shape ``KxN`` with a trailing
``t`` stores the weight ``[N, K]`` (a tied LM head); quantized weights are stored ``[N, K]`` (K last,
as ``jspec`` stores them) at every shape unless ``--k-first``. ``--out`` is a folder: quant_matmul.json/png.

  python -m jspec.bench quant-matmul --out benchmarks --sweep
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from jspec.bench import report
from jspec.bench.flags import common, ints, subcommand
from jspec.bench.quant_matmul_sweep import candidates, refined, tiling

SHAPES = "4096x6144,4096x4096,4096x28672,14336x4096,4096x128256"  # Llama-3.1-8B: qkv, o, gate|up, down, LM head
MS = "1,4,5,16"
FORMATS = "bf16,int8,fp8,int4-g128"


def parse_shapes(text: str) -> list[tuple[int, int, bool]]:
    """'4096x6144,4096x128256t' -> [(4096, 6144, False), (4096, 128256, True)]."""
    out = []
    for item in (t for t in text.split(",") if t):
        transposed = item.endswith("t")
        k, n = (int(v) for v in item.rstrip("t").split("x"))
        out.append((k, n, transposed))
    return out


def torch_rows(args):
    """The torch side in a subprocess: ``(rows, copy bandwidth)``, or an error row."""
    path = os.path.join(tempfile.mkdtemp(), "torch.json")
    cmd = [sys.executable, "-m", "jspec.bench", "quant-matmul", "--torch-only", "--torch-json", path,
           "--shapes", args.shapes, "--ms", args.ms, "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return [dict(measure="torch_error", stderr=proc.stderr[-3000:])], None
    res = report.read(path)
    return res["rows"], res["copy"]


class Weights:
    """One random weight of a shape, as bf16 and quantized by each scheme, and the matmuls on it."""

    def __init__(self, k, n, transposed, seed, k_first=False):
        import jax
        import jax.numpy as jnp

        self.k, self.n, self.transposed = k, n, transposed
        # Quantized: stored K last as jspec stores every quantized weight, or as the shape says (k_first).
        self.quantized_transposed = transposed or not k_first
        shape = (n, k) if transposed else (k, n)
        self.w = (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * k**-0.5).astype(jnp.bfloat16)

    def parts(self, fmt):
        """The weight's arrays in ``fmt`` (``(w,)`` for bf16, else values, scales[, mins])."""
        from jspec.quant import Scheme, quantize_matrix

        if fmt == "bf16":
            return (self.w,)
        w = self.w.T if self.quantized_transposed != self.transposed else self.w
        q = quantize_matrix(w, Scheme.parse(fmt), transposed=self.quantized_transposed)
        return (q.values, q.scales) + (() if q.mins is None else (q.mins,))

    def functions(self, fmt, configs=()):
        """``{name: jitted fn(x, *parts)}``: ``xla`` and ``kernel`` (and ``kernel <tiling>`` for each of
        ``configs``)."""
        import jax

        from pallas_kernels.matmul import quantized_kernel as qk
        from pallas_kernels.matmul.quantized_matmul import quantized_matmul_reference
        from pallas_kernels.matmul.skinny_matmul import skinny_matmul_pallas, skinny_matmul_reference

        t = self.transposed if fmt == "bf16" else self.quantized_transposed
        if fmt == "bf16":
            xla = lambda x, w: skinny_matmul_reference(x, w, w_transposed=t)  # noqa: E731
            kernel = lambda cfg: lambda x, w: skinny_matmul_pallas(x, w, config=cfg, w_transposed=t)  # noqa: E731
        else:
            xla = lambda x, *p: quantized_matmul_reference(x, *p, w_transposed=t)  # noqa: E731
            kernel = lambda cfg: lambda x, *p: qk.quantized_matmul_pallas(x, *p, config=cfg, w_transposed=t)  # noqa: E731
        fns = {"xla": xla, "kernel": kernel(None)}
        fns.update({f"kernel {cfg}": kernel(cfg) for cfg in configs})
        return {name: jax.jit(fn) for name, fn in fns.items()}


def compiled(fns, x, parts, threads):
    """``fns`` compiled for ``(x, *parts)`` (in ``threads`` parallel threads: a sweep's Triton compiles
    took most of its time one after another) and run once: ``({name: compiled fn}, {name: exception})``,
    the second for those that fail to lower, compile or run."""
    import jax

    from jspec.bench.timing import compile_all

    lowered, failed = {}, {}
    for name, fn in fns.items():  # tracing and lowering are Python: one after another
        try:
            lowered[name] = fn.lower(x, *parts)
        except Exception as e:  # noqa: BLE001
            failed[name] = e
    ok = {}
    for name, fn in compile_all(lowered, threads, keep_errors=True).items():
        try:
            if isinstance(fn, Exception):
                raise fn
            jax.block_until_ready(fn(x, *parts))
            ok[name] = fn
        except Exception as e:  # noqa: BLE001
            failed[name] = e
    return ok, failed


def gpu_times(fns, x, parts, repeats):
    """``{name: Timing}`` of one call each: GPU time after an L2 flush (interleaved), or wall time
    off a GPU."""
    import jax

    from jspec.bench.timing import Timing, interleaved_gpu_times, time_fn

    calls = {name: (lambda fn=fn: fn(x, *parts)) for name, fn in fns.items()}
    if jax.default_backend() == "gpu":
        return {name: Timing.of(s) for name, s in interleaved_gpu_times(calls, repeats=repeats).items()}
    return {name: time_fn(call, repeats=repeats) for name, call in calls.items()}


def correctness(args, key):
    """``correctness`` rows: the kernel against the reference (max error over max |reference|), and
    ``weight_mismatches``: entries of the weight the kernel reads back through one-hot rows that differ
    from ``dequantize``'s (bf16 x: the widening's exactness)."""
    import jax
    import jax.numpy as jnp

    from jspec.quant import Scheme, quantize_matrix
    from pallas_kernels.matmul import quantized_kernel as qk
    from pallas_kernels.matmul.quantized_matmul import dequantize, quantized_matmul_reference

    schemes = [f for f in args.formats.split(",") if f != "bf16"]
    if args.tiny:  # one case a format (interpret mode compiles each for seconds)
        k, n = 256, 77
        cases = [(s, 3, i % 2 == 1, None) for i, s in enumerate(schemes)]
    else:
        k, n = 4096 - 128, 1000 - 9
        schemes = list(dict.fromkeys(schemes + ["int4-g32", "int4-g64-sym", "int8-g32-mins"]))
        cases = ([(s, m, t, None) for s in schemes for m in (1, 3, 17, 80) for t in (False, True)]
                 + [(s, 5, False, "silu") for s in schemes])
    rows = []
    for scheme, m, transposed, gated in cases:
        kx, kw = jax.random.split(jax.random.fold_in(key, m))
        shape = (n, k) if transposed else (k, 1024) if gated else (k, n)  # gated: halves of whole tiles
        w = (jax.random.normal(kw, shape) * k**-0.5).astype(jnp.bfloat16)
        q = quantize_matrix(w, Scheme.parse(scheme), transposed=transposed)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        rec = dict(measure="correctness", scheme=scheme, m=m, k=k, n=n, transposed=transposed, gated=gated)
        try:
            ref = quantized_matmul_reference(x, q.values, q.scales, q.mins, w_transposed=transposed, gated=gated)
            out = qk.quantized_matmul_pallas(x, q.values, q.scales, q.mins, w_transposed=transposed, gated=gated)
            scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) + 1e-30
            rec["err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)))) / scale
            rec["finite"] = bool(jnp.all(jnp.isfinite(out)))
            rec["ok"] = rec["finite"] and rec["err"] <= 2e-2
            if gated is None:  # one-hot rows read m of the kernel's weight rows back: dequantize's, bit for bit?
                picks = jnp.arange(m) * (k // m)
                read = qk.quantized_matmul_pallas(jnp.eye(k, dtype=x.dtype)[picks], q.values, q.scales, q.mins,
                                                  w_transposed=transposed)
                w_ref = dequantize(q.values, q.scales, q.mins, w_transposed=transposed)
                rec["weight_mismatches"] = int(jnp.sum(read != (w_ref[:, picks].T if transposed else w_ref[picks])))
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=repr(e)[:500])
        rows.append(rec)
    return rows


def measure(args, copy_tb_s, deadline):
    """``quant_matmul`` rows: GPU time and streamed TB/s of XLA and the kernel per shape, format, M."""
    import jax

    from pallas_kernels.matmul.skinny_tilings import GEMV_MAX_M

    rows = []
    for k, n, transposed in parse_shapes(args.shapes):
        weights = Weights(k, n, transposed, args.seed, args.k_first)
        for fmt in args.formats.split(","):
            parts = weights.parts(fmt)
            nbytes = sum(p.size * p.dtype.itemsize for p in parts)
            best = None
            for m in ints(args.ms):
                if time.time() > deadline:
                    print("deadline reached, measurement cut short", flush=True)
                    return rows
                x = jax.random.normal(jax.random.key(m), (m, k), jax.numpy.bfloat16)
                configs = []
                if args.sweep and m in ints(args.sweep_ms):
                    configs = candidates(fmt, m, k, n)
                elif best is not None and (m <= GEMV_MAX_M or not best.gemv):
                    configs = [best]
                row = dict(measure="quant_matmul", shape=f"{k}x{n}{'t' if transposed else ''}", k=k, n=n, m=m,
                           k_last=weights.quantized_transposed if fmt != "bf16" else transposed,
                           format=fmt, weight_bytes=nbytes, timings={}, gpu_us={}, tb_s={}, of_copy={})
                fns, failed = compiled(weights.functions(fmt, configs), x, parts, args.compile_threads)
                for name, e in failed.items():  # a tiling this GPU cannot run (e.g. out of shared memory) is left out
                    row.setdefault("failed_configs", []).append(f"{name.removeprefix('kernel ')}: {repr(e)[:200]}")
                configs = [c for c in configs if f"kernel {c}" in fns]
                try:
                    if failed.keys() & {"xla", "kernel"}:  # the row says so
                        raise failed.get("kernel", failed.get("xla"))
                    timings = gpu_times(fns, x, parts, args.repeats)
                except Exception as e:  # noqa: BLE001 (e.g. a default tiling the Triton compiler refuses)
                    rows.append(dict(row, error=repr(e)[:1000]))
                    continue
                if configs and args.sweep_refine:  # the two best again with other warps, stages, K steps
                    extra = refined(sorted(configs, key=lambda c: timings[f"kernel {c}"].median_s), k)
                    more, more_failed = compiled({name: fn for name, fn in weights.functions(fmt, extra).items()
                                                  if name.startswith("kernel ")}, x, parts, args.compile_threads)
                    for name, e in more_failed.items():
                        row.setdefault("failed_configs", []).append(f"{name.removeprefix('kernel ')}: {repr(e)[:200]}")
                    timings.update(gpu_times(more, x, parts, args.repeats) if more else {})
                    configs += [c for c in extra if f"kernel {c}" in more]
                if configs:
                    name, best = min(((f"kernel {c}", c) for c in configs), key=lambda nc: timings[nc[0]].median_s)
                    row["best_config"] = repr(best)
                    row["sweep_us"] = {tiling(c): timings[f"kernel {c}"].median_s * 1e6 for c in configs}
                    timings = {"xla": timings["xla"], "kernel": timings["kernel"], "kernel_best": timings[name]}
                for name, t in timings.items():
                    row["timings"][name] = t.as_dict("us")
                    row["gpu_us"][name] = t.median_s * 1e6
                    row["tb_s"][name] = nbytes / t.median_s / 1e12
                    row["of_copy"][name] = row["tb_s"][name] / copy_tb_s if copy_tb_s else None
                rows.append(row)
                print(f"{row['shape']} {fmt} M={m}: " + ", ".join(f"{a}={b:.1f}us ({row['tb_s'][a]:.2f} TB/s)"
                                                              for a, b in row["gpu_us"].items()), flush=True)
            del parts
        del weights
    return rows


def jax_copy_tb_s(args) -> float | None:
    """Device copy bandwidth by JAX (read + write of a buffer, GPU time), where torch gave none."""
    import jax
    import jax.numpy as jnp

    from jspec.bench.timing import gpu_seconds

    size = 1 << (20 if args.tiny else 30)
    buffer = jnp.ones((size // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    timing = gpu_seconds(lambda: copy(buffer), repeats=args.repeats)
    return None if timing is None else 2 * size / timing.median_s / 1e12


def run(args):
    if args.plot_only:
        plot(report.read(args.plot_only), os.path.splitext(args.plot_only)[0] + ".png")
        return 0
    if args.torch_only:
        from jspec.bench.quant_matmul_torch import run_torch

        return run_torch(args, parse_shapes(args.shapes), ints(args.ms))
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    t_start = time.time()
    path = os.path.join(args.out, "quant_matmul.json")
    env = report.environment(args.dtype, args.seed, weights="random inputs, quantized round-to-nearest")
    rows, copy = [], None

    def save():
        report.write(path, report.result("quant-matmul", args.argv, env, rows, copy_bandwidth=copy))

    if not args.skip_torch:
        torch, copy = torch_rows(args)
        rows += torch
        save()
    if copy is None:
        tb_s = jax_copy_tb_s(args)
        copy = None if tb_s is None else {"method": "jax_elementwise", "tb_s": tb_s}
    rows += [] if args.skip_correctness else correctness(args, jax.random.key(args.seed))
    failed = [r for r in rows if r["measure"] == "correctness" and not r["ok"]]
    print(f"correctness: {sum(r['measure'] == 'correctness' for r in rows) - len(failed)} ok, {len(failed)} failed",
          flush=True)
    for r in failed:
        print("FAIL", r, flush=True)
    save()
    rows += measure(args, (copy or {}).get("tb_s"), t_start + args.deadline)
    save()
    plot(report.read(path), os.path.join(args.out, "quant_matmul.png"))
    return 0


def plot(data, png):
    """One panel per shape: the streamed bytes' share of the copy bandwidth (TB/s where none was
    measured) against M, per format, for the kernel (solid), XLA (dashed) and torch (dotted)."""
    plt = report.pyplot()
    rows = report.rows(data, "quant_matmul")
    torch = [r for r in report.rows(data, "torch") if r.get("tb_s")]
    copy = (data.get("copy_bandwidth") or {}).get("tb_s")
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    if not shapes:
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.4 * len(shapes), 4), sharey=True, squeeze=False)
    colors = {}

    def line(ax, points, label, style, key):
        points = sorted((m, y / copy if copy else y) for m, y in points if y)
        if points:
            color = colors.setdefault(key, f"C{len(colors) % 10}")
            ax.plot(*zip(*points), style, color=color, label=label, ms=4)

    for ax, shape in zip(axes[0], shapes):
        for fmt in dict.fromkeys(r["format"] for r in rows):
            mine = [r for r in rows if r["shape"] == shape and r["format"] == fmt]
            for impl, style in (("kernel_best", "o-"), ("kernel", "o-"), ("xla", "s--")):
                if impl == "kernel" and any("kernel_best" in r["tb_s"] for r in mine):
                    continue
                line(ax, [(r["m"], r["tb_s"].get(impl)) for r in mine], f"{fmt} {impl}", style, fmt)
        for op in dict.fromkeys(r["op"] for r in torch):
            line(ax, [(r["m"], r["tb_s"]) for r in torch if r["shape"] == shape and r["op"] == op], op, "d:", op)
        ax.set_xscale("log", base=2)
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("M (rows)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bytes streamed / copy bandwidth" if copy else "TB/s streamed")
    axes[0][-1].legend(fontsize=6, loc="lower left")
    env = data["environment"]
    fig.suptitle(f"quantized skinny matmul (GPU time, L2 flushed), {env['device']}, jax {env['jax_version']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print("wrote", png)


TINY = dict(shapes="256x96t", ms="3", formats="bf16,int4-g64", repeats=2, skip_torch=True)


def register(subparsers):
    parent = common(out_help="output folder for quant_matmul.json/png (default $OUT or benchmarks)",
                    out_default=os.environ.get("OUT", "benchmarks"), repeats=20)
    ap = subcommand(subparsers, "quant-matmul",
                    help="quantized skinny matmul: GPU time and TB/s vs XLA's dequantize + dot and torch's kernels",
                    description=__doc__, run=run, parents=[parent], tiny=TINY)
    ap.add_argument("--shapes", default=SHAPES, help="comma list of KxN (a trailing t: the weight stored [N, K]); "
                    "quantized weights are stored K last ([N, K]) as jspec stores them, unless --k-first")
    ap.add_argument("--k-first", action="store_true", help="store quantized weights of KxN shapes [K, N]")
    ap.add_argument("--ms", default=MS, help="comma list of row counts M")
    ap.add_argument("--formats", default=FORMATS, help="comma list of bf16 and quantization schemes")
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's tilings at --sweep-ms")
    ap.add_argument("--sweep-ms", default="1,16", help="row counts the sweep tunes (others reuse the last best)")
    ap.add_argument("--sweep-refine", action="store_true",
                    help="after the sweep's grid, time its two best tilings with 2 / 4 / 8 warps, 2 / 3 / 5 stages "
                         "and two and four times longer K steps")
    ap.add_argument("--deadline", type=float, default=1e9,
                    help="seconds after start when the measurement stops (partial JSON)")
    ap.add_argument("--compile-threads", type=int, default=8, help="the sweep's tilings compile in parallel threads")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--torch-json", help=argparse.SUPPRESS)
    ap.add_argument("--plot-only", metavar="JSON", help="only draw the PNG from a JSON")
    return ap
