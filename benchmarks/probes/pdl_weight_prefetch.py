"""Does a matmul that reads its first weight tiles before waiting on the kernel before it hide its ramp?

Under programmatic dependent launch (on by default in jaxlib 0.11.2 / 0.12 on Hopper) a kernel may
start while its predecessor runs, and ``griddepcontrol.wait`` holds it until the predecessor has
finished and its writes are visible. XLA compiles every Triton kernel, our Pallas ones included,
with that wait at its very entry (XLA's ``insert_pdl_ops``: unconditionally, no opt-out for
``__gpu$xla.gpu.triton`` custom calls), so nothing a Triton kernel does overlaps its predecessor.
A Mosaic GPU kernel places its own wait (``plgpu.griddepcontrol_wait``). A decode step's weights
never depend on the kernel before, so a weight-streaming matmul could put its first TMA loads in
flight before it waits: the megakernels' trick, at a kernel boundary.

The candidate: x ``[64, K]`` (rows padded to WGMMA's M tile) times W ``[K, N]``; grid (column tile,
K split); a ring of ``stages`` shared-memory slots, each a W tile and an x tile loaded by TMA; WGMMA
per slot; fp32 partials ``[split, 8, N]`` summed by XLA (bf16 ``[1, 8, N]`` without a split). Two
forms differ only in where the wait is: ``"entry"`` before any load, ``"prefetch"`` after the first
``stages`` weight tiles are issued (x, which the predecessor writes, is loaded after it). Both let
their dependents launch at entry.

Timed (GPU time of a whole chain after an L2 flush, interleaved, and its wall time): 16
Llama-3.2-1B-shaped layers at batch 1 -- RMSNorm, q/k/v, an elementwise stand-in for attention, o +
residual, RMSNorm, gate/up, SiLU * up, down + residual, each between-matmul op one XLA fusion -- with
the matmuls on each form and on the library's Triton skinny matmul. Found on the H100 (jaxlib 0.11.2,
``benchmarks/pdl_weight_prefetch_h100.json``): the two forms tie because XLA's command buffers launch
the Mosaic kernels after their predecessors end (12-14 of 64 start early; the Triton ones 64 of 64). H100::

    PYTHONPATH=. python benchmarks/probes/pdl_weight_prefetch.py   # writes $OUT/pdl_weight_prefetch.json
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

ROWS = 64  # WGMMA's M tile; x's rows (8: a decode row and its padding) fill its first rows


def mosaic_matmul(x, w, *, wait: str, split: int, block_n: int = 128, block_k: int = 128, stages: int = 3,
                  interpret: bool = False):
    """``x [R, K] @ w [K, N]`` (R a multiple of 8 up to 64) -> fp32 ``[split, R, N]`` partials (bf16
    ``[1, R, N]`` when ``split == 1``); ``wait``: ``"entry"`` or ``"prefetch"`` (see the module docstring).
    The tile's rows past R hold whatever shared memory held: they only reach output rows never written."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (rows, k), (k2, n) = x.shape, w.shape
    if rows % 8 or rows > ROWS or k != k2 or k % (split * block_k) or n % block_n:
        raise ValueError(f"needs x [R <= {ROWS}, a multiple of 8, K], w [K, N], K a multiple of split * block_k, "
                         f"N of block_n: {x.shape} {w.shape} split={split}")
    if wait not in ("entry", "prefetch"):
        raise ValueError(f"wait must be 'entry' or 'prefetch', got {wait!r}")
    k_per_split = k // split
    steps = k_per_split // block_k
    stages = min(stages, steps)
    out_dtype = x.dtype if split == 1 else jnp.float32

    def kernel(x_ref, w_ref, out_ref, scratch):
        (x_smem, w_smem, o_smem), (x_ready, w_ready) = scratch
        col, part = lax.axis_index("n"), lax.axis_index("split")
        first = part * k_per_split
        cols = pl.ds(col * block_n, block_n)

        def w_tile(step):
            return w_ref.at[pl.ds(first + step * block_k, block_k), cols]

        def x_tile(step):
            return x_ref.at[:, pl.ds(first + step * block_k, block_k)]

        if not interpret:
            plgpu.griddepcontrol_launch_dependents()
            if wait == "entry":
                plgpu.griddepcontrol_wait()
        for i in range(stages):  # weights: independent of the kernel before
            plgpu.copy_gmem_to_smem(w_tile(i), w_smem.at[i], w_ready.at[i])
        if not interpret and wait == "prefetch":
            plgpu.griddepcontrol_wait()
        for i in range(stages):
            plgpu.copy_gmem_to_smem(x_tile(i), x_smem.at[i, pl.ds(0, rows)], x_ready.at[i])

        def step(i, acc):
            slot = lax.rem(i, stages)
            plgpu.barrier_wait(w_ready.at[slot])
            plgpu.barrier_wait(x_ready.at[slot])

            def product(acc_ref):
                plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot])

            acc = pl.run_state(product)(plgpu.ACC.init(acc))  # the slot is read once this returns

            @pl.when(i + stages < steps)
            def _refill():
                plgpu.copy_gmem_to_smem(w_tile(i + stages), w_smem.at[slot], w_ready.at[slot])
                plgpu.copy_gmem_to_smem(x_tile(i + stages), x_smem.at[slot, pl.ds(0, rows)], x_ready.at[slot])

            return acc

        acc = plgpu.layout_cast(jnp.zeros((ROWS, block_n), jnp.float32), plgpu.Layout.WGMMA)
        acc = lax.fori_loop(0, steps, step, acc)
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], out_ref.at[part, :, cols])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def entry(x_ref, w_ref, out_ref):
        swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scratch: kernel(x_ref, w_ref, out_ref, scratch),
            (plgpu.SMEM((stages, ROWS, block_k), x.dtype, transforms=swizzled),
             plgpu.SMEM((stages, block_k, block_n), w.dtype, transforms=swizzled),
             plgpu.SMEM((ROWS, block_n), out_dtype)),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        )

    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((split, rows, n), out_dtype), grid=(n // block_n, split),
        grid_names=("n", "split"), interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(x, w)


# Llama-3.2-1B at batch 1: (K, N, K splits) of q/k/v, o, gate/up, down; splits fill the 132 SMs with 128-column tiles
SHAPES_1B = {"qkv": (2048, 3072, 4), "o": (2048, 2048, 8), "gate_up": (2048, 16384, 1), "down": (8192, 2048, 8)}
HIDDEN, INTERMEDIATE = 2048, 8192
BLOCK = 1024  # columns per program of the elementwise kernels


def _interpret() -> bool:
    # PROBE_LOWER_FOR_CUDA=1: lower the Mosaic kernels for CUDA on a CPU machine (a check of the
    # kernel's lowering before a GPU run) instead of interpreting them.
    return jax.default_backend() != "gpu" and not os.environ.get("PROBE_LOWER_FOR_CUDA")


def matmul_parts(kind: str, x, w, split: int):
    """Split-K partials ``[splits, R, N]`` of ``x [R, K] @ w`` by ``kind``: "triton" (the library's skinny
    matmul, its own splits), "entry" / "prefetch" (:func:`mosaic_matmul`, ``split`` splits)."""
    if kind == "triton":
        from pallas_kernels.skinny_matmul import skinny_matmul_pallas

        return skinny_matmul_pallas(x, w, split_parts=True)
    return mosaic_matmul(x, w, wait=kind, split=split, interpret=_interpret())


def _triggering_call(kernel, grid, in_specs, out_specs, out_shape):
    """A Triton kernel that lets its dependents launch at entry, as the library's kernels do."""
    from jax.experimental.pallas import triton as plgpu

    from pallas_kernels import pdl

    return pdl.pallas_call(kernel, interpret=_interpret(), grid=grid, in_specs=in_specs,
                           out_specs=out_specs, out_shape=out_shape,
                           compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))


def add_norm(h, parts):
    """``h [R, H]`` bf16 plus the parts' sum -> (the sum rounded, its RMSNorm (unit weight)), one row a program."""
    import jax.experimental.pallas as pl

    rows, hidden = h.shape
    splits = parts.shape[0]

    def kernel(h_ref, p_ref, h_out, x_out):
        v = (h_ref[...].astype(jnp.float32) + jnp.sum(p_ref[...].astype(jnp.float32), axis=0)).astype(jnp.bfloat16)
        v32 = v.astype(jnp.float32)
        h_out[...] = v
        x_out[...] = (v32 * lax.rsqrt(jnp.mean(v32 * v32, axis=-1, keepdims=True) + 1e-5)).astype(jnp.bfloat16)

    row = pl.BlockSpec((1, hidden), lambda r: (r, 0))
    return _triggering_call(kernel, (rows,), [row, pl.BlockSpec((splits, 1, hidden), lambda r: (0, r, 0))],
                            [row, row], [jax.ShapeDtypeStruct(h.shape, jnp.bfloat16)] * 2)(h, parts)


def attention_stand_in(qkv_parts):
    """``tanh`` of the q columns' sum (an elementwise stand-in for attention) -> ``[R, HIDDEN]`` bf16."""
    import jax.experimental.pallas as pl

    splits, rows, _ = qkv_parts.shape

    def kernel(p_ref, o_ref):
        o_ref[...] = jnp.tanh(jnp.sum(p_ref[...].astype(jnp.float32), axis=0)).astype(jnp.bfloat16)

    return _triggering_call(kernel, (rows, HIDDEN // BLOCK), [pl.BlockSpec((splits, 1, BLOCK), lambda r, j: (0, r, j))],
                            pl.BlockSpec((1, BLOCK), lambda r, j: (r, j)),
                            jax.ShapeDtypeStruct((rows, HIDDEN), jnp.bfloat16))(qkv_parts)


def silu_times_up(gate_up_parts):
    """``silu(gate) * up`` of ``[gate | up]`` partials -> ``[R, INTERMEDIATE]`` bf16."""
    import jax.experimental.pallas as pl

    splits, rows, _ = gate_up_parts.shape
    blocks = INTERMEDIATE // BLOCK

    def kernel(g_ref, u_ref, o_ref):
        g = jnp.sum(g_ref[...].astype(jnp.float32), axis=0).astype(jnp.bfloat16).astype(jnp.float32)
        u = jnp.sum(u_ref[...].astype(jnp.float32), axis=0).astype(jnp.bfloat16).astype(jnp.float32)
        o_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(jnp.bfloat16)

    return _triggering_call(kernel, (rows, blocks),
                            [pl.BlockSpec((splits, 1, BLOCK), lambda r, j: (0, r, j)),
                             pl.BlockSpec((splits, 1, BLOCK), lambda r, j: (0, r, j + blocks))],
                            pl.BlockSpec((1, BLOCK), lambda r, j: (r, j)),
                            jax.ShapeDtypeStruct((rows, INTERMEDIATE), jnp.bfloat16))(gate_up_parts, gate_up_parts)


def chain(kind: str, h, layers):
    """Llama-3.2-1B-shaped layers at batch 1 (see the module docstring): ``h [1, 2048]`` bf16 -> the last
    layer's residual ``[1, 2048]``. Every kernel between the matmuls is a Triton kernel that triggers its
    dependents at entry, as in the model."""
    rows = 1 if kind == "triton" else 8  # the Mosaic candidate reads 8-row tiles: rows 1..7 stay zero
    h = jnp.pad(h, ((0, rows - 1), (0, 0)))
    h, x = add_norm(h, jnp.zeros((1, rows, HIDDEN), jnp.float32))
    for wqkv, wo, wgu, wd in layers:
        attn = attention_stand_in(matmul_parts(kind, x, wqkv, SHAPES_1B["qkv"][2]))
        h, x = add_norm(h, matmul_parts(kind, attn, wo, SHAPES_1B["o"][2]))
        act = silu_times_up(matmul_parts(kind, x, wgu, SHAPES_1B["gate_up"][2]))
        h, x = add_norm(h, matmul_parts(kind, act, wd, SHAPES_1B["down"][2]))
    return h[:1]


def make_layers(num_layers: int, scale: float = 0.02, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), num_layers)
    layers = []
    for key in keys:
        ks = jax.random.split(key, 4)
        layers.append(tuple((scale * jax.random.normal(kk, (k, n), jnp.float32)).astype(jnp.bfloat16)
                            for kk, (k, n, _) in zip(ks, SHAPES_1B.values())))
    return layers


def check_one(kind: str, split: int, k: int = 512, n: int = 256, seed: int = 1):
    """Max |candidate - fp32 reference| of one product at a small shape (bf16 inputs, 8 rows)."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (8, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
    got = jnp.sum(jax.jit(functools.partial(matmul_parts, kind, split=split))(x, w).astype(jnp.float32), axis=0)
    want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    return float(jnp.max(jnp.abs(got - want)))


def launch_overlap(events, names):
    """Of the kernels whose name holds one of ``names``: how early each started before every earlier
    kernel had ended (us; > 0: launched as a programmatic dependent while its predecessor ran) and
    its own time (:func:`jspec.bench.timing.own_times`), medians and counts."""
    from jspec.bench.timing import own_times

    early, own, frontier = [], [], 0
    for (start, name, duration), (_, seconds) in zip(sorted(events), own_times(events)):
        if any(n in name for n in names):
            early.append((frontier - start) * 1e-3)
            own.append(seconds * 1e6)
        frontier = max(frontier, start + duration)
    if not early:
        return None
    return {"count": len(early), "started_early": sum(e > 0 for e in early),
            "early_us_median": statistics.median(early), "own_us_median": statistics.median(own)}


def main():
    out_dir = os.environ.get("OUT", ".")
    num_layers = int(os.environ.get("LAYERS", "16"))
    repeats = int(os.environ.get("REPEATS", "7"))
    kinds = os.environ.get("KINDS", "triton,entry,prefetch").split(",")
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": num_layers,
               "shapes_1b": SHAPES_1B, "weights": "random bf16", "checks": {}, "chain": {}}
    for kind in list(kinds):
        try:
            results["checks"][kind] = {s: check_one(kind, s) for s in (1, 2)}
        except Exception as e:  # a candidate that does not compile is reported, the others still run
            results["checks"][kind] = f"{type(e).__name__}: {e}"[:4000]
            kinds.remove(kind)
        print("check", kind, results["checks"][kind], flush=True)
    _write(out_dir, results)
    layers = make_layers(num_layers)
    h = jax.random.normal(jax.random.key(2), (1, HIDDEN), jnp.float32).astype(jnp.bfloat16)
    fns = {kind: jax.jit(functools.partial(chain, kind)) for kind in kinds}
    outs = {kind: fn(h, layers).astype(jnp.float32) for kind, fn in fns.items()}
    base = outs[kinds[0]]
    results["max_abs_diff_vs_first"] = {kind: float(jnp.max(jnp.abs(o - base))) for kind, o in outs.items()}
    if jax.default_backend() == "gpu":
        from jspec.bench.timing import interleaved_gpu_times, own_times, traced_events

        gpu = interleaved_gpu_times({kind: functools.partial(fns[kind], h, layers) for kind in kinds}, repeats=repeats)
        for kind in kinds:
            wall = []
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(20):
                    o = fns[kind](h, layers)
                jax.block_until_ready(o)
                wall.append((time.perf_counter() - start) / 20)
            events = traced_events([functools.partial(fns[kind], h, layers)])
            per_name: dict[str, float] = {}
            for name, seconds in own_times(events):
                per_name[name] = per_name.get(name, 0.0) + seconds
            results["chain"][kind] = {
                "gpu_us_median": statistics.median(gpu[kind]) * 1e6, "gpu_us": [t * 1e6 for t in gpu[kind]],
                "wall_us_median": statistics.median(wall) * 1e6, "kernels": len(events),
                "matmuls": launch_overlap(events, ("mosaic", "skinny_matmul")),
                "kernel_us": {name: round(s * 1e6, 2)
                              for name, s in sorted(per_name.items(), key=lambda kv: -kv[1])[:12]}}
            summary = {k: v for k, v in results["chain"][kind].items() if k not in ("kernel_us", "gpu_us")}
            print(kind, json.dumps(summary), flush=True)
    _write(out_dir, results)


def _write(out_dir, results):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "pdl_weight_prefetch.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
