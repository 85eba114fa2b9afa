"""kernels draft-attention-gemma4: few-query attention against a long, read-only cache at Gemma 4's
shapes (the frozen-KV drafter's attention, and the target's own decode / verify).

Shapes (``--shapes``): 31B full layers 32 query / 4 KV heads, head_dim 512; 31B sliding layers
32 / 16, head_dim 256, window 1024; E4B full 8 / 2, head_dim 512; E4B sliding 8 / 2, head_dim 256,
window 512. Every shape x batch x context x query rows: the Pallas kernel (its default tiling,
``pallas_kernels.attention.decode_tiling.tiling``), the jnp reference, and cuDNN
(``jax.nn.dot_product_attention``) where it runs, on its own layout ``[batch, rows, kv_heads,
head_dim]`` made outside the timed region: the whole cache for full layers, only the rows a
sliding window can see for sliding layers (a ring buffer, cuDNN's best case). cuDNN has no
head_dim-512 path; its error is recorded.

Timing: each call's GPU time (the profiler's kernel times, all kernels of the call, after an L2
flush), the implementations interleaved in one trace, median of ``--repeats``; off a GPU (``--tiny``)
wall time. Bytes = K and V rows the attention must read (a sliding layer: the last ``window +
num_q - 1`` rows); fraction of copy = bytes / time over the device copy bandwidth of the same run.
Each row also holds the kernel's largest difference from the reference on its inputs.
``--variants``: other tilings of the kernel, timed in the same traces (a tuning sweep).
"""

from __future__ import annotations

import functools
import json
import time

import numpy as np

from jspec.bench import plots, report

SHAPES = {  # name: (num_q_heads, num_kv_heads, head_dim, window)
    "31b-full": (32, 4, 512, None),
    "31b-sliding": (32, 16, 256, 1024),
    "e4b-full": (8, 2, 512, None),
    "e4b-sliding": (8, 2, 256, 512),
}
TINY_SHAPES = {"tiny-full": (8, 2, 64, None), "tiny-sliding": (4, 2, 32, 24)}
NOTES = ("device_us: GPU time of all kernels of one call after an L2 flush (profiler), implementations "
         "interleaved, median of --repeats (off a GPU: wall time); kv_bytes: K and V rows the attention "
         "must read; cuDNN on its own [B, S, H, D] layout (sliding layers: a window-sized buffer)")


def visible_rows(context, num_q, window):
    """Cache rows the queries at the last ``num_q`` positions of ``context`` rows can see, together."""
    return context if window is None else min(context, window + num_q - 1)


def kv_bytes(shape, batch, context, num_q, itemsize=2):
    _, num_kv_heads, head_dim, window = shape
    return 2 * batch * num_kv_heads * head_dim * itemsize * visible_rows(context, num_q, window)


def _functions(shape, batch, context, num_q, variants, *, dtype, with_cudnn):
    """``{name: (fn, abstract args)}``: the kernel (default tiling and each variant), the reference
    and cuDNN; every fn takes ``(q, k, v, lens, pos)`` as :func:`_inputs` makes them."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention.decode_attention import (
        decode_attention, decode_attention_pallas, decode_attention_reference, wide_head_kernel)
    from pallas_kernels.attention.wide_head_decode import decode_attention_wide
    from pallas_kernels.attention.wide_head_swapped import decode_attention_swapped

    num_q_heads, num_kv_heads, head_dim, window = shape
    dtype = jnp.dtype(dtype)
    args = (jax.ShapeDtypeStruct((batch, num_q, num_q_heads, head_dim), dtype),
            *[jax.ShapeDtypeStruct((batch, num_kv_heads, context, head_dim), dtype)] * 2,
            jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch, num_q), jnp.int32))
    # "pallas": the kernel the dispatcher runs for impl="pallas" (Triton, or a wide-head kernel);
    # "triton": the Triton kernel too where the dispatcher picks a wide-head one.
    fns = {"pallas": functools.partial(decode_attention, impl="pallas", window=window, scale=1.0)}
    if wide_head_kernel(batch, num_q, num_q_heads, num_kv_heads, context, head_dim, dtype, window=window):
        fns["triton"] = functools.partial(decode_attention_pallas, window=window, scale=1.0)
    mosaic_kernels = {"wide": decode_attention_wide, "swapped": decode_attention_swapped}  # full layers only
    for name, kw in [(f"variant{i}", kw) for i, kw in enumerate(variants)]:
        kw = dict(kw)
        kernel = kw.pop("kernel", "triton")
        if kernel in mosaic_kernels:
            fns[name] = functools.partial(mosaic_kernels[kernel], scale=1.0, **kw)
        else:
            fns[name] = functools.partial(decode_attention_pallas, window=window, scale=1.0, **kw)
    fns["xla"] = functools.partial(decode_attention_reference, window=window, scale=1.0)
    out = {name: (lambda q, k, v, lens, pos, fn=fn: fn(q, k, v, lens, q_positions=pos), args)
           for name, fn in fns.items()}
    if with_cudnn:
        rows = visible_rows(context, num_q, window)
        cudnn_args = (args[0], *[jax.ShapeDtypeStruct((batch, rows, num_kv_heads, head_dim), dtype)] * 2, args[3])
        out["cudnn"] = (lambda q, k, v, lens: jax.nn.dot_product_attention(
            q, k, v, scale=1.0, key_value_seq_lengths=lens, implementation="cudnn"), cudnn_args)
    return out


def _inputs(shape, batch, context, num_q, *, seed, dtype):
    """Random inputs (every sequence ``context`` rows long) and cuDNN's layout of them: the K/V
    rows it can see as ``[batch, rows, kv_heads, head_dim]`` with their count as lengths."""
    import jax
    import jax.numpy as jnp

    from jspec.bench.kernel_check import decode_attention_inputs

    num_q_heads, num_kv_heads, head_dim, window = shape
    q, k, v, lens, pos = decode_attention_inputs(batch, num_q, num_q_heads, num_kv_heads, context, head_dim,
                                                 [context] * batch, seed=seed, dtype=jnp.dtype(dtype))
    rows = visible_rows(context, num_q, window)

    def cudnn_layout():
        kc, vc = jax.jit(lambda k, v: [jnp.swapaxes(x[:, :, context - rows:], 1, 2) for x in (k, v)])(k, v)
        return (q, kc, vc, jnp.full((batch,), rows, jnp.int32))

    return (q, k, v, lens, pos), cudnn_layout


def compile_grid(configs, shapes, variants, *, dtype, with_cudnn, threads=16):
    """``{(config, name): executable or error string}`` for every row of the grid, compiled in
    parallel threads before anything is timed."""
    import concurrent.futures

    import jax

    lowered, out = {}, {}
    for cfg in configs:
        name, batch, context, num_q = cfg
        for impl, (fn, args) in _functions(shapes[name], batch, context, num_q, variants, dtype=dtype,
                                           with_cudnn=with_cudnn).items():
            try:
                lowered[cfg, impl] = jax.jit(fn).trace(*args).lower()
            except Exception as exc:  # noqa: BLE001 - e.g. cuDNN refusing head_dim 512
                out[cfg, impl] = f"{type(exc).__name__}: {str(exc)[:300]}"

    def compile_one(low):
        try:
            return low.compile()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {str(exc)[:300]}"

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        out.update(zip(lowered, pool.map(compile_one, lowered.values())))
    return out


def measure_row(cfg, shapes, executables, *, variants=(), repeats=5, seed=0, dtype="bfloat16"):
    """One table row: GPU time per implementation, the kernel's error against the reference."""
    import jax

    from jspec.bench.timing import Timing, interleaved_gpu_times, time_fn
    from pallas_kernels.attention.decode_attention import wide_head_kernel
    from pallas_kernels.attention.decode_tiling import tiling

    shape_name, batch, context, num_q = cfg
    num_q_heads, num_kv_heads, head_dim, window = shape = shapes[shape_name]
    row = dict(measure="draft_attention", shape=shape_name, batch=batch, context=context, num_q=num_q,
               num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window,
               kv_bytes=kv_bytes(shape, batch, context, num_q),
               config=tiling(batch, num_q, num_q_heads, num_kv_heads, context, head_dim, window=window),
               kernel=jax.default_backend() == "gpu" and wide_head_kernel(
                   batch, num_q, num_q_heads, num_kv_heads, context, head_dim, dtype, window=window) or "triton",
               device_us={}, timings={}, errors={})
    inputs, cudnn_layout = _inputs(shape, batch, context, num_q, seed=seed, dtype=dtype)
    thunks = {}
    for (c, impl), exe in executables.items():
        if c != cfg:
            continue
        if isinstance(exe, str):
            row["errors"][impl] = exe
        else:
            thunks[impl] = functools.partial(exe, *(cudnn_layout() if impl == "cudnn" else inputs))
    outs = {}
    for name in list(thunks):  # the first call of each: warm-up, and the outputs to compare
        try:
            out = jax.block_until_ready(thunks[name]())
            if name != "cudnn":
                outs[name] = np.asarray(out, np.float32)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory in the reference
            row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            thunks.pop(name)
    ref = outs.pop("xla", None)
    errs = {name: float(np.max(np.abs(out - ref))) for name, out in outs.items()} if ref is not None else {}
    if "pallas" in outs:
        row["finite"] = bool(np.isfinite(outs["pallas"]).all())
        row["max_abs_err"] = errs.get("pallas")
    del outs, ref
    if jax.default_backend() == "gpu":
        samples = interleaved_gpu_times(thunks, repeats=repeats)
        timings = {name: Timing.of(s) for name, s in samples.items() if s}
    else:
        timings = {name: time_fn(thunk, warmup=0, repeats=repeats) for name, thunk in thunks.items()}
    for name, t in timings.items():
        row["device_us"][name] = t.median_s * 1e6
        row["timings"][name] = t.as_dict("us")
    if variants:
        row["variants"] = [dict(kernel_kw=kw, device_us=row["device_us"].pop(f"variant{i}", None),
                                max_abs_err=errs.get(f"variant{i}"), error=row["errors"].pop(f"variant{i}", None))
                           for i, kw in enumerate(variants)]
        for i in range(len(variants)):
            row["timings"].pop(f"variant{i}", None)
    return row


def finish_row(row, copy_tb_s):
    """Bandwidth, fraction of copy and speed-ups from the GPU times."""
    times = row["device_us"]
    row["tb_s"] = {name: row["kv_bytes"] / (t * 1e-6) / 1e12 for name, t in times.items() if t}
    if copy_tb_s:
        row["frac_of_copy"] = {name: b / copy_tb_s for name, b in row["tb_s"].items()}
    kernel = times.get("pallas")
    for other in ("xla", "cudnn"):
        row[f"speedup_vs_{other}"] = times[other] / kernel if kernel and times.get(other) else None
    return row


# Grid rows compiled together (in parallel threads) before they are timed: a run cut short by a
# time limit keeps every row of the chunks it finished (a full grid can take minutes to compile).
COMPILE_CHUNK = 16


def run(args, env, copy):
    """The grid of ``--shapes`` x ``--batches`` x ``--contexts`` x ``--queries`` -> JSON (+ PNG)."""
    import jax

    shapes = TINY_SHAPES if args.tiny else SHAPES
    names = [name for name in args.shapes if name in shapes] if args.shapes else list(shapes)
    variants = json.loads(args.variants) if args.variants else []
    configs = [(name, b, c, nq) for name in names for nq in args.queries for b in args.batches for c in args.contexts]
    configs = [cfg for cfg in configs
               if 2 * cfg[1] * shapes[cfg[0]][1] * shapes[cfg[0]][2] * 2 * cfg[2] <= args.max_kv_gb * 1e9]
    path = args.out / "draft_attention_gemma4.json"
    rows = []
    for start in range(0, len(configs), COMPILE_CHUNK):
        chunk = configs[start:start + COMPILE_CHUNK]
        t0 = time.time()
        executables = compile_grid(chunk, shapes, variants, dtype=args.dtype,
                                   with_cudnn=jax.default_backend() == "gpu")
        print(f"compiled {len(executables)} programs in {time.time() - t0:.1f} s", flush=True)
        for i, cfg in enumerate(chunk, start):
            name, batch, context, num_q = cfg
            t0 = time.time()
            row = measure_row(cfg, shapes, executables, variants=variants, repeats=args.repeats, seed=args.seed,
                              dtype=args.dtype)
            rows.append(finish_row(row, copy["tb_s"] if copy else None))
            frac = (row.get("frac_of_copy") or {}).get("pallas")
            print(f"[{i + 1}/{len(configs)}] {name} b{batch} ctx{context} q{num_q}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in row["device_us"].items()) + (f" us, kernel {frac:.2f} of copy" if frac else "")
                + "".join(f", v{j} {v['device_us']:.1f}" for j, v in enumerate(row.get("variants", [])) if v["device_us"])
                + f" ({time.time() - t0:.1f} s)", flush=True)
            report.write(path, report.result("kernels draft-attention-gemma4", args.argv, env, rows,
                                             copy_bandwidth=copy, notes=NOTES))
        del executables
    try:
        plots.draft_attention(report.read(path), path.with_suffix(".png"))
    except Exception as exc:  # noqa: BLE001 - no matplotlib: the JSON is enough, plot later
        print("plot failed:", exc)
    _print_table(rows)
    return rows


def _print_table(rows):
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    print("| shape | batch | context | rows | MB read | kernel us | reference us | cuDNN us | kernel frac of copy "
          "| vs reference | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        us = r["device_us"]
        print(f"| {r['shape']} | {r['batch']} | {r['context']} | {r['num_q']} | {r['kv_bytes'] / 1e6:.0f} | "
              f"{fmt(us.get('pallas'))} | {fmt(us.get('xla'))} | {fmt(us.get('cudnn'))} | "
              f"{fmt((r.get('frac_of_copy') or {}).get('pallas'), '.2f')} | {fmt(r.get('speedup_vs_xla'), '.2f')}x | "
              f"{fmt(r.get('speedup_vs_cudnn'), '.2f')}x |")


def add_flags(p):
    from jspec.bench.flags import ints

    p.add_argument("--shapes", type=lambda s: [t for t in s.split(",") if t], default=None,
                   help=f"comma-separated, from {sorted(SHAPES)} (default all)")
    p.add_argument("--batches", type=ints, default=[1, 8, 32])
    p.add_argument("--contexts", type=ints, default=[4096, 32768, 131072])
    p.add_argument("--queries", type=ints, default=[1, 5, 9])
    p.add_argument("--max-kv-gb", type=float, default=40.0, help="skip sizes whose K+V exceed this (default 40 GB)")
    p.add_argument("--variants", default="", help="JSON list of kernel tilings to time beside the default, "
                   "e.g. '[{\"block_m\": 16, \"block_k\": 32, \"num_stages\": 2}, {\"num_warps\": 8}]'; "
                   "\"kernel\": \"wide\" times pallas_kernels.attention.wide_head_decode with the other keys, \"swapped\" "
                   "pallas_kernels.attention.wide_head_swapped (the rows on WGMMA's N axis)")


TINY = dict(batches=[2], contexts=[40], queries=[3], repeats=2)
