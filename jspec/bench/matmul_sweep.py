"""The timed programs of ``matmul`` and its time-boxed tuning sweep of the kernel's tilings."""

from __future__ import annotations

import functools
import math
import time

from tqdm.auto import tqdm

from jspec.bench.matmul_torch import n_weights, parse_ints, parse_shapes
from jspec.bench.timing import Timing, gpu_kernel_times, time_fn


class Bench:
    """Distinct (x_i, w_i) pairs multiplied by one jitted program per matmul function, timed by
    wall clock (``--calls`` back-to-back dispatches a sample) and by the kernels' GPU time."""

    def __init__(self, sm, args):
        self.sm, self.args, self.programs = sm, args, {}

    def inputs(self, k, n, m, nw, seed):
        import jax
        import jax.numpy as jnp

        keys = jax.random.split(jax.random.key(seed + self.args.seed), 2 * nw)
        dtype = jnp.dtype(self.args.dtype)
        ws = [jax.random.normal(keys[i], (k, n), dtype) for i in range(nw)]
        xs = [jax.random.normal(keys[nw + i], (m, k), dtype) for i in range(nw)]
        jax.block_until_ready((ws, xs))
        return xs, ws

    def program(self, fn):
        """One jitted program per matmul function, shared by the wall and the GPU timing."""
        import jax

        if fn not in self.programs:
            self.programs[fn] = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
        return self.programs[fn]

    def kernel(self, cfg):
        return lambda x, w: self.sm.skinny_matmul_pallas(x, w, config=cfg)

    def wall(self, fn, xs, ws, calls=None) -> Timing:
        """Seconds per matmul."""
        f = self.program(fn)
        timing = time_fn(functools.partial(f, xs, ws), warmup=2, repeats=self.args.repeats,
                         calls=calls or self.args.calls)
        return timing.per(len(ws))

    @staticmethod
    def tb_s(k, n, seconds):
        return k * n * 2 / seconds / 1e12

    def device_tb_s(self, fn, xs, ws):
        """Weight TB/s from the GPU time of all the kernels of one matmul (profiler), and from the
        Pallas kernel's own time alone (without the split-K sum that XLA runs after it)."""
        kernels = gpu_kernel_times(functools.partial(self.program(fn), xs, ws))
        if not kernels:
            return None, None
        k, n = ws[0].shape
        total = sum(t for _, t in kernels) / len(ws)
        own = sum(t for name, t in kernels if "skinny_matmul" in name) / len(ws)
        return self.tb_s(k, n, total), (self.tb_s(k, n, own) if own else None)


class Best:
    """The sweep's rows and the best tiling per (shape, M)."""

    def __init__(self, sm, sweep_ms):
        self.sm, self.sweep_ms, self.rows, self.best = sm, sweep_ms, [], {}

    def config(self, text):  # our own repr(SkinnyConfig(...))
        return eval(text, {"SkinnyConfig": self.sm.SkinnyConfig})  # noqa: S307

    def tuned_config(self, m, k, n):
        """The best swept tiling of the nearest swept M (log scale)."""
        cands = [mm for mm in self.sweep_ms if (k, n, mm) in self.best]
        if not cands:
            return None
        mm = min(cands, key=lambda v: (abs(math.log2(v) - math.log2(m)), v))
        return self.config(self.best[k, n, mm])


def stage_a(sm, m, k, n):
    """~15 tilings per shape: the square 128x128 tile, split-1
    narrow tiles (4 and 6 stages), wide-N tiles, a 2-CTA/SM tile; split-K chosen for >= 2 waves
    of programs."""
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


def sweep(sm, args, bench: Bench) -> Best:
    """Phase a: the stage-a family of each (shape, M); phase b (``--sweep-phase-b``): warps and
    stages around the best. Scored by the kernels' GPU time where the profiler has it (steady
    to ~2%), else by wall time (+-10% run to run on a shared GPU). Stops at ``--sweep-budget``."""
    best = Best(sm, parse_ints(args.sweep_ms))
    if args.sweep_budget <= 0:
        return best
    deadline = time.time() + args.sweep_budget
    scores = {}
    for phase in ("a", "b") if args.sweep_phase_b else ("a",):
        for m in best.sweep_ms:
            for k, n in parse_shapes(args.sweep_shapes or args.shapes):
                if time.time() > deadline:
                    break
                recs = scores.setdefault((k, n, m), {})
                if phase == "a":
                    cands = [sm.default_config(m, k, n)] + stage_a(sm, m, k, n)
                else:
                    top = best.config(max(recs, key=recs.get))
                    cands = [sm.SkinnyConfig(top.block_n, top.block_k, top.split_k, nwp, st)
                             for nwp, st in ((4, 3), (4, 6), (8, 4), (8, 6), (2, 4))]
                bench.programs.clear()
                xs, ws = bench.inputs(k, n, m, n_weights(k, n, args.sweep_bytes), 1)
                if phase == "a" and args.sweep_xla:
                    timing = bench.wall(sm.skinny_matmul_reference, xs, ws, calls=args.sweep_calls)
                    best.rows.append(dict(measure="sweep", shape=f"{k}x{n}", k=k, n=n, m=m, config="xla",
                                          tb_s=bench.tb_s(k, n, timing.median_s),
                                          timings={"wall": timing.as_dict("us")}))
                for cfg in tqdm(cands, desc=f"sweep {phase} {k}x{n}/{m}", mininterval=10):
                    if repr(cfg) in recs or time.time() > deadline:
                        continue
                    row = dict(measure="sweep", shape=f"{k}x{n}", k=k, n=n, m=m, config=repr(cfg), phase=phase)
                    try:
                        score = bench.device_tb_s(bench.kernel(cfg), xs, ws)[0] if args.device_time else None
                        if score is None:
                            timing = bench.wall(bench.kernel(cfg), xs, ws, calls=args.sweep_calls)
                            score = bench.tb_s(k, n, timing.median_s)
                            row["timings"] = {"wall": timing.as_dict("us")}
                        row.update(tb_s=score, score="wall" if "timings" in row else "gpu_time")
                    except Exception as e:  # noqa: BLE001
                        score = -1.0
                        row.update(tb_s=None, error=repr(e)[:200])
                        print("config failed", cfg, repr(e)[:200], flush=True)
                    recs[repr(cfg)] = score
                    best.rows.append(row)
                del xs, ws
                if recs:
                    top = max(recs, key=recs.get)
                    best.best[k, n, m] = top
                    print(f"best {k}x{n}/{m}: {top} {recs[top]:.3f} TB/s "
                          f"(default {recs.get(repr(sm.default_config(m, k, n)), -1):.3f})", flush=True)
    best.rows += [dict(measure="sweep_best", shape=f"{k}x{n}", k=k, n=n, m=m, config=cfg, tb_s=scores[k, n, m][cfg])
                  for (k, n, m), cfg in best.best.items()]
    return best
