"""Interleaved comparison on a GPU: XLA dot vs the tiled kernel vs stream-K tilings (weight TB/s).

Usage: PYTHONPATH=. python scripts/compare_skinny_variants.py KxN,... M,... ROUNDS  (writes $OUT/sk_compare.json)
"""
import json, math, os, statistics, subprocess, sys, time
sys.path.insert(0, os.getcwd())
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp
import importlib
sm = importlib.import_module("pallas_kernels.skinny_matmul")
out_dir = os.environ.get("OUT", "/tmp")
SHAPES = [tuple(map(int, s.split("x"))) for s in sys.argv[1].split(",")]
MS = [int(v) for v in sys.argv[2].split(",")]
ROUNDS = int(sys.argv[3])
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "sms": sm._num_sms(), "rows": []}
# torch peer
tj = "/tmp/torch_sk.json"
p = subprocess.run([sys.executable, "scripts/bench_matmul.py", "--torch-only", "--torch-json", tj,
                    "--shapes", sys.argv[1], "--ms", sys.argv[2], "--extra-shapes", "", "--trials", "5"], capture_output=True, text=True)
if p.returncode == 0:
    res["torch"] = json.load(open(tj))
else:
    print(p.stderr[-2000:])
print("torch", {k: v for k, v in res.get("torch", {}).items() if "copy" in k}, flush=True)
C = sm.SkinnyConfig
VARIANTS = {
    "sk128x128w4s4": C(128, 128, 1, 4, 4, stream_k=1),
    "sk256x64w4s4": C(256, 64, 1, 4, 4, stream_k=1),
    "sk128x64w4s4x2": C(128, 64, 1, 4, 4, stream_k=2),
    "sk64x128w4s4x2": C(64, 128, 1, 4, 4, stream_k=2),
    "sk128x128w8s4": C(128, 128, 1, 8, 4, stream_k=1),
    "sk128x64w4s3x3": C(128, 64, 1, 4, 3, stream_k=3),
}
# correctness on GPU
def truth(x, w):
    return jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
corr = []
for m, k, n in [(1, 4096, 14336), (5, 14336, 4096), (16, 1000, 777), (3, 4100, 4104)]:
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(k), (k, n), jnp.bfloat16) / math.sqrt(k)
    t = truth(x, w); scale = float(jnp.abs(t).max())
    for name, cfg in VARIANTS.items():
        o = sm.skinny_matmul_pallas(x, w, config=cfg)
        err = float(jnp.abs(o.astype(jnp.float32) - t).max()) / scale
        corr.append(dict(m=m, k=k, n=n, v=name, err=err, finite=bool(jnp.isfinite(o.astype(jnp.float32)).all())))
bad = [c for c in corr if not (c["finite"] and c["err"] < 1e-2)]
print("correctness", len(corr) - len(bad), "/", len(corr), "ok", bad, flush=True)
res["correctness"] = corr

def time_fn(fn, xs, ws, calls=10, trials=5):
    f = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
    jax.block_until_ready(f(xs, ws)); jax.block_until_ready(f(xs, ws))
    tr = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            o = f(xs, ws)
        jax.block_until_ready(o)
        tr.append((time.perf_counter() - t0) / (calls * len(ws)))
    return statistics.median(tr)

fns = {"xla": sm.skinny_matmul_reference}
for r in range(ROUNDS):
    for k, n in SHAPES:
        nw = max(2, math.ceil(512e6 / (k * n * 2)))
        ks = jax.random.split(jax.random.key(r), 2 * nw)
        ws = [jax.random.normal(ks[i], (k, n), jnp.bfloat16) for i in range(nw)]
        for m in MS:
            xs = [jax.random.normal(ks[nw + i], (m, k), jnp.bfloat16) for i in range(nw)]
            row = dict(round=r, k=k, n=n, m=m, tbs={})
            cands = dict(fns)
            cands["tiled_default"] = lambda x, w, c=sm.default_config(m, k, n): sm.skinny_matmul_pallas(x, w, config=c)
            for name, cfg in VARIANTS.items():
                cands[name] = lambda x, w, c=cfg: sm.skinny_matmul_pallas(x, w, config=c)
            for name, fn in cands.items():
                try:
                    row["tbs"][name] = k * n * 2 / time_fn(fn, xs, ws) / 1e12
                except Exception as e:
                    row["tbs"][name] = None; print(name, repr(e)[:300])
            res["rows"].append(row)
            print(r, f"{k}x{n}/{m}", " ".join(f"{a}={b:.2f}" for a, b in row["tbs"].items() if b), flush=True)
            json.dump(res, open(os.path.join(out_dir, "sk_compare.json"), "w"), indent=1)
        del ws, xs
